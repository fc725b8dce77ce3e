"""The command line abused: serve's --api-server-count with --engine-core thread, chat commands given
words they do not take, a finish_reason that is no string from a server, a stop string of the
replacement character, model paths that are symbolic links to nothing, safetensors headers and
weight files that are not what the safetensors library writes, /set values, and chat --url against
servers whose answers never end or hold JSON past Python's parser."""
from __future__ import annotations

import io
import json
import os
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_abuse28_cli import started  # noqa: F401 - serve's run_server stubbed, as a fixture
from test_abuse28_tui import OK_CHUNK, chat_over, odd_server  # noqa: F401 - a server that answers oddly
from test_chat import run_scripted
from test_cli import STORIES, needs_stories, run_main

from minillm import LLM, SamplingParams
from minillm.chat import ChatSession
from minillm.chat_client import HttpChatBackend
from minillm.loader import checkpoint_tensors
from minillm.model_store import resolve_model_path


def one_line(err: str) -> str:
    """The single line a failed command printed (asserting there is one, and no traceback)."""
    assert "Traceback" not in err, err
    [line] = err.strip().splitlines()
    return line


# ---- serve: options that cannot be combined -----------------------------------------------------------

@needs_stories
@pytest.mark.parametrize("flags, other", [(("--engine-core", "thread"), "--engine-core"), (("--monitor",), "--monitor")])
def test_several_api_servers_with_an_option_of_one_server_is_a_usage_error_naming_both(capsys, started, flags,  # noqa: F811
                                                                                       other):
    # They exited 1 ("several API servers need the engine core in its own process"; "--monitor draws
    # the dashboard in this terminal, but stdout is not a terminal"), after the model's files were
    # looked up, where vLLM-style conflicts are usage errors naming both flags.
    status, out, err = run_main(capsys, "serve", str(STORIES), "--device", "cpu", "--port", "0",
                                "--api-server-count", "2", *flags)
    assert (status, out, started) == (2, "", {})
    line = one_line(err)
    assert "--api-server-count 2 and " + other in line and "cannot be combined" in line, line


@needs_stories
def test_one_api_server_with_the_engine_core_in_a_thread_still_starts(capsys, started):  # noqa: F811
    status, _, err = run_main(capsys, "serve", str(STORIES), "--device", "cpu", "--port", "0",
                              "--api-server-count", "1", "--engine-core", "thread")
    assert status == 0, err
    assert started["options"].engine_core == "thread"


# ---- chat: commands that take no words -------------------------------------------------------------------

class _EchoBackend:
    """Replies "fine." to every message."""
    name, has_chat_template, last_stats = "echo", True, None

    def stream_reply(self, conversation, settings, should_stop):
        yield "fine."


@pytest.mark.parametrize("command", ["/reset now", "/exit now", "/quit please", "/help me", "/stats all"])
def test_a_command_given_words_it_does_not_take_says_so_and_does_nothing(command):
    out = io.StringIO()
    history = run_scripted(ChatSession(_EchoBackend(), out=out), ["hello", command, "again"])
    name, extra = command.split()
    text = out.getvalue()
    assert f"usage: {name} (it takes no arguments, got {extra!r})" in text, text
    # Nothing was done: the conversation was not cleared, the chat did not end.
    assert history[-1] == ["hello", "fine.", "again", "fine."], history
    assert "(conversation cleared)" not in text and "commands:" not in text


def test_commands_without_words_still_act():
    out = io.StringIO()
    history = run_scripted(ChatSession(_EchoBackend(), out=out), ["hello", "/reset  ", "again", "/exit", "never"])
    assert "(conversation cleared)" in out.getvalue()
    assert history == [["hello", "fine."], ["again", "fine."]]


# ---- chat --url: a finish_reason that is no string ---------------------------------------------------------

@pytest.mark.parametrize("reason", [5, {"a": 1}, ["length"], True])
def test_a_finish_reason_that_is_no_string_is_one_error_line(odd_server, reason):  # noqa: F811
    url, server = odd_server
    server.events = [OK_CHUNK, json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]})]
    out = chat_over(url, ["hello", "/stats"], status=1)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "finish_reason is not a string" in errors[0], out
    assert f"finish reason {reason}" not in out, out


