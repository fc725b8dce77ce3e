"""`minillm chat` on the real engine: a pseudo-terminal session, and prompt ids against transformers."""
from __future__ import annotations

import io
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STORIES = Path(os.environ.get("MINILLM_TEST_MODEL", REPO.parent / "shared" / "models" / "stories260K"))
needs_stories = pytest.mark.skipif(not (STORIES / "config.json").is_file(),
                                   reason=f"stories260K not found at {STORIES}; set MINILLM_TEST_MODEL")

PROMPT = ">>> "
# A Llama-2-like template: BOS per user turn, a <<SYS>> block folded into the first user turn.
TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if loop.index0 == 0 and system %}"
    "{% set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content | trim + ' [/INST]' }}"
    "{% else %}{{ ' ' + content | trim + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ ' ' }}{% endif %}"
)


def hf_chat_ids(model_dir: Path, messages: list[dict]) -> list[int]:
    """transformers' own rendering + tokenization of the conversation."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def short_context_engine():
    """stories260K on the CPU with a 64-token context, which a conversation outgrows in a few turns."""
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=str(STORIES), device="cpu", max_model_len=64), log=lambda msg: None)
    yield engine
    engine.shutdown()


@pytest.fixture
def templated_model(tmp_path: Path) -> Path:
    """stories260K with a chat template added to its tokenizer_config.json."""
    model_dir = tmp_path / "stories-chat"
    model_dir.mkdir()
    for f in STORIES.iterdir():
        shutil.copy(f, model_dir / f.name)
        (model_dir / f.name).chmod(0o644)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATE
    config_path.write_text(json.dumps(config))
    return model_dir


# ---------------------------------------------------------------------------------------------
# Prompt building against transformers
# ---------------------------------------------------------------------------------------------

@needs_stories
def test_three_turn_conversation_ids_match_transformers(templated_model: Path):
    from minillm.chat import ChatSession, Conversation, EngineChatBackend, conversation_prompt_ids
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine
    from minillm.tokenizer import Tokenizer

    fixed = Conversation(system="You tell short stories.", turns=[
        {"role": "user", "content": "Tell me about Lily."},
        {"role": "assistant", "content": "Lily was a girl who loved to play."},
        {"role": "user", "content": "What did she play with?"},
        {"role": "assistant", "content": "She played with a red ball."},
        {"role": "user", "content": "And then?"},
    ])
    tok = Tokenizer.from_pretrained(templated_model)
    assert conversation_prompt_ids(tok, fixed) == hf_chat_ids(templated_model, fixed.messages())

    # The same through the real loop: the replies are the model's, the prompt ids what chat sent.
    engine = LLMEngine(EngineConfig(model=str(templated_model), device="cpu"))
    backend = EngineChatBackend(engine, name="stories-chat")
    lines = iter(["/system You tell short stories.", "/set max_tokens 6", "/set seed 1",
                  "Tell me about Lily.", "What did she play with?", "And then?"])

    def read_line(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    session = ChatSession(backend, out=out)
    assert session.run(read_line) == 0
    assert "no chat template" not in out.getvalue()
    messages = session.conversation.messages()
    assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * 3
    assert backend.last_prompt_ids == hf_chat_ids(templated_model, messages[:-1])
    assert backend.last_stats.output_tokens <= 6


# ---------------------------------------------------------------------------------------------
# The terminal session
# ---------------------------------------------------------------------------------------------

# Linux syscalls that wait for terminal input: read(2) on fd 0, or a select/poll (readline's wait).
_WAIT_SYSCALLS = {"x86_64": {"read": "0", "waits": {"7", "23", "270", "271"}},
                  "aarch64": {"read": "63", "waits": {"72", "73"}}}.get(platform.machine())


def wait_until_reading_input(child, timeout: float = 120.0) -> None:
    """Wait until the chat is blocked reading the terminal.

    A key sent earlier would race with it: a SIGINT that lands between the prompt being printed
    and the wait for input is only noticed once more input comes, and a Ctrl-D typed before the
    line editor switches the terminal over is read as a plain character.
    """
    syscall_file, stat_file = Path(f"/proc/{child.pid}/syscall"), Path(f"/proc/{child.pid}/stat")
    if _WAIT_SYSCALLS is None or not syscall_file.exists():
        return   # no way to look: the keys are sent as they are
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            call = syscall_file.read_text().split()
            state = stat_file.read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            call, state = [], ""
        if state == "S" and call and (call[0] in _WAIT_SYSCALLS["waits"]
                                      or (call[0] == _WAIT_SYSCALLS["read"] and int(call[1], 16) == 0)):
            return
        time.sleep(0.005)   # polling the process's state, not waiting for time to pass
    pytest.fail(f"minillm chat did not wait for input within {timeout} s")


def spawn_chat(*args: str):
    pexpect = pytest.importorskip("pexpect")
    env = {**os.environ, "TERM": "dumb", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    # Started with SIGINT ignored, as a background job of a script would be: Ctrl-C must still work.
    child = pexpect.spawn(sys.executable, ["-m", "minillm.cli", "chat", str(STORIES), "--device", "cpu", *args],
                          cwd=str(REPO), env=env, encoding="utf-8", codec_errors="replace", timeout=120,
                          dimensions=(50, 400),
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    child.expect_exact("/help lists commands")
    child.expect_exact(PROMPT)
    return child


def ask(child, text: str) -> str:
    """Send one line and return everything printed before the next prompt."""
    child.sendline(text)
    child.expect_exact(text)        # the terminal's echo of the input
    child.expect_exact(PROMPT)
    return child.before.replace("\r\n", "\n").strip("\n")


def stream_chunks(child, text: str) -> list[str]:
    """Send a line and collect the reply in the chunks the terminal delivered it in."""
    child.sendline(text)
    child.expect_exact(text)
    # What expect() read past the echo is already in pexpect's buffer, not on the terminal.
    chunks, seen = [child.buffer], child.buffer
    child.buffer = ""
    while not seen.rstrip().endswith(PROMPT.strip()):
        chunk = child.read_nonblocking(size=4096, timeout=120)
        chunks.append(chunk)
        seen += chunk
    return chunks


def stats_field(stats: str, pattern: str) -> str:
    match = re.search(pattern, stats)
    assert match, f"{pattern!r} not in {stats!r}"
    return match.group(1)


def greedy_reply(prompt: str, num_tokens: int) -> str:
    """The model's greedy continuation of a first message, decoded as the chat shows it."""
    from minillm import LLM, SamplingParams
    llm = LLM(str(STORIES), device="cpu")
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True))[0].outputs[0].text


