"""Hostile structured-output requests on stories260K (CPU): constraints that are valid but large,
unsatisfiable or slow to compile must give a clean answer (an error naming the field, or a finished
request), never a failure in the middle of the output or a stalled engine."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minillm import LLM, SamplingParams, StructuredOutputsParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.structured_output import StructuredOutputsError
from test_structured_engine import gated_compile, run_until  # noqa: F401 (a fixture)

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm(stories_path):
    with LLM(str(stories_path), device="cpu", max_num_seqs=16) as engine:
        yield engine


def test_a_choice_of_thousands_of_entries_is_generated_whole(llm):
    # Past 2,000 alternatives the first token used to be refused (llguidance's row limit): finish
    # "error" after one byte.
    choices = [f"c{i}" for i in range(5000)] + ["c1", "zebra crossing"]
    params = [SamplingParams(temperature=t, seed=s, max_tokens=16,
                             structured_outputs=StructuredOutputsParams(choice=choices))
              for t, s in [(0.0, None), *((1.0, seed) for seed in range(8))]]
    for out in llm.generate([PROMPT] * len(params), params):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (completion.finish_reason, completion.text)
        assert completion.text in choices


@pytest.mark.parametrize("kwargs,field", [
    (dict(regex=r"[^\s\S]"), "regex"),
    (dict(json={"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}), "json"),
    (dict(grammar='start: start "a"'), "grammar"),
])
def test_a_constraint_nothing_satisfies_ends_its_request_saying_so(llm, kwargs, field):
    # The entry check refuses these (test_abuse38_structured); one the engine core takes unchecked
    # (from_checked) fails on the compile pool, where the message used to call it "too large to
    # match: NoExtensionBias". A healthy request beside it is untouched.
    constraint = StructuredOutputsParams.from_checked(**kwargs)
    bad = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=constraint)
    good = SamplingParams(temperature=0.0, max_tokens=8)
    alone = llm.generate([PROMPT], [good])[0].outputs[0]
    failed, healthy = (o.outputs[0] for o in llm.generate([PROMPT, PROMPT], [bad, good]))
    assert failed.finish_reason == "error" and failed.text == ""
    assert failed.stop_reason.startswith(f"structured_outputs.{field}: no output satisfies the"), failed.stop_reason
    assert (healthy.finish_reason, healthy.token_ids) == (alone.finish_reason, alone.token_ids)


def test_compiles_of_aborted_requests_are_cancelled_and_do_not_hold_up_later_ones(stories_path, gated_compile):
    # A client sends many distinct slow constraints and goes away: their queued compiles used to
    # run anyway, one after another, ahead of every later request's grammar.
    engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu"))
    def constrained(regex):
        return SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=regex))
    gates = []
    for i in range(2):                      # both compile workers busy
        busy = StructuredOutputsParams(regex=f"busy{i}")   # built before its gate: the entry check compiles too
        gates.append(gated_compile(busy))
        engine.add_request(f"busy{i}", PROMPT, SamplingParams(temperature=0, max_tokens=12, structured_outputs=busy))
    for gate, entered in gates:
        assert entered.wait(timeout=120)
    for i in range(6):                      # queued behind them, then aborted
        engine.add_request(f"gone{i}", PROMPT, constrained(f"gone{i}[a-z]"))
    engine.add_request("shared", PROMPT, constrained("gone0[a-z]"))   # waits on an aborted one's compile
    futures = {seq.request_id: seq.structured_output.grammar for seq in engine.structured_outputs._compiling}
    for i in range(6):
        engine.abort_request(f"gone{i}")
    engine.add_request("later", PROMPT, constrained("later"))
    engine.step()
    assert all(futures[f"gone{i}"].cancelled() for i in range(1, 6))
    assert not futures["shared"].cancelled()
    for gate, _ in gates:
        gate.set()
    outs = run_until(engine, lambda o: all(k in o and o[k].finished for k in ("busy0", "busy1", "shared", "later")))
    assert outs["later"].outputs[0].text == "later" and outs["later"].outputs[0].finish_reason == "stop"
    assert re.fullmatch("gone0[a-z]", outs["shared"].outputs[0].text)
    assert not engine.has_unfinished_requests()
    engine.shutdown()


def nested_schema(depth: int) -> str:
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


def nested_dict(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("schema", [nested_schema(5000), nested_dict(5000)])
def test_a_schema_nested_past_pythons_recursion_limit_is_a_value_error_naming_json(schema):
    # It was a RecursionError from json (neither a ValueError nor a 400).
    with pytest.raises(StructuredOutputsError, match="^json: the schema is nested too deeply") as info:
        StructuredOutputsParams(json=schema)
    assert info.value.field == "json"


CHAINS = '''
import json, sys
from minillm import LLM, SamplingParams, StructuredOutputsParams
from minillm.structured_output import MAX_CONSTRAINT_CHARS as M
rules, i = ["start: a0"], 0
while sum(len(r) + 1 for r in rules) < M - 40:
    rules.append(f"a{i}: a{i+1}"); i += 1
lark = dict(grammar="\\n".join(rules + [f'a{i}: "x"']))
defs, i = {}, 0
while len(json.dumps(defs, separators=(",", ":"))) < M - 300:
    nxt = {"$ref": f"#/$defs/{i+1}"}
    defs[str(i)] = {"anyOf": [{"type": "object", "properties": {"k": {"allOf": [nxt]}}}, {"type": "integer"}]}
    i += 1
defs[str(i)] = {"type": "string"}
refs = dict(json={"$defs": defs, "$ref": "#/$defs/0"})
params = [StructuredOutputsParams(**kw) for kw in (lark, refs)]
print("validated", flush=True)
with LLM(sys.argv[1], device="cpu") as llm:
    outs = llm.generate(["Once"] * 2, [SamplingParams(max_tokens=8, temperature=0, structured_outputs=p) for p in params])
    print("generated", [o.outputs[0].finish_reason for o in outs], flush=True)
'''


def test_the_longest_rule_and_ref_chains_taken_do_not_overflow_the_stack(stories_path):
    # llguidance recursed down a chain of ~2,500 Lark rules, or ~600 $refs, on the caller's 8 MiB
    # stack and the process died (SIGSEGV) while the request was checked. In a child process, so a
    # crash fails this test rather than the run.
    proc = subprocess.run([sys.executable, "-c", CHAINS, str(stories_path)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "validated" in proc.stdout
    assert "generated ['stop', 'length']" in proc.stdout, proc.stdout


@pytest.mark.parametrize("kwargs,field", [
    (dict(grammar="start: a0\n" + "\n".join(f"a{i}: a{i + 1}" for i in range(20000)) + '\na20000: "x"'), "grammar"),
    (dict(json={"$defs": {str(i): {"$ref": f"#/$defs/{i + 1}"} for i in range(10000)}, "$ref": "#/$defs/0"}), "json"),
])
def test_a_grammar_or_schema_past_the_size_bound_is_a_value_error_naming_it(kwargs, field):
    with pytest.raises(StructuredOutputsError, match=f"^{field}: the .* characters long; at most ") as info:
        StructuredOutputsParams(**kwargs)
    assert info.value.field == field


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    from test_server_helpers import chat_model_dir, running_server
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat-model"))
    with running_server(model, served_model_name="stories") as (url, _engine):
        yield url


@pytest.mark.parametrize("endpoint,fields,param", [
    ("completions", {"structured_outputs": {"json": nested_schema(3000)}}, "structured_outputs.json"),
    ("completions", {"structured_outputs": {"grammar": "start: a0\n" + "\n".join(f"a{i}: a{i + 1}" for i in range(20000))}},
     "structured_outputs.grammar"),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "chain", "schema": {
        "$defs": {str(i): {"$ref": f"#/$defs/{i + 1}"} for i in range(10000)}, "$ref": "#/$defs/0"}}}},
     "response_format.json_schema.schema"),
    ("completions", {"structured_outputs": {"json": {"type": "integer", "minimum": 1e19, "maximum": 2e19}}},
     "structured_outputs.json"),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "integer", "maximum": -1e19}}}}, "response_format.json_schema.schema"),
])
def test_the_server_answers_a_400_naming_the_field_and_goes_on(server, endpoint, fields, param):
    # The nested schema text was a 500 (RecursionError); the chains could kill the API server.
    import httpx
    body = {"model": "stories", "max_tokens": 4, **fields}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if endpoint.startswith("chat") else {"prompt": PROMPT})
    r = httpx.post(f"{server}/v1/{endpoint}", json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = httpx.post(f"{server}/v1/completions", json={"model": "stories", "prompt": PROMPT, "max_tokens": 4,
                                                     "structured_outputs": {"choice": ["yes", "no"]}}, timeout=120)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("yes", "no")


@pytest.mark.parametrize("endpoint,fields,param", [
    ("completions", {"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs.regex"),
    ("completions", {"structured_outputs": {"grammar": 'start: start "a"'}}, "structured_outputs.grammar"),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": {
        "$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}}, "response_format.json_schema.schema"),
])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_constraint_the_engine_cannot_compile_is_a_400(server, endpoint, fields, param, stream):
    # Valid at the entry check, refused by the engine's compile: nothing has been sent yet (a stream
    # waits for its first event before its status line), so it is the client's error, not a 200
    # with finish_reason "error".
    import httpx
    body = {"model": "stories", "max_tokens": 4, "stream": stream, **fields}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if endpoint.startswith("chat") else {"prompt": PROMPT})
    r = httpx.post(f"{server}/v1/{endpoint}", json=body, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "no output satisfies" in error["message"], error