def test_a_string_finish_reason_is_shown(odd_server):  # noqa: F811
    url, server = odd_server
    server.events = [OK_CHUNK, json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})]
    out = chat_over(url, ["hello", "/stats"], status=0)
    assert "finish reason length" in out, out


# ---- the URL helpers have one home ---------------------------------------------------------------------

def test_chat_and_the_monitor_take_the_url_helpers_from_minillm_urls():
    import minillm.chat_client as chat_client
    import minillm.tui.client as tui_client
    from minillm import urls
    assert chat_client.shown_url is urls.shown_url is tui_client.shown_url
    assert chat_client.check_credentials is urls.check_credentials is tui_client.check_credentials
    assert urls.shown_url("http://u:pw@h:1") == "http://u:***@h:1"
    with pytest.raises(ValueError, match="not both"):
        urls.check_credentials("http://u:pw@h:1", "key")


# ---- a stop string of the replacement character ----------------------------------------------------------

@pytest.mark.parametrize("stop", ["\ufffd", ["ok", "a\ufffdb"]])
def test_a_stop_string_with_the_replacement_character_is_a_value_error_naming_stop(stop):
    # It matched only where the decoder had given up on a run of bytes (7 tokens of them), never
    # where a reply ended within them, whose text then held the "stop string" with finish "length".
    with pytest.raises(ValueError, match=r"^stop .*U\+FFFD"):
        SamplingParams(stop=stop)


@needs_stories
def test_generate_refuses_a_replacement_character_stop_naming_the_flag(capsys):
    status, out, err = run_main(capsys, "generate", str(STORIES), "--device", "cpu", "-p", "Tom",
                                "--stop", "\ufffd")
    assert (status, out) == (2, "")
    assert "Invalid value for '--stop'" in err and "U+FFFD" in err and "Traceback" not in err, err


@needs_stories
def test_bytes_that_are_no_text_still_read_as_replacement_characters(stories_path):
    with LLM(str(stories_path), device="cpu", max_model_len=64) as llm:
        [out] = llm.generate(["Tom"], SamplingParams(max_tokens=3, temperature=0, allowed_token_ids=[258]))
    assert out.outputs[0].text == "\ufffd" * 3      # byte 0xFF, three times


# ---- model paths that are links to nothing ------------------------------------------------------------

def test_a_link_to_nothing_is_named_as_a_local_path_never_asked_of_the_hub(tmp_path, monkeypatch, capsys):
    # A dangling link, or a loop of links, named by a bare name was taken for a hub id and fetched
    # ("as a Hugging Face repo id it could not be fetched": a network call for a file here).
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("minillm.model_store.download_model", lambda *a, **k: pytest.fail("asked the hub"))
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop1").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop1")
    with pytest.raises(FileNotFoundError, match=r"^no such directory: gone: it is a symbolic link to .*nowhere, which "
                                                r"does not exist$"):
        resolve_model_path("gone")
    with pytest.raises(FileNotFoundError, match=r"^no such directory: loop1: it is a symbolic link in a loop of links"):
        resolve_model_path("loop1")
    status, out, err = run_main(capsys, "generate", "gone", "-p", "hi", "--device", "cpu")
    assert (status, out) == (1, "") and "it is a symbolic link to" in one_line(err)


def test_a_config_json_that_links_to_nothing_says_so(stories_path, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for f in stories_path.iterdir():
        if f.name != "config.json":
            (model / f.name).symlink_to(f)
    (model / "config.json").symlink_to(tmp_path / "config-gone.json")
    with pytest.raises(ValueError, match=r"has no config.json \(it is a symbolic link to .*config-gone.json, which "
                                         r"does not exist\)"):
        resolve_model_path(str(model))


# ---- safetensors headers and weight files ----------------------------------------------------------

def model_with_header(stories_path: Path, out: Path, change) -> Path:
    """A copy of stories260K (links to its files) whose model.safetensors header is changed by change(header)."""
    out.mkdir()
    for f in stories_path.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).symlink_to(f)
    data = (stories_path / "model.safetensors").read_bytes()
    [size] = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    change(header)
    raw = json.dumps(header).encode()
    (out / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + size:])
    return out