@needs_stories
def test_chat_session_in_a_terminal():
    greedy_40 = greedy_reply("Once upon a time", 40)
    greedy_400 = greedy_reply("Once upon a time", 400)
    child = spawn_chat()
    assert "plain text" in child.before and "--chat-template" in child.before

    # Greedy: the reply is the golden continuation, arrives in pieces, and says max_tokens cut it.
    assert ask(child, "/set temperature 0") == "(temperature = 0.0)"
    ask(child, "/set max_tokens 40")
    chunks = stream_chunks(child, "Once upon a time")
    reply = "".join(chunks).replace("\r\n", "\n").rsplit(PROMPT.strip(), 1)[0].strip()
    assert reply == greedy_40.strip() + " [max_tokens 40 reached: /set max_tokens N for longer replies]"
    assert len([c for c in chunks if c.strip()]) >= 2
    stats = ask(child, "/stats")
    assert stats_field(stats, r"last reply \(engine\): (\d+) tokens") == "40"
    assert stats_field(stats, r"prompt: (\d+) tokens") == "5"
    assert "tok/s" in stats and "time to first token" in stats and "KV cache:" in stats

    # History is kept: the second prompt holds the first exchange; /reset drops it.
    ask(child, "/set temperature 1.0")
    ask(child, "/set seed 1234")
    ask(child, "/set max_tokens 20")
    ask(child, "Lily went to the park")
    assert int(stats_field(ask(child, "/stats"), r"prompt: (\d+) tokens")) > 5 + 40
    assert ask(child, "/reset") == "(conversation cleared)"
    first = ask(child, "Once upon a time")
    assert stats_field(ask(child, "/stats"), r"prompt: (\d+) tokens") == "5"
    ask(child, "/reset")
    assert ask(child, "Once upon a time") == first          # same seed, same history: same reply
    ask(child, "/reset")
    ask(child, "/set seed 99")
    assert ask(child, "Once upon a time") != first

    # Ctrl-C as soon as a long reply starts: it stops with no ^C inside its words; the engine stays usable.
    ask(child, "/reset")
    ask(child, "/set temperature 0")
    ask(child, "/set max_tokens 400")
    child.sendline("Once upon a time")
    child.expect_exact("Once upon a time\r\n")
    child.expect(r"\w")
    shown = child.before + child.after
    child.sendintr()
    child.expect_exact(" [interrupted]")
    shown = (shown + child.before).replace("\r\n", "\n")
    assert shown.strip() and greedy_400.startswith(shown), shown    # exactly the reply so far, nothing else
    child.expect_exact(PROMPT)
    stats = ask(child, "/stats")
    assert stats_field(stats, r"finish reason (\w+)") == "abort"
    assert int(stats_field(stats, r"last reply \(engine\): (\d+) tokens")) < 400
    ask(child, "/set max_tokens 12")
    ask(child, "/reset")
    assert ask(child, "Once upon a time").endswith("[max_tokens 12 reached: /set max_tokens N for longer replies]")
    assert stats_field(ask(child, "/stats"), r"finish reason (\w+)") == "length"

    # Ctrl-C at the prompt does what /help says: it clears the line, and on an empty one says how to quit.
    help_text = ask(child, "/help")
    assert "at the prompt it clears the line (Ctrl-D or /exit quits)" in help_text
    wait_until_reading_input(child)
    child.sendintr()
    child.expect_exact("(Ctrl-D or /exit quits)")
    child.expect_exact(PROMPT)
    child.send("/stats")                                # typed, not sent
    child.expect_exact("/stats")
    wait_until_reading_input(child)
    child.sendintr()
    child.expect_exact(PROMPT)
    assert "(" not in child.before                      # no hint, and /stats did not run
    assert ask(child, "/set") .startswith("temperature=0.0")

    # Ctrl-D at the prompt quits with status 0.
    wait_until_reading_input(child)
    child.sendeof()
    child.expect(pytest.importorskip("pexpect").EOF)
    child.close()
    assert child.exitstatus == 0


