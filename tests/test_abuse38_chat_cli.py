"""`minillm chat` used as a user would: Ollama's /set system block and /set of no setting, Ctrl-C
pressed again as a reply winds up, and a server that fails in ways a real one does (a traceback as
its 500 body, a proxy's 502 page, a stream cut inside an event) each told in one line."""
from __future__ import annotations

import io
import json
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_chat import STORIES, needs_stories

from minillm.chat import ChatSession

TRACEBACK = "Traceback (most recent call last):\n  File \"app.py\", line 3, in handler\nKeyError: 'choices'\n"
PAGE_502 = "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<h1>502 Bad Gateway</h1>\r\n</body>\r\n</html>"


def chunk(text: str) -> bytes:
    """One chat completion stream event carrying TEXT."""
    event = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return f"data: {json.dumps(event)}\n\n".encode()


# What each served model's chat completion answers: (status, content type, body).
ANSWERS = {
    "traceback": (500, "text/plain", TRACEBACK.encode()),
    "proxy": (502, "text/html", PAGE_502.encode()),
    "multiline": (400, "application/json",
                  json.dumps({"error": {"message": "bad request:\n  messages.0: field required\n"}}).encode()),
    "cut": (200, "text/event-stream", chunk("Once upon ") + chunk("a time") + b'data: {"choices": [{"ind'),
    "event": (200, "text/event-stream",
                    chunk("Once ") + b'data: {"error": {"message": "engine failed:\\n  out of blocks"}}\n\n'),
}


class _Server(BaseHTTPRequestHandler):
    """/v1/models lists every ANSWERS key; a chat completion for one answers as ANSWERS says, then closes."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _answer(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def do_GET(self) -> None:
        models = [{"id": name, "max_model_len": 512} for name in ANSWERS]
        self._answer(200, "application/json", json.dumps({"data": models}).encode())

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/chat/completions":
            self._answer(404, "application/json", b'{"error": {"message": "not found"}}')
            return
        self._answer(*ANSWERS[request["model"]])


@pytest.fixture(scope="module")
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class _Recording:
    """A backend that answers every message with "ok" and keeps the conversations it was sent."""

    name = "recording"
    has_chat_template = True
    last_stats = None

    def __init__(self) -> None:
        self.sent: list[list[dict]] = []

    def stream_reply(self, conversation, settings, should_stop):
        self.sent.append(conversation.messages())
        yield "ok"


def run_lines(session: ChatSession, lines: list[str]) -> str:
    """Run the chat over LINES, then end of input; what it printed."""
    pending = iter(lines)

    def read_line(prompt: str) -> str:
        try:
            return next(pending)
        except StopIteration:
            raise EOFError from None

    session.run(read_line)
    return session.out.getvalue()


# ---- the /commands -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("line", ["/set verbose", "/set think", "/set parameter repeat_last_n"])
def test_set_of_no_setting_says_so_even_without_a_value(line):
    # It said "usage: /set verbose VALUE", as though verbose were a setting that wanted a value.
    out = run_lines(ChatSession(_Recording(), out=io.StringIO()), [line])
    assert "error: unknown setting" in out and "one of: temperature, top_p, top_k, max_tokens, seed" in out
    assert "usage:" not in out


def test_set_of_a_setting_without_a_value_still_shows_its_usage():
    out = run_lines(ChatSession(_Recording(), out=io.StringIO()), ["/set temperature"])
    assert "usage: /set temperature VALUE" in out


def test_ollamas_set_system_block_of_several_lines_is_the_system_message():
    # Ollama's /set system """ ... """: the block's lines were sent to the model as messages, one by
    # one, and the system message was the three quotes.
    backend = _Recording()
    session = ChatSession(backend, out=io.StringIO())
    run_lines(session, ['/set system """You are a pirate.', "Answer in rhymes.", '"""', "hello"])
    assert session.conversation.system == "You are a pirate.\nAnswer in rhymes."
    assert backend.sent == [[{"role": "system", "content": "You are a pirate.\nAnswer in rhymes."},
                             {"role": "user", "content": "hello"}]]


@pytest.mark.parametrize("line, system", [('/set system """Be brief."""', "Be brief."),
                                          ('/system """Be brief."""', "Be brief."),
                                          ("/system Be brief.", "Be brief.")])
def test_a_system_message_on_one_line_loses_its_triple_quotes(line, system):
    session = ChatSession(_Recording(), out=io.StringIO())
    run_lines(session, [line])
    assert session.conversation.system == system


def test_input_that_ends_inside_a_set_system_block_runs_no_command_and_sends_nothing():
    backend = _Recording()
    session = ChatSession(backend, system="Be kind.", out=io.StringIO())
    out = run_lines(session, ['/set system """You are', "hello"])
    assert "the command was not run" in out
    assert session.conversation.system == "Be kind." and backend.sent == []


# ---- Ctrl-C ------------------------------------------------------------------------------------------------

