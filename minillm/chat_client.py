"""Chat against a running `minillm serve`: streamed OpenAI-style completions over HTTP."""
from __future__ import annotations

import json
import time
from typing import Callable, Iterator

import httpx

from minillm import sse
from minillm.chat import ChatSettings, ContextTooShort, Conversation, ReplyStats, conversation_text, reply_room
from minillm.sse import LineSplitter, LineTooLong
from minillm.urls import (authorization_headers, check_credentials, client_endpoint, server_base_url, shown_url,
                          tls_failure)

# What a server's answers may hold before the chat stops reading: one stream line (a chunk event is
# a few hundred bytes), a whole answer that is no stream (a model list, an error), an error's text.
MAX_LINE_CHARS = 8 * 1024 * 1024
MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_MESSAGE_CHARS = 1000
# How long start-up's GET /v1/models waits for an answer: a server that takes the connection and never
# answers is reported, not waited on for the whole reply timeout (the openai client gives every
# request 600 s). A streamed reply keeps timeout_s.
STARTUP_READ_TIMEOUT_S = 15.0
# How long a count of the conversation's tokens (POST /tokenize, before a reply) waits for an answer:
# one that does not come is a count the server cannot give, as from a server without /tokenize.
TOKENIZE_READ_TIMEOUT_S = 15.0