@needs_stories
def test_keys_typed_while_a_reply_streams_are_kept():
    pexpect = pytest.importorskip("pexpect")
    greedy_150 = greedy_reply("Once upon a time", 150)
    child = spawn_chat("--temperature", "0", "--max-tokens", "150")

    # A full line and the start of another, typed during the reply: neither echoes into it.
    child.sendline("Once upon a time")
    child.expect_exact("Once upon a time\r\n")
    child.expect(r"\w")
    shown = child.before + child.after
    child.send("/set max_tokens 7\r/sta")
    child.expect_exact(" [max_tokens 150 reached")
    assert (shown + child.before).replace("\r\n", "\n") == greedy_150
    child.expect_exact(PROMPT + "/set max_tokens 7")    # the typed line runs next, as if typed now
    child.expect_exact("(max_tokens = 7)")
    child.expect_exact(PROMPT)
    child.expect_exact("/sta")                           # the unfinished line is back on the prompt
    child.sendline("ts")
    child.expect_exact("last reply (engine): 150 tokens")
    child.expect_exact(PROMPT)

    # Ctrl-D typed while a reply streams: the reply ends, then the chat does, with status 0.
    ask(child, "/reset")
    ask(child, "/set max_tokens 150")
    child.sendline("Once upon a time")
    child.expect_exact("Once upon a time\r\n")
    child.expect(r"\w")
    child.sendeof()
    child.expect_exact(" [max_tokens 150 reached")
    child.expect(pexpect.EOF)
    assert PROMPT not in child.before
    child.close()
    assert child.exitstatus == 0


