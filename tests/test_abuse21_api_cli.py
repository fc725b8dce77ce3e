"""The offline API and the commands other than serve, with inputs a script brings along: NumPy
numbers where ints and floats go, model directories whose tokenizer files hold fields of the
wrong kind, API keys an HTTP header cannot carry, an empty --url, a template that renders nothing."""
from __future__ import annotations

import asyncio
import http.server
import json
import shutil
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

from minillm import SamplingParams
from test_cli import minillm


@pytest.fixture(scope="module")
def llm(stories_path):
    """One stories260K LLM on the CPU for the module (a small pool: the tests are short)."""
    from minillm import LLM
    with LLM(str(stories_path), device="cpu", max_model_len=128, num_kv_blocks=64) as model:
        yield model


# ---- NumPy numbers ---------------------------------------------------------------------------------

def test_numpy_numbers_in_sampling_params_sample_as_python_numbers(llm):
    # A NumPy seed (np.random.randint's) raised OverflowError from add_request (seed % 2**64 in
    # int64); a float16 temperature warned of an overflow against the float32 bound.
    def texts(**kwargs):
        out = llm.generate(["Once upon"], SamplingParams(max_tokens=6, n=2, **kwargs))[0]
        return [c.text for c in out.outputs]

    for seed in (np.int64(-5), np.uint64(7)):
        assert texts(seed=seed) == texts(seed=int(seed))
    assert SamplingParams(seed=np.int32(-1)).seed is None       # vLLM's -1: no seed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        params = SamplingParams(temperature=np.float16(0.5), top_p=np.float32(0.9), top_k=np.int8(5),
                                max_tokens=np.int64(3), seed=np.int64(1))
    assert type(params.seed) is int and type(params.temperature) is float and type(params.max_tokens) is int
    assert texts(temperature=np.float16(0.5), seed=np.int64(3)) == texts(temperature=0.5, seed=3)


def test_numpy_numbers_in_engine_arguments_are_taken_as_python_numbers(stories_path):
    # LLM(seed=np.int64(3)) loaded the weights and then failed with random.Random's TypeError;
    # tensor_parallel_size=np.int64(1) was refused as "must be an integer >= 1".
    from minillm import LLM
    from minillm.config import EngineConfig
    config = EngineConfig(model=str(stories_path), seed=np.int64(3), tensor_parallel_size=np.int64(1),
                          max_step_ms=np.float32(50.0), gpu_memory_utilization=np.float32(0.5))
    assert (type(config.seed), type(config.tensor_parallel_size), type(config.max_step_ms)) == (int, int, float)
    greedy = SamplingParams(temperature=0, max_tokens=3)
    with LLM(str(stories_path), device="cpu", seed=np.int64(3), max_model_len=128, num_kv_blocks=16) as llm:
        assert llm.generate("Once", greedy)[0].outputs[0].text == " upon a time"



@pytest.mark.parametrize("download_dir", [5, ["models"]])
def test_a_download_dir_that_is_no_path_is_a_value_error_naming_it(download_dir):
    # It was read only to fetch a hub model, and failed there with TypeError "expected str, bytes or
    # os.PathLike object, not int" (for a local model it was taken without a word).
    from minillm.config import EngineConfig
    with pytest.raises(ValueError, match="download_dir must be a directory path"):
        EngineConfig(model="someorg/somemodel", download_dir=download_dir)


# ---- tokenizer files with fields of the wrong kind ---------------------------------------------------

def model_copy(stories_path: Path, tmp_path: Path, name: str, field: str, value) -> Path:
    """A writable copy of stories260K whose NAME (a JSON file) sets FIELD to VALUE."""
    model = tmp_path / "model"
    model.mkdir()
    for f in stories_path.iterdir():
        if f.name != "reference.json":
            shutil.copyfile(f, model / f.name)
    path = model / name
    data = json.loads(path.read_text()) if path.exists() else {}
    data[field] = value
    path.write_text(json.dumps(data))
    return model