class HttpChatBackend:
    """Replies from /v1/chat/completions, or /v1/completions for a model without a chat template."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None,
                 timeout_s: float = 600.0, chat_template: str | None = None) -> None:
        self.base_url = server_base_url(url)
        check_credentials(self.base_url, api_key)
        self.shown_url = shown_url(self.base_url)     # what messages say: no password
        http_base, uds = client_endpoint(self.base_url)
        self.client = httpx.Client(base_url=http_base, headers=authorization_headers(api_key),
                                   timeout=httpx.Timeout(timeout_s, connect=10.0),
                                   transport=httpx.HTTPTransport(uds=uds) if uds else None)
        self.context_len: int | None = None   # the model's max_model_len, as /v1/models lists it
        self.model = self._served_model(model)
        self.name = f"{self.model} at {self.shown_url}"
        self.chat_template = chat_template   # sent with each request (vLLM's chat_template field)
        self.has_chat_template = True        # until the server says otherwise
        self.last_stats: ReplyStats | None = None
        self.notices: list[str] = []
        self.stops_anywhere = True           # Ctrl-C need not wait for the next chunk of a stalled server
        self.counts_tokens = True            # until /tokenize leaves a count unanswered

    def template_text(self) -> str | None:
        """The chat template sent with each message (None: the server renders with its own)."""
        return self.chat_template

    def _served_model(self, model: str | None) -> str:
        """`model` (the first model the server lists when None), checked against /v1/models: a
        server that is not there, or does not serve it, fails here rather than at the first message."""
        models = self._models()
        chosen = models[0] if model is None else next((m for m in models if m.get("id") == model), None)
        if chosen is None:
            served = ", ".join(str(m.get("id")) for m in models)
            raise RuntimeError(f"the server at {self.shown_url} does not serve {model!r} (it serves: {served})")
        self._take_model(chosen)
        return chosen["id"]

    def _models(self) -> list[dict]:
        """The models /v1/models lists (at least one); RuntimeError when the server cannot say."""
        try:
            response, body = self._fetch("GET", "/v1/models", timeout=self._short_timeout(STARTUP_READ_TIMEOUT_S))
        except httpx.ReadTimeout:
            raise RuntimeError(f"the server at {self.shown_url} took the connection but did not answer GET "
                               f"/v1/models within {STARTUP_READ_TIMEOUT_S:g} s") from None
        except httpx.HTTPError as exc:
            raise RuntimeError(tls_failure(exc, self.shown_url)
                               or f"cannot reach a minillm server at {self.shown_url}: {exc}") from None
        _raise_for_status(response, body)
        try:
            # An entry without a string id names no model a request could ask for.
            models = [m for m in _json(body).get("data") or []
                      if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except (ValueError, AttributeError, TypeError):   # a body past MAX_BODY_BYTES too
            raise RuntimeError(f"{self.shown_url}/v1/models did not answer with a model list") from None
        if not models:
            raise RuntimeError(f"the server at {self.shown_url} lists no models")
        return models

    def _take_model(self, entry: dict) -> None:
        """Talk to the model of a /v1/models entry: its context, as the entry lists it (None: not listed)."""
        context_len = entry.get("max_model_len")
        is_count = isinstance(context_len, int) and not isinstance(context_len, bool) and context_len > 0
        self.context_len = context_len if is_count else None

    def _follow_renamed_model(self, body: bytes) -> bool:
        """After the server's 404 for the model (restarted under another --served-model-name, say): /v1/models
        read again, and the chat goes on with the one model it serves now, a notice saying so. False (the
        404 stands) when it serves several, or cannot say."""
        error = _error_field(body)
        if error.get("param") != "model" and error.get("code") != "model_not_found":
            return False
        try:
            models = self._models()
        except (RuntimeError, ValueError):
            return False
        if len(models) != 1 or models[0]["id"] == self.model:
            return False
        old, self.model = self.model, models[0]["id"]
        self._take_model(models[0])
        self.name = f"{self.model} at {self.shown_url}"
        self.notices.append(f"note: the server at {self.shown_url} no longer serves {old!r}; the chat goes on "
                            f"with {self.model!r}, the model it serves now.")
        return True

    def _short_timeout(self, read_s: float) -> httpx.Timeout:
        """The client's timeout with a read timeout of read_s (a request that is no streamed reply)."""
        return httpx.Timeout(self.client.timeout.read, connect=self.client.timeout.connect, read=read_s)

    def _fetch(self, method: str, path: str, **kwargs) -> tuple[httpx.Response, bytes]:
        """The response to a request that is no stream, and its body: at most MAX_BODY_BYTES of it,
        then b"" (a server whose answer never ends is not read without end)."""
        with self.client.stream(method, path, **kwargs) as response:
            return response, _read_capped(response)

    def _body(self, conversation: Conversation, settings: ChatSettings, max_tokens: int | None) -> dict:
        """The request body for the current endpoint (max_tokens None: the rest of the context)."""
        # top_k always: -1 and 0 (off) must override a top_k the model's generation_config sets on the server
        body: dict = {"model": self.model, "stream": True, "temperature": settings.temperature,
                      "top_p": settings.top_p, "top_k": settings.top_k, "max_tokens": max_tokens,
                      "stream_options": {"include_usage": True}}
        if settings.seed is not None:
            body["seed"] = settings.seed
        body.update(self._prompt_fields(conversation))
        return body

    def _prompt_fields(self, conversation: Conversation) -> dict:
        """The conversation as the current endpoint takes it: messages (with the chat template the
        chat was given) for a chat completion, the plain text continuation for a completion."""
        if not self.has_chat_template:
            return {"prompt": conversation_text(conversation)}
        fields: dict = {"messages": conversation.messages()}
        if self.chat_template:
            fields["chat_template"] = self.chat_template
        return fields

    def _open(self, conversation: Conversation, settings: ChatSettings,
              max_tokens: int | None, is_retry: bool = False) -> httpx.Response:
        """Send the request and return the streaming response once its status is known good (sent once
        more to the model the server serves now, when it no longer serves the chat's)."""
        path = "/v1/chat/completions" if self.has_chat_template else "/v1/completions"
        request = self.client.build_request("POST", path, json=self._body(conversation, settings, max_tokens))
        try:
            response = self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise RuntimeError(tls_failure(exc, self.shown_url)
                               or f"request to {self.shown_url} failed: {exc}") from None
        if response.status_code >= 400:
            body = _read_capped(response)
            response.close()
            if response.status_code == 404 and not is_retry and self._follow_renamed_model(body):
                return self._open(conversation, settings, max_tokens, is_retry=True)
            _raise_for_status(response, body)
        content_type = response.headers.get("content-type", "").partition(";")[0].strip()
        if content_type != "text/event-stream":
            # Another web server on the port, or a proxy's page: its body holds no event, and the
            # reply would be empty without a word.
            response.close()
            raise RuntimeError(f"{self.shown_url}{path} answered {content_type or 'no Content-Type'}, not a stream "
                               "of events: is this a minillm server?")
        return response

    def stream_reply(self, conversation: Conversation, settings: ChatSettings,
                     should_stop: Callable[[], bool]) -> Iterator[str]:
        """Open the stream now (errors surface here); the iterator yields the text deltas. A request
        that fails or is interrupted before its stream opens is the last reply /stats shows."""
        started = time.time()
        try:
            response, is_capped = self._open_reply(conversation, settings)
        except BaseException as exc:
            self.last_stats = ReplyStats(
                prompt_tokens=None, output_tokens=0, ttft_s=None, decode_s=None, total_s=time.time() - started,
                finish_reason="abort" if isinstance(exc, KeyboardInterrupt) else "error", source="client",
                max_tokens=settings.max_tokens, context_len=self.context_len)
            raise
        return self._stream(response, started, should_stop, settings.max_tokens, is_capped)

    def _open_reply(self, conversation: Conversation, settings: ChatSettings) -> tuple[httpx.Response, bool]:
        """_open_fitted, again as plain text continuation when the server says the model has no chat template."""
        try:
            return self._open_fitted(conversation, settings)
        except ContextLengthError:
            raise
        except ValueError as exc:
            if self.chat_template or not (self.has_chat_template and "template" in str(exc).lower()):
                raise
            self.has_chat_template = False
            self.notices.append("note: the served model has no chat template, so the "
                                "conversation runs as plain text continuation.")
            return self._open_fitted(conversation, settings)

    def _open_fitted(self, conversation: Conversation, settings: ChatSettings) -> tuple[httpx.Response, bool]:
        """Open the stream within the server's context as the in-process chat fits its own: the
        oldest exchanges go first (tried on a copy, kept only once the request fits), then the
        reply is capped at the rest of the context; (response, whether max_tokens was capped)."""
        trial = Conversation(conversation.system, list(conversation.turns))
        dropped, rest = self._drop_for_reply_room(trial, settings.max_tokens)
        max_tokens, is_capped = settings.max_tokens, False
        if rest is not None and rest < max_tokens:
            max_tokens, is_capped = rest, True
        while True:
            try:
                response = self._open(trial, settings, max_tokens)
                break
            except ContextLengthError as exc:
                if exc.param != "max_tokens" and not dropped and self._is_too_long_alone(trial):
                    raise     # found with one count, not a request per exchange dropped
                if trial.drop_oldest_exchange():
                    dropped += 1
                elif exc.param == "max_tokens" and not is_capped:
                    max_tokens, is_capped = self._rest_of_context(trial), True
                else:
                    raise
        if dropped:
            conversation.turns[:] = trial.turns
            where = f"the {self.context_len}-token context" if self.context_len else "the server's context"
            self.notices.append(f"(dropped the {dropped} oldest exchange(s) to fit {where})")
        return response, is_capped

    def _drop_for_reply_room(self, trial: Conversation, max_tokens: int) -> tuple[int, int | None]:
        """For a max_tokens that no prompt leaves room for (reply_room: half the context then), the
        oldest exchanges dropped from TRIAL until the prompt leaves half, as the server's /tokenize
        counts it: (exchanges dropped, the rest of the context); (0, None) when max_tokens is left
        to the server's refusals, which drop exchanges until it fits, or /tokenize cannot say."""
        if self.context_len is None or max_tokens <= self.context_len // 2 or len(trial.turns) <= 1:
            return 0, None
        num_alone, context = self._count_tokens(Conversation(trial.system, trial.turns[-1:]))
        if num_alone is None or context is None or reply_room(max_tokens, context, num_alone) == max_tokens:
            return 0, None
        dropped = 0
        while True:
            count, context = self._count_tokens(trial)
            if count is None or context is None:
                return dropped, None
            if context - count >= reply_room(max_tokens, context, num_alone) or not trial.drop_oldest_exchange():
                return dropped, (context - count if context > count else None)
            dropped += 1

    def _rest_of_context(self, conversation: Conversation) -> int | None:
        """max_tokens for a reply that takes the rest of the context: None (the server's own
        choice) for a chat completion; for a completion, whose default is 16 tokens, the context
        less the prompt as the server's /tokenize counts it (None when it cannot say)."""
        if self.has_chat_template:
            return None
        count, context = self._count_tokens(conversation)
        if count is not None and context is not None and context > count:
            return context - count
        return None

    def _is_too_long_alone(self, conversation: Conversation) -> bool:
        """Whether the newest message, with the system message only, fills the context (False when
        there are no earlier turns to drop, or the server's /tokenize cannot say)."""
        if len(conversation.turns) <= 1:
            return False
        count, context = self._count_tokens(Conversation(conversation.system, conversation.turns[-1:]))
        return count is not None and context is not None and count >= context

    def _count_tokens(self, conversation: Conversation) -> tuple[int | None, int | None]:
        """(prompt tokens, context) of the conversation as the server's /tokenize counts it; None
        for what it cannot say."""
        if not self.counts_tokens:
            return None, None
        body = {"model": self.model, **self._prompt_fields(conversation)}
        try:
            response, data = self._fetch("POST", "/tokenize", json=body, timeout=self._short_timeout(
                TOKENIZE_READ_TIMEOUT_S))
        except httpx.ReadTimeout:
            self.counts_tokens = False
            self.notices.append(f"note: {self.shown_url}/tokenize did not answer within {TOKENIZE_READ_TIMEOUT_S:g} s, "
                                "so the chat no longer counts tokens before a reply.")
            return None, None
        except httpx.HTTPError:
            return None, None
        try:
            answer = _json(data) if response.status_code == 200 else {}
            count, context = answer.get("count"), answer.get("max_model_len") or self.context_len
        except (ValueError, AttributeError):
            return None, None
        return (count if _count(count, -1) >= 0 else None), (context if _count(context, 0) > 0 else None)

    def _stream(self, response: httpx.Response, started: float,
                should_stop: Callable[[], bool], max_tokens: int, is_capped: bool = False) -> Iterator[str]:
        """Read server-sent events until [DONE]; closing the stream drops the connection."""
        first = last = None
        num_chunks, usage, finish_reason, prompt_tokens = 0, None, None, None
        try:
            for event in _events(response, self.shown_url):
                if should_stop():
                    finish_reason = "abort"
                    break
                usage = event.get("usage") if isinstance(event.get("usage"), dict) else usage
                for choice in _choices(event):
                    delta = _choice_text(choice)
                    finish_reason = _finish_reason(choice) or finish_reason
                    if delta:
                        last = time.time()
                        first = first or last
                        num_chunks += 1
                        yield delta
        except httpx.HTTPError as exc:
            finish_reason = "error"
            raise RuntimeError(f"the stream from {self.shown_url} broke: {exc}") from None
        except RuntimeError:
            finish_reason = "error"
            raise
        finally:
            response.close()
            if usage and _count(usage.get("prompt_tokens"), -1) >= 0:
                prompt_tokens = usage["prompt_tokens"]
            num_tokens = _count(usage.get("completion_tokens"), num_chunks) if usage else num_chunks
            if is_capped:      # the reply had only the rest of the context
                max_tokens = self.context_len - prompt_tokens if self.context_len and prompt_tokens else num_tokens
            self.last_stats = ReplyStats(
                prompt_tokens=prompt_tokens, output_tokens=num_tokens,
                ttft_s=None if first is None else first - started,
                decode_s=None if first is None else last - first,
                total_s=time.time() - started,
                finish_reason=finish_reason or ("abort" if should_stop() else None),
                source="client", max_tokens=max_tokens, context_len=self.context_len)