@needs_stories
def test_chat_template_from_a_file_or_a_string(tmp_path, templated_model):
    """`minillm chat --chat-template` gives stories260K (which has none) a template: the prompt
    token ids are then the ones transformers renders with that template."""
    template_file = tmp_path / "llama2.jinja"
    template_file.write_text(TEMPLATE)
    messages = [{"role": "system", "content": "You tell short stories."},
                {"role": "user", "content": "Tell me about Lily."}]
    want = len(hf_chat_ids(templated_model, messages))
    script = "/system You tell short stories.\n/set max_tokens 3\nTell me about Lily.\n/stats\n"
    for template in (str(template_file), TEMPLATE):
        result = subprocess.run([sys.executable, "-m", "minillm.cli", "chat", str(STORIES), "--device", "cpu",
                                 "--chat-template", template], cwd=REPO, input=script, capture_output=True,
                                text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert result.returncode == 0, result.stderr
        assert "plain text" not in result.stdout
        assert stats_field(result.stdout, r"prompt: (\d+) tokens") == str(want)

    for bad, needle in ((str(tmp_path / "missing.jinja"), "chat template file not found"),
                        ("{% if %}", "does not compile")):
        result = subprocess.run([sys.executable, "-m", "minillm.cli", "chat", str(STORIES), "--device", "cpu",
                                 "--chat-template", bad], cwd=REPO, input="", capture_output=True, text=True,
                                timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert result.returncode == 1 and "Traceback" not in result.stderr
        [line] = result.stderr.strip().splitlines()
        assert needle in line


@needs_stories
def test_a_reply_cut_by_the_context_says_so():
    from minillm.chat import ChatSession, ChatSettings, EngineChatBackend
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(STORIES), device="cpu", max_model_len=32))
    lines = iter(["Once upon a time"])

    def read_line(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    session = ChatSession(EngineChatBackend(engine, "stories"), ChatSettings(temperature=0, max_tokens=200), out=out)
    assert session.run(read_line) == 0
    assert session.backend.last_stats.output_tokens == 32 - 5
    assert "[the 32-token context is full: /reset starts over]" in out.getvalue()


def test_keys_typed_during_a_reply_are_read_as_a_terminal_would():
    from minillm.chat_terminal import TypeAhead
    ahead = TypeAhead()
    ahead.feed("/stats\rhello wrx\x7f\x7fo\x1b[Dld\x1b[A")     # a line, backspaces, arrow keys
    assert ahead.lines == ["/stats"] and ahead.partial == "hello wold" and not ahead.is_eof
    ahead.feed("\x04")                     # Ctrl-D with text on the line does not end input
    assert not ahead.is_eof
    ahead.feed("\x15\x04more")             # Ctrl-U clears it; Ctrl-D on an empty line does; later keys drop
    assert ahead.is_eof and ahead.partial == ""


def test_multiline_input_and_plain_text_rendering():
    from minillm.chat import Conversation, conversation_text, read_message
    lines = iter(['"""first line', "second line", 'third"""', "one \\", "two"])
    read = lambda prompt: next(lines)   # noqa: E731
    assert read_message(read) == "first line\nsecond line\nthird"
    assert read_message(read) == "one \ntwo"
    from minillm.chat import EndOfInputInMessage
    for script, typed in ((['"""first', "second"], "first\nsecond"), (["one \\", "two \\"], "one \ntwo "),
                          (['"""'], "")):
        lines = iter(script)

        def read(prompt):
            try:
                return next(lines)
            except StopIteration:
                raise EOFError from None
        with pytest.raises(EndOfInputInMessage) as ended:
            read_message(read)
        assert ended.value.text == typed
    conv = Conversation(system="Be brief.", turns=[{"role": "user", "content": "Once upon a time"},
                                                    {"role": "assistant", "content": ", there was"},
                                                    {"role": "user", "content": "The end"}])
    assert conversation_text(conv) == "Be brief.\nOnce upon a time, there was\nThe end"


@pytest.fixture
def served_stories(tmp_path):
    """`minillm serve` on stories260K at a local port the kernel picks; stopped after the test."""
    import subprocess
    import httpx
    from test_server_helpers import started_url, stop_server
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "minillm.cli", "serve", str(STORIES), "--device", "cpu",
                                   "--host", "127.0.0.1", "--port", "0"],
                                  cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = started_url(server, log, timeout=60)
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 200, log.read_text()
        yield url
    finally:
        stop_server(server, timeout=10)