class _LateCtrlC(_Recording):
    """A backend whose reply is whole, and Ctrl-C is pressed twice as the chat reads its stats (the
    user stopping a reply that has just ended, or /stats)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_presses = 0

    @property
    def last_stats(self):
        self.num_presses += 2
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        return None


@pytest.fixture
def ctrl_c_interrupts():
    """SIGINT raising KeyboardInterrupt, as at a terminal's chat prompt."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_as_a_reply_ends_neither_ends_the_chat_nor_marks_the_reply(ctrl_c_interrupts):
    # Ctrl-C pressed a few times to stop a reply, the last press landing just after the reply's stream
    # was over: the KeyboardInterrupt ended the chat ("minillm: interrupted"), losing the conversation.
    backend = _LateCtrlC()
    session = ChatSession(backend, out=io.StringIO())
    try:
        out = run_lines(session, ["hello", "again"])
    except KeyboardInterrupt:
        pytest.fail("a Ctrl-C after the reply's stream ended the chat")
    assert backend.num_presses == 4 and len(backend.sent) == 2
    assert "[interrupted]" not in out
    assert [t["content"] for t in session.conversation.turns] == ["hello", "ok", "again", "ok"]


def test_ctrl_c_during_a_command_is_ctrl_c_at_the_prompt(ctrl_c_interrupts):
    backend = _LateCtrlC()
    session = ChatSession(backend, out=io.StringIO())
    try:
        out = run_lines(session, ["/stats", "hello"])
    except KeyboardInterrupt:
        pytest.fail("a Ctrl-C during /stats ended the chat")
    assert "(Ctrl-D or /exit quits)" in out and len(backend.sent) == 1


def test_ctrl_c_after_a_quick_reply_still_ends_it(ctrl_c_interrupts):
    # Where Ctrl-C ends the chat (--quick, piped input), it still does after the stream.
    session = ChatSession(_LateCtrlC(), out=io.StringIO(), log=io.StringIO())
    with pytest.raises(KeyboardInterrupt):
        session.reply_once("hello")


@needs_stories
def test_ctrl_c_pressed_twice_in_an_engine_step_stops_the_reply_after_the_step(ctrl_c_interrupts):
    # The second press raised KeyboardInterrupt inside engine.step(): the engine's state was left half
    # updated, and the chat could spin for good draining the aborted request.
    from minillm.chat import ChatSettings, EngineChatBackend
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=str(STORIES), device="cpu", max_model_len=128), log=lambda msg: None)
    step, steps = engine.step, []

    def pressed_during_step():
        if len(steps) == 3:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        steps.append("started")
        outputs = step()
        steps[-1] = "done"
        return outputs

    engine.step = pressed_during_step
    settings = ChatSettings(temperature=0.0, max_tokens=40)
    session = ChatSession(EngineChatBackend(engine, name="stories"), settings, out=io.StringIO())
    try:
        out = run_lines(session, ["Once upon a time", "Lily"])
    except KeyboardInterrupt:
        pytest.fail("the second Ctrl-C raised out of the chat")
    finally:
        engine.shutdown()
    assert "started" not in steps, "a step was cut short"
    assert " [interrupted]" in out and "[max_tokens 40 reached" in out
    assert [t["content"] for t in session.conversation.turns][::2] == ["Once upon a time", "Lily"]
    assert not engine.has_unfinished_requests()


# ---- a server that fails ------------------------------------------------------------------------------------

def chat_over(url: str, model: str, lines: list[str]) -> tuple[str, ChatSession]:
    """A scripted chat with MODEL of the server at URL; what it printed, and the session."""
    from minillm.chat_client import HttpChatBackend
    session = ChatSession(HttpChatBackend(url, model=model), out=io.StringIO())
    return run_lines(session, lines), session


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error")]


@pytest.mark.parametrize("model, said", [
    ("traceback", "error: server answered 500: Traceback (most recent call last): File \"app.py\", line 3, "
                  "in handler KeyError: 'choices'"),
    ("proxy", "error: server answered 502: Bad Gateway"),
    ("multiline", "error: server answered 400: bad request: messages.0: field required"),
    ("event", "error: server error: engine failed: out of blocks"),
])
def test_a_servers_error_is_one_line(url, model, said):
    # A traceback sent as the body took four lines of the chat, and a proxy's page was shown as HTML.
    out, session = chat_over(url, model, ["hello"])
    assert said in out.splitlines() and len(error_lines(out)) == 1, out
    assert "<html>" not in out and session.conversation.turns == []


def test_a_stream_cut_inside_an_event_says_it_ended_early(url):
    # The half event at the cut was parsed, and the chat blamed the server for sending no JSON.
    out, session = chat_over(url, "cut", ["hello"])
    assert "Once upon a time\nerror: the stream from" in out
    assert error_lines(out)[0].endswith("ended before the reply finished (no data: [DONE])")
    assert "not JSON" not in out and session.conversation.turns == []