def _events(response: httpx.Response, base_url: str) -> Iterator[dict]:
    """The JSON payloads of a server-sent event stream, up to `data: [DONE]`; RuntimeError when
    the stream ends before it (a proxy or a server that cut the reply between two events)."""
    for line, is_cut in _lines(response):
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        if is_cut:      # an event the end of the stream cut off, which the SSE spec drops
            break
        try:
            event = sse.loads(data)
        except json.JSONDecodeError:
            raise RuntimeError(f"the server sent a stream event that is not JSON: {data[:60]!r}") from None
        except ValueError as exc:
            raise RuntimeError(f"the server sent a stream event of {exc}: {data[:60]!r}") from None
        if not isinstance(event, dict):
            raise RuntimeError(f"the server sent a stream event that is not a JSON object: {data[:60]!r}")
        if event.get("error") is not None:
            raise RuntimeError(f"server error: {_error_message(event)}")
        yield event
    raise RuntimeError(f"the stream from {base_url} ended before the reply finished (no data: [DONE])")


def _lines(response: httpx.Response) -> Iterator[tuple[str, bool]]:
    """The stream's lines (minillm.sse.LineSplitter), each with whether the stream ended inside it
    (no line end); RuntimeError for a line past MAX_LINE_CHARS."""
    splitter = LineSplitter(MAX_LINE_CHARS)
    try:
        for text in response.iter_text():
            yield from ((line, False) for line in splitter.feed(text))
    except LineTooLong as exc:
        raise RuntimeError(f"the server sent {exc} in its stream: is this a minillm server?") from None
    yield from ((line, True) for line in splitter.flush())