@needs_stories
def test_chat_over_http_streams_from_a_running_server(served_stories):
    from minillm.chat import ChatSession
    from minillm.chat_client import HttpChatBackend
    from minillm.tokenizer import Tokenizer

    reference = json.loads((STORIES / "reference.json").read_text())
    greedy_24 = Tokenizer.from_pretrained(STORIES).decode(reference["greedy_from_bos_200_ids"][5:5 + 24])
    backend = HttpChatBackend(served_stories)
    lines = iter(["/set temperature 0", "/set max_tokens 24", "Once upon a time", "/stats"])

    def read_line(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    assert ChatSession(backend, out=out).run(read_line) == 0
    text = out.getvalue()
    assert "plain text continuation" in text          # stories260K has no chat template
    assert greedy_24.strip() in text
    stats = backend.last_stats
    assert stats.source == "client" and stats.output_tokens == 24 and stats.finish_reason == "length"
    assert stats.ttft_s is not None and stats.ttft_s > 0
    assert "measured by the client" in text

    # A model the server does not serve fails at start (as a server that is not there does), naming
    # what it serves; the served name itself is taken.
    served = backend.model
    with pytest.raises(RuntimeError, match=re.escape(f"does not serve 'nope' (it serves: {served})")):
        HttpChatBackend(served_stories, model="nope")
    assert HttpChatBackend(served_stories, model=served).model == served


def run_scripted(session, lines: list[str], status: int = 0) -> list[list[str]]:
    """Run a chat session over these input lines (then end of input), which must end with exit
    status `status` (1: a reply failed); returns the conversation's turn texts after each message sent."""
    pending, history = iter(lines), []
    session_send = session.send

    def read_line(prompt: str) -> str:
        try:
            return next(pending)
        except StopIteration:
            raise EOFError from None

    def send(text):
        session_send(text)
        history.append([t["content"] for t in session.conversation.turns])

    session.send = send
    assert session.run(read_line) == status
    return history


@needs_stories
def test_a_message_too_long_even_alone_leaves_the_history_as_it_was():
    """Dropping old exchanges to fit is tried on a copy: when the new message cannot fit even
    alone, the error leaves the earlier exchanges in the conversation."""
    from minillm.chat import ChatSession, ChatSettings, EngineChatBackend
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(STORIES), device="cpu", max_model_len=64))
    out = io.StringIO()
    session = ChatSession(EngineChatBackend(engine, "stories"), ChatSettings(temperature=0, max_tokens=8), out=out)
    history = run_scripted(session, ["Tom had a red ball.", "a " * 200, "/set max_tokens 50", "He threw it."],
                           status=1)
    text = out.getvalue()
    assert "error: message too long" in text and "dropped" in text.split("error: message too long")[1]
    first_exchange = history[0]
    assert len(first_exchange) == 2 and history[1] == first_exchange      # kept through the error
    # the third message needs room for 50 tokens: the first exchange goes, and says so
    assert history[2][0] == "He threw it." and len(history[2]) == 2


@needs_stories
def test_input_that_ends_inside_a_multiline_message_sends_it_and_says_so():
    from minillm.chat import ChatSession, ChatSettings, EngineChatBackend
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(STORIES), device="cpu", max_model_len=64))
    out = io.StringIO()
    session = ChatSession(EngineChatBackend(engine, "stories"), ChatSettings(temperature=0, max_tokens=4), out=out)
    history = run_scripted(session, ["Tom had a red ball.", '"""Once upon a time', "there was a cat"])
    assert [turns[-2] for turns in history] == ["Tom had a red ball.", "Once upon a time\nthere was a cat"]
    assert "input ended inside a multi-line message: sending what came" in out.getvalue()