BROKEN_TOKENIZER_FIELDS = [
    # A list entry without a template raised KeyError at load, one that is no object TypeError.
    ("tokenizer_config.json", "chat_template", [{"name": "default"}]),
    ("chat_template.json", "chat_template", ["{{ messages }}"]),
    # A string was read character by character: 'a' and 'e' became special tokens that every
    # output's text then lost; a number raised TypeError.
    ("tokenizer_config.json", "additional_special_tokens", "ae"),
    ("special_tokens_map.json", "additional_special_tokens", 3),
    # A float raised TypeError, a string an unnamed ValueError; a negative id was taken.
    ("generation_config.json", "eos_token_id", 2.5),
    ("generation_config.json", "eos_token_id", ["x"]),
    ("generation_config.json", "eos_token_id", -1),
]


@pytest.mark.parametrize("name,field,value", BROKEN_TOKENIZER_FIELDS)
def test_tokenizer_files_with_fields_of_the_wrong_kind_are_value_errors_naming_file_and_field(
        stories_path, tmp_path, name, field, value):
    from minillm.tokenizer import Tokenizer
    model = model_copy(stories_path, tmp_path, name, field, value)
    with pytest.raises(ValueError, match=f"{name} field '{field}' must be"):
        Tokenizer.from_pretrained(model)


def test_a_broken_tokenizer_file_is_one_line_in_the_cli(stories_path, tmp_path):
    model = model_copy(stories_path, tmp_path, "tokenizer_config.json", "chat_template", [{"name": "default"}])
    result = minillm("generate", str(model), "--device", "cpu", "-p", "Once", "--max-tokens", "2")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("minillm: error: ") and "tokenizer_config.json field 'chat_template' must be" in line


def test_well_formed_tokenizer_fields_still_load(stories_path, tmp_path):
    from minillm.tokenizer import Tokenizer
    model = model_copy(stories_path, tmp_path, "tokenizer_config.json", "chat_template",
                       [{"name": "default", "template": "{{ messages[0].content }}"}])
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_pretrained(model)
    assert tok.eos_token_ids == [2, 0] and tok.render_chat([{"role": "user", "content": "hi"}], None) == "hi"


# ---- API keys of the clients: chat --url, monitor, bench serving ------------------------------------

KEY = "clé"          # the server takes its --api-key as UTF-8, as curl sends it


@pytest.fixture
def keyed_server():
    """A stand-in for a server keyed KEY: 200 to a request that carries it (a model list for GET),
    401 to any other; its URL and the Authorization headers it was sent, as bytes."""
    seen: list[bytes] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            auth = next((v for k, v in self.headers.raw_items() if k.lower() == "authorization"), "")
            seen.append(auth.encode("latin-1"))     # http.server reads header bytes as latin-1
            ok = seen[-1] == b"Bearer " + KEY.encode()
            body = json.dumps({"data": [{"id": "m", "max_model_len": 64}]}).encode() if ok else b"{}"
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(body) if self.command == "GET" else 0))
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(body)

        do_GET = do_POST = answer

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


def test_clients_send_a_key_past_ascii_as_utf8(keyed_server):
    # httpx encodes a str header as ASCII: chat --url, the monitor and bench serving failed with
    # "'ascii' codec can't encode character" (naming no option) for a key the server takes.
    from minillm.benchmarks import serving
    from minillm.chat_client import HttpChatBackend
    from minillm.tui.client import LiveSource
    url, seen = keyed_server
    assert HttpChatBackend(url, api_key=KEY).model == "m"

    async def monitor_and_bench():
        async with LiveSource(url, KEY)._client() as client:
            monitor = (await client.get(f"{url}/v1/stats")).status_code
        bench = await serving.send_request(f"{url}/v1/completions", {}, serving.authorization_headers(KEY), 10)
        return monitor, bench.error
    assert asyncio.run(monitor_and_bench()) == (200, "no tokens streamed")       # 200s with no tokens
    assert set(seen) == {b"Bearer " + KEY.encode()}