def _read_capped(response: httpx.Response) -> bytes:
    """The body of a response read as a stream: b"" past MAX_BODY_BYTES (left unread)."""
    data = bytearray()
    for chunk in response.iter_bytes():
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            return b""
    return bytes(data)


def _json(body: bytes):
    """The JSON value of a body; ValueError for one that is not UTF-8 JSON Python reads whole."""
    return sse.loads(body.decode("utf-8"))


def _choices(event: dict) -> list[dict]:
    """The choices of a stream chunk; RuntimeError for a chunk that is not the OpenAI shape."""
    choices = event.get("choices") or []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise RuntimeError(f"the server sent a stream event whose choices are not a list of objects: "
                           f"{json.dumps(choices)[:60]}")
    return choices


def _choice_text(choice: dict) -> str | None:
    """The new text of one choice: delta.content (a chat completion) or text (a completion)."""
    if "delta" in choice:
        delta = choice["delta"]
        if not isinstance(delta, dict):
            raise RuntimeError(f"the server sent a stream event whose delta is not an object: {json.dumps(delta)[:60]}")
        text, name = delta.get("content"), "delta.content"
    else:
        text, name = choice.get("text"), "text"
    if text is not None and not isinstance(text, str):
        raise RuntimeError(f"the server sent a stream event whose {name} is not a string: {json.dumps(text)[:60]}")
    return text