def test_bytes_that_are_not_utf8_reach_the_model_as_replacement_characters():
    from minillm.chat import valid_text
    assert valid_text("ab\udcff\udcfe cd") == "ab\ufffd\ufffd cd"     # how stdin hands on bad bytes
    assert valid_text("\u4e2d\udce4\udcb8") == "\u4e2d\ufffd"         # a character cut short
    assert valid_text("\ud83d x") == "? x"                             # a surrogate that is no byte
    assert valid_text("plain \u4e2d\U0001F600") == "plain \u4e2d\U0001F600"


@needs_stories
def test_bad_bytes_and_settings_in_a_terminal_print_no_traceback():
    child = spawn_chat("--temperature", "0", "--max-tokens", "6")
    for line, answer in (("/set top_k 1.5", "error: top_k needs an integer, got '1.5'"),
                         ("/set temperature nan", "error: temperature must be a finite number"),
                         ("/set seed 9223372036854775808", "error: seed must be an integer in [-2**63, 2**63 - 1]"),
                         ("/set max_tokens 0", "error: max_tokens must be an integer >= 1")):
        assert answer in ask(child, line)
    wait_until_reading_input(child)
    os.write(child.child_fd, b"Tom \xff\xfe ball\r")      # bytes a terminal set to Latin-1 would send
    child.expect_exact("Tom")
    child.expect_exact(PROMPT)
    reply = child.before
    assert "Traceback" not in reply and "[max_tokens 6 reached" in reply
    child.sendline("/exit")
    child.expect(pytest.importorskip("pexpect").EOF)
    child.close()
    assert child.exitstatus == 0


@needs_stories
def test_chat_over_http_fits_the_servers_context_as_the_local_chat_does():
    """A server with a short context: the default max_tokens (256) is capped to the rest of the
    context (it was a 400 for every message), old exchanges are dropped to make room, and a
    message too long even alone is an error that leaves the history as it was."""
    from test_server_helpers import CHAT_TEMPLATE, running_server

    from minillm.chat import ChatSession
    from minillm.chat_client import HttpChatBackend
    from minillm.server.app import ServerOptions

    with running_server(STORIES, options=ServerOptions(chat_template=CHAT_TEMPLATE), max_model_len=64) as (url, _):
        backend = HttpChatBackend(url)
        assert backend.context_len == 64
        out = io.StringIO()
        history = run_scripted(ChatSession(backend, out=out), ["/set temperature 0", "Tom had a red ball.", "a " * 100,
                                                               "/set max_tokens 40", "He threw it."], status=1)
    text = out.getvalue()
    too_long, third = history[1], history[2]
    assert "[the 64-token context is full: /reset starts over]" in text
    assert "maximum context length is 64 tokens" in text            # the long message's error
    assert len(history[0]) == 2 and too_long == history[0]          # the first exchange kept through it
    assert "(dropped the 1 oldest exchange(s) to fit the 64-token context)" in text
    assert third[0] == "He threw it." and len(third) == 2


class _FailingBackend:
    """Replies with an error every other message (as a server that went away between them)."""
    name, has_chat_template, last_stats = "failing", True, None

    def __init__(self) -> None:
        self.calls = 0

    def stream_reply(self, conversation, settings, should_stop):
        self.calls += 1
        if self.calls % 2 == 0:
            raise RuntimeError("request to http://127.0.0.1:1 failed: [Errno 111] Connection refused")
        yield "fine."


def test_a_scripted_chat_whose_reply_failed_exits_1_and_one_without_failures_exits_0():
    """Piped input is a script: an error reply makes its exit status 1 (the session goes on)."""
    from minillm.chat import ChatSession

    out = io.StringIO()
    history = run_scripted(ChatSession(_FailingBackend(), out=out), ["one", "two", "three"], status=1)
    assert "error: request to http://127.0.0.1:1 failed" in out.getvalue()
    assert history[-1] == ["one", "fine.", "three", "fine."]        # the failed message is not kept
    run_scripted(ChatSession(_FailingBackend(), out=io.StringIO()), ["one", "/help"], status=0)
