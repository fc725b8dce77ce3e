"""minillm run-batch over lines whose text JSON allows but a careless reader or writer breaks: U+2028,
U+2029 and U+0085 inside strings (the output is split at newlines only, as it is written), lone
surrogate escapes in the fields a line's answer repeats, and a body nested deeper than the answer's
own encoder goes."""
from __future__ import annotations

import asyncio
import io
import json

import httpx
import pytest

from minillm import run_batch
from minillm.config import EngineConfig
from minillm.run_batch import BatchFiles, BatchRequest, answer, write_outputs
from minillm.server.app import ServerOptions, create_app

MODEL = "stories"
OPTIONS = ServerOptions(served_model_name=(MODEL,))
SEPARATORS = "\u2028\u2029\x85"     # str.splitlines breaks at each; JSON keeps them as they are in a string


@pytest.fixture(scope="module")
def engine(stories_path):
    from minillm.server.async_engine import start_async_engine
    engine = start_async_engine(EngineConfig(model=str(stories_path), device="cpu", max_model_len=128), "thread")
    yield engine
    engine.shutdown()


def line(custom_id: str, prompt: str, url: str = "/v1/completions", method: str = "POST", *, escaped: bool = False,
         **fields) -> str:
    """One batch line, non-ASCII text written as it is (escaped: as \\u escapes, the one way a file's
    UTF-8 holds a lone surrogate)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, **fields}
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body}, ensure_ascii=escaped)


def records(data: bytes) -> list[dict]:
    """The output file's JSON lines: UTF-8 text split at newlines only, each line ended by one."""
    text = data.decode("utf-8")          # strict: a lone surrogate written as it is fails here
    assert text.endswith("\n")
    return [json.loads(out) for out in text[:-1].split("\n")]


def run(engine, lines: list[str], tmp_path) -> tuple[list[dict], bytes]:
    """(the output's records, its bytes) for the batch LINES."""
    path = tmp_path / "out.jsonl"
    write_outputs(engine, OPTIONS, lines, BatchFiles(str(tmp_path / "in.jsonl"), str(path)))
    data = path.read_bytes()
    return records(data), data


# ---- U+2028 and the other separators of str.splitlines ------------------------------------------------

def test_line_separators_inside_a_prompt_round_trip_through_the_output(engine, tmp_path):
    prompt = f"Once{SEPARATORS[0]}upon{SEPARATORS[1]}a{SEPARATORS[2]}time"
    raw = (line(f"a{SEPARATORS}b", prompt, echo=True) + "\n"
           + line("chat", "", url="/v1/chat/completions", messages=[{"role": "user", "content": prompt}]) + "\n")
    lines = run_batch.input_lines(raw.encode())
    assert len(lines) == 2
    outputs, data = run(engine, lines, tmp_path)
    assert [o["custom_id"] for o in outputs] == [f"a{SEPARATORS}b", "chat"]
    assert outputs[0]["error"] is None and outputs[0]["response"]["body"]["choices"][0]["text"].startswith(prompt)
    assert outputs[1]["response"]["status_code"] == 400       # no chat template: an error line, still one line
    # Written as they are, as vLLM's model_dump_json writes them: a reader that splits at str.splitlines
    # breaks the answer into pieces that are not JSON.
    assert SEPARATORS[0].encode() in data and len(data.decode().splitlines()) > len(outputs)


# ---- lone surrogate escapes in the fields an answer repeats ---------------------------------------------

def test_a_lone_surrogate_in_custom_id_url_or_method_is_that_lines_answer_not_the_batchs_end(engine, tmp_path):
    # The answer repeated the text as it was: UTF-8 cannot hold a lone surrogate, the output file's write
    # raised UnicodeEncodeError and the whole batch ended with a traceback.
    lines = [line("a\ud800b", "Once", escaped=True), line("u", "Once", url="/v1/x\udc80", escaped=True),
             line("m", "Once", method="P\ud800", escaped=True), line("ok", "Once")]
    outputs, _ = run(engine, lines, tmp_path)
    assert [o["custom_id"] for o in outputs] == ["a\ud800b", "u", "m", "ok"]    # read back as the line held it
    assert outputs[0]["error"] is None and outputs[0]["response"]["status_code"] == 200
    assert outputs[1]["error"].startswith("URL /v1/x\udc80 was used.")
    assert outputs[2]["error"] == "method P\ud800 is not supported: only POST is"
    assert outputs[3]["error"] is None


def test_a_lone_surrogate_is_written_as_its_escape():
    out = io.StringIO()
    writer = run_batch.OrderedWriter(out, 1)
    writer.add(0, run_batch.batch_output("x\udfff\u2028é", 400, error="bad"))
    text = out.getvalue()
    assert "\\udfff" in text and "\u2028é" in text and text.count("\n") == 1
    assert json.loads(text)["custom_id"] == "x\udfff\u2028é"


# ---- a body nested deeper than the answer's encoder goes ----------------------------------------------

def nested(depth: int) -> list:
    """A list nested DEPTH deep, built without recursion."""
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def test_a_body_too_deep_to_send_is_answered_as_serve_answers_it(engine):
    # A line json.loads took near its depth limit could not be encoded again deeper in the stack: a 500
    # server_error with Python's "maximum recursion depth exceeded" where serve answers a 400.
    body = {"model": MODEL, "prompt": "Once", "logit_bias": nested(100_000)}
    app = create_app(engine, OPTIONS)

    async def both() -> tuple[dict, httpx.Response]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://batch") as client:
                output = await answer(client, BatchRequest(0, "deep", "/v1/completions", body))
                served = await client.post("/v1/completions", content=b'{"logit_bias": ' + b"[" * 100_000,
                                           headers={"content-type": "application/json"})
        return output, served

    output, served = asyncio.run(both())
    assert served.status_code == 400
    assert output["response"]["status_code"] == 400 and output["error"] == served.json()
    assert output["error"]["error"]["message"] == ("malformed JSON in request body: arrays or objects are "
                                                   "nested too deeply")



# ---- an output path that names no file ----------------------------------------------------------------

@pytest.mark.parametrize("output", ["", "missing/", "out.jsonl/", "."], ids=["empty", "missing-dir", "slash", "dot"])
def test_an_output_path_that_names_no_file_is_a_usage_error_before_the_model_loads(capsys, monkeypatch, tmp_path,
                                                                                  stories_path, output):
    # "" and "missing/" passed the check (the folder above the working directory exists): the model loaded and
    # the batch ended with "--output-file : No such file or directory".
    from test_cli import run_main
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text(line("a", "Once") + "\n", encoding="utf-8")
    monkeypatch.setattr("minillm.cli.run_batch_engine", lambda *a, **kw: pytest.fail("the model loaded"))
    status, out, err = run_main(capsys, "run-batch", "-i", "in.jsonl", "-o", output, str(stories_path))
    assert (status, out) == (2, "") and len(err.strip().splitlines()) == 1, err
    assert "Invalid value for '--output-file'" in err and "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists()