def _finish_reason(choice: dict) -> str | None:
    """The finish_reason of one choice (None while it runs); RuntimeError for one that is no string."""
    reason = choice.get("finish_reason")
    if reason is not None and not isinstance(reason, str):
        raise RuntimeError(f"the server sent a stream event whose finish_reason is not a string: "
                           f"{json.dumps(reason)[:60]}")
    return reason


def _count(value, default: int) -> int:
    """A token count from a usage object; default for anything but a non-negative integer."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


def _error_message(payload: dict) -> str:
    """The message of an OpenAI-style error body, on one line (its first MAX_MESSAGE_CHARS)."""
    error = payload.get("error", payload)
    return _one_line(str(error.get("message", error) if isinstance(error, dict) else error))


def _one_line(text: str) -> str:
    """TEXT (a server's message, a traceback it sent as its body) as one line of at most MAX_MESSAGE_CHARS."""
    return " ".join(text.split())[:MAX_MESSAGE_CHARS]


def _raise_for_status(response: httpx.Response, body: bytes) -> None:
    """ValueError for a 4xx (the request was bad), RuntimeError for anything else that failed."""
    if response.status_code < 400:
        return
    try:
        message = _error_message(_json(body))
    except (ValueError, AttributeError):     # not JSON, or not UTF-8 (UnicodeDecodeError)
        message = _text_message(response, body)
    if response.status_code in (401, 403):
        if "authorization" not in response.request.headers:
            raise RuntimeError(f"the server asks for an API key ({response.status_code}): pass --api-key KEY or "
                               f"set $OPENAI_API_KEY")
        raise RuntimeError(f"the server refused the API key ({response.status_code}): {message}")
    text = f"server answered {response.status_code}: {message}"
    error = _error_field(body)
    if response.status_code == 400 and error.get("code") == "context_length_exceeded":
        raise ContextLengthError(text, error.get("param"))
    cls = ValueError if 400 <= response.status_code < 500 else RuntimeError
    raise cls(text)


def _text_message(response: httpx.Response, body: bytes) -> str:
    """What an error body that is no JSON says: its text on one line; for a web page (a proxy's
    502 page), or nothing, the status's reason."""
    content_type = response.headers.get("content-type", "").partition(";")[0].strip().lower()
    text = "" if content_type == "text/html" else _one_line(body.decode("utf-8", "replace"))
    return text or response.reason_phrase


def _error_field(body: bytes) -> dict:
    """The error object of an OpenAI-style error body ({} when there is none)."""
    try:
        error = _json(body).get("error")
    except (ValueError, AttributeError):
        return {}
    return error if isinstance(error, dict) else {}


class ContextLengthError(ContextTooShort):
    """The server's 400 for a request that does not fit the context; param: the field it names."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param