@pytest.mark.parametrize("key,why", [("a\nb", "holds a control character ('\\n')"),
                                     ("key ", "starts or ends with a space")])
def test_a_key_no_header_can_carry_is_one_line_naming_api_key_before_connecting(keyed_server, key, why):
    # A line break or a trailing space failed as "cannot reach a minillm server at URL: Illegal
    # header value b'Bearer ...'" (bench serving: "no server answers"), the monitor retried forever.
    url, seen = keyed_server
    for args in (["chat", "--url", url], ["monitor", url]):       # a usage error naming the flag
        result = minillm(*args, "--api-key", key, stdin="")
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        [line] = result.stderr.strip().splitlines()
        assert f"Invalid value for '--api-key': {why}" in line and "reach" not in line, line
    result = minillm("bench", "serving", "--base-url", url, "--api-key", key, stdin="")
    assert result.returncode in (1, 2) and "Traceback" not in result.stderr, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert f"--api-key {why}" in line and "reach" not in line, line
    assert seen == []


def test_an_empty_chat_url_is_named_not_read_as_no_url(tmp_path):
    # --url "" (an unset variable in `--url "$SERVER"`) loaded a model instead: the default one,
    # fetched from the hub, or MODEL, which with --url is the served model's name.
    result = minillm("chat", "--url", "", "--download-dir", str(tmp_path), stdin="")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line == ("minillm chat: error: Invalid value for '--url': not a server URL: '' (give http://host:port) "
                    "(try 'minillm chat --help')")


# ---- LLM.chat ------------------------------------------------------------------------------------------

def test_llm_chat_with_a_template_that_renders_nothing_names_the_template(llm):
    # The engine's error came back: "prompt must be a non-empty string or a non-empty list of token
    # ids", naming a prompt the caller never gave (the server and the chat command name the template).
    hello = [{"role": "user", "content": "hi"}]
    quiet = "{% if messages[0].content == 'hush' %}{% else %}{{ messages[0].content }}{% endif %}"
    with pytest.raises(ValueError, match=r"^messages: the chat template rendered an empty prompt$"):
        llm.chat([{"role": "user", "content": "hush"}], chat_template=quiet)
    with pytest.raises(ValueError, match=r"rendered an empty prompt \(conversation 1\)"):
        llm.chat([hello, [{"role": "user", "content": "hush"}]], chat_template=quiet)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.chat(hello, SamplingParams(max_tokens=2), chat_template=quiet)[0].prompt == "hi"


def test_the_engine_aborts_a_list_of_request_ids_as_vllms_does(llm):
    # vLLM's LLMEngine.abort_request takes a list of ids (V1) or one id or an iterable (V0); a list
    # was ignored without a word, so the requests ran on to their max_tokens.
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for rid in ("x", "y", "z"):
        engine.add_request(rid, "Once upon", params)
    engine.step()
    engine.abort_request(["x", "y"])
    engine.abort_request(("no-such-id", 5))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    assert {rid: c.finish_reason for rid, c in finished.items()} == {"x": "abort", "y": "abort", "z": "length"}
    assert len(finished["x"].token_ids) < 40 and len(finished["z"].token_ids) == 40


# ---- ~user paths ----------------------------------------------------------------------------------------

def test_a_tilde_that_names_no_user_is_read_as_written(stories_path, tmp_path):
    # Path.expanduser raised RuntimeError "Could not determine home directory." for ~nouser: the
    # one line named nothing, and an inline --chat-template that starts with ~ could not be used.
    template = "~{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    result = minillm("chat", str(stories_path), "--device", "cpu", "--max-tokens", "2", "--temperature", "0",
                     "--chat-template", template, stdin="Once\n")
    assert result.returncode == 0 and "error" not in result.stdout + result.stderr, result.stdout + result.stderr
    result = minillm("generate", "~no-such-user-21/model", "-p", "Once", "--device", "cpu",
                     "--download-dir", str(tmp_path))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("minillm: error: no such directory: ~no-such-user-21/model"), line