EMBED = "model.embed_tokens.weight"


@pytest.mark.parametrize("change", [
    lambda h: h[EMBED].update(shape=[512.0, 64]),          # TypeError from numpy's reshape, a traceback
    lambda h: h[EMBED].update(dtype=["F32"]),               # TypeError: unhashable type: 'list'
    lambda h: h[EMBED].update(data_offsets=[0.5, 131072]),  # read as 0
    lambda h: h[EMBED].update(data_offsets=[True, 131072]),
    lambda h: h[EMBED].update(shape="ab"),
    lambda h: h[EMBED].update(shape=[-512, -64]),
    lambda h: h.update({EMBED: [1, 2]}),
], ids=["float-shape", "list-dtype", "float-offset", "bool-offset", "string-shape", "negative-shape", "list-entry"])
def test_a_header_entry_of_the_wrong_types_is_a_value_error_naming_file_and_tensor(stories_path, tmp_path, change):
    path = model_with_header(stories_path, tmp_path / "m", change)
    with pytest.raises(ValueError, match=r"model.safetensors is not a safetensors file \(its header has no dtype, "
                                         r"shape and data_offsets for 'model.embed_tokens.weight'\)"):
        checkpoint_tensors(path)


def test_tensors_whose_bytes_overlap_are_refused_as_the_safetensors_library_refuses_them(stories_path, tmp_path, capsys):
    # The norm's offsets pointed into the embedding's bytes: the model loaded and wrote "hi\ufffdomld".
    path = model_with_header(stories_path, tmp_path / "m", lambda h: h["model.norm.weight"].update(data_offsets=[0, 256]))
    with pytest.raises(ValueError, match="is not a safetensors file .*data_offsets overlap another tensor"):
        checkpoint_tensors(path)
    status, out, err = run_main(capsys, "generate", str(path), "-p", "hi", "--device", "cpu", "--max-tokens", "3")
    assert (status, out) == (1, "") and "overlap another tensor" in one_line(err)


def test_a_gap_between_tensors_is_refused(stories_path, tmp_path):
    def gap(header):
        for name, info in header.items():
            if name != "__metadata__" and info["data_offsets"][0] > 0:
                info["data_offsets"] = [info["data_offsets"][0] + 4, info["data_offsets"][1] + 4]
                return
    with pytest.raises(ValueError, match="data_offsets leave a gap before it"):
        checkpoint_tensors(model_with_header(stories_path, tmp_path / "m", gap))


def test_a_weights_file_that_is_a_directory_or_a_link_to_nothing_is_named(stories_path, tmp_path):
    # "[Errno 21] Is a directory" / "[Errno 2] No such file or directory", no more (a hub cache
    # whose blob was never fetched leaves such a link).
    for name, make in (("folder", os.mkdir), ("link", lambda p: os.symlink("../../blobs/abc", p))):
        path = tmp_path / name
        path.mkdir()
        for f in stories_path.iterdir():
            if f.name != "model.safetensors":
                (path / f.name).symlink_to(f)
        make(path / "model.safetensors")
        why = "is a directory, not safetensors weights" if name == "folder" else \
            "cannot be read: it is a symbolic link to ../../blobs/abc, which does not exist"
        with pytest.raises(ValueError, match=f"model.safetensors {why}"):
            checkpoint_tensors(path)


def test_the_stories_header_still_reads(stories_path):
    tensors = checkpoint_tensors(stories_path)
    assert tensors[EMBED].shape == (512, 64) and tensors[EMBED].end - tensors[EMBED].start == 512 * 64 * 4


# ---- chat: /set values read as SamplingParams reads them -----------------------------------------------

def test_set_seed_minus_one_is_no_seed_and_minus_zero_is_zero():
    # "/set seed -1" showed seed=-1, which SamplingParams reads as no seed; "-0" showed -0.0.
    out = io.StringIO()
    run_scripted(ChatSession(_EchoBackend(), out=out), ["/set seed 5", "/set seed -1", "/set temperature -0", "/set"])
    text = out.getvalue()
    assert "(seed = None)" in text and "(temperature = 0.0)" in text, text
    assert "temperature=0.0 top_p=0.9 top_k=-1 max_tokens=256 seed=None" in text, text


# ---- chat --url: answers without end, JSON past the parser -----------------------------------------------

class _EndlessChatServer(BaseHTTPRequestHandler):
    """server.mode: "models" (a /v1/models without end), "error" (a 500 whose body never ends),
    "line" (a stream whose second line never ends); the other answers are a model list and OK_CHUNK.
    "Without end": 64 MiB, or until the client goes away (a client that reads all fails its test
    rather than hangs it)."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.server.mode == "models":
            return self._endless(200, "application/json", b'{"data": [{"id": "odd"}], "pad": "')
        body = json.dumps({"data": [{"id": "odd", "max_model_len": 512}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.server.mode == "error":
            return self._endless(500, "text/plain", b"")
        self._endless(200, "text/event-stream", f"data: {OK_CHUNK}\n\ndata: ".encode())

    def _endless(self, status: int, content_type: str, head: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = b"x" * 4096
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(head + chunk), head + chunk))
            for _ in range(64 * 1024 * 1024 // len(chunk)):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass


@pytest.fixture
def endless_chat_server(monkeypatch):
    monkeypatch.setattr("minillm.chat_client.MAX_LINE_CHARS", 64 * 1024, raising=False)
    monkeypatch.setattr("minillm.chat_client.MAX_BODY_BYTES", 64 * 1024, raising=False)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EndlessChatServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("mode, named", [
    ("line", "error: the server sent a line over 65536 characters in its stream: is this a minillm server?"),
    ("error", "error: server answered 500: Internal Server Error"),
])
def test_chat_over_a_server_whose_answer_never_ends_is_one_error_line(endless_chat_server, mode, named):
    # Each was read whole (iter_lines, response.read()): the chat's memory grew without end, no error came.
    url, server = endless_chat_server
    server.mode = mode
    out = chat_over(url, ["hello"], status=1)
    assert named in out, out


def test_a_model_list_without_end_is_named_at_start(endless_chat_server):
    url, server = endless_chat_server
    server.mode = "models"
    with pytest.raises(RuntimeError, match="did not answer with a model list"):
        HttpChatBackend(url)


@pytest.mark.parametrize("event, named", [
    ("[" * 100_000 + "]" * 100_000, "a stream event of JSON nested too deeply to read"),
    ("1" * 5000, "a stream event of JSON with an integer too long to read"),
], ids=["nested", "integer"])
def test_a_stream_event_past_the_json_parser_is_named(odd_server, event, named):  # noqa: F811
    # "error: maximum recursion depth exceeded while decoding a JSON array from a unicode string",
    # "error: Exceeds the limit (4300 digits) for integer string conversion: ... use sys.set_int_max_str_digits()".
    url, server = odd_server
    server.events = [OK_CHUNK, event]
    out = chat_over(url, ["hello"], status=1)
    assert f"error: the server sent {named}" in out, out


def test_an_error_body_past_the_json_parser_is_the_servers_status(odd_server):  # noqa: F811
    url, server = odd_server
    server.failure = (500, b'{"error": {"message": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}")
    out = chat_over(url, ["hello"], status=1)
    [line] = [line for line in out.splitlines() if line.startswith("error:")]
    assert line.startswith("error: server answered 500: {") and len(line) < 1100 and "recursion" not in line, line


@pytest.mark.parametrize("suffix", ["/v1/chat/completions", "/v1/completions/", "/v1/models"])
def test_chat_given_an_endpoints_url_talks_to_its_server(odd_server, suffix):  # noqa: F811
    # The endpoint's URL, as a curl line has it, was taken for the server's root: GET
    # .../v1/chat/completions/v1/models, a 404 from a server that was there.
    url, _ = odd_server
    backend = HttpChatBackend(url + suffix)
    assert backend.base_url == url and backend.model == "odd"
