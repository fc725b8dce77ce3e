"""Structured outputs through the engine on stories260K (CPU): LLM.generate with batches of
seeded requests under a JSON schema, regexes, a choice and a Lark grammar; constrained and
unconstrained requests together (async scheduling on and off, under preemption); the wait for a
grammar, a failed compile, a refused token, the stats; bad input in the Python API."""
import ast
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import jsonschema
import pytest

import minillm.structured_output as so
from minillm import LLM, SamplingParams, StructuredOutputsParams
from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.structured_output import StructuredOutputsError
from test_structured_output import ARITHMETIC_BOUNDED, ARITHMETIC_BOUNDED_RE, CHOICES, DATE, EMAIL, SCHEMA

PROMPT = "Once upon a time"
CHECKS = {
    "json": (dict(json=SCHEMA), lambda s: jsonschema.validate(json.loads(s), SCHEMA) is None),
    "date": (dict(regex=DATE), lambda s: re.fullmatch(DATE, s) is not None),
    "email": (dict(regex=EMAIL), lambda s: re.fullmatch(EMAIL, s) is not None),
    "choice": (dict(choice=CHOICES), lambda s: s in CHOICES),
    "arithmetic": (dict(grammar=ARITHMETIC_BOUNDED),
                   lambda s: re.fullmatch(ARITHMETIC_BOUNDED_RE, s) is not None
                   and isinstance(ast.parse(s, mode="eval").body, (ast.BinOp, ast.Constant))),
}
# Every grammar above is finite and spells at most 93 bytes: one token a byte at worst.
MAX_TOKENS = 96
SEEDS = range(50)


def constrained(kind: str, seed: int | None = None, **kwargs) -> SamplingParams:
    """Temperature 1.0 with a seed, or greedy when seed is None."""
    temperature = 0.0 if seed is None else 1.0
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=MAX_TOKENS,
                          structured_outputs=StructuredOutputsParams(**CHECKS[kind][0]), **kwargs)


def assert_valid(kind: str, completion, label="") -> None:
    assert completion.finish_reason == "stop", f"{kind} {label}: {completion.finish_reason} {completion.text!r}"
    assert CHECKS[kind][1](completion.text), f"{kind} {label}: {completion.text!r}"


@pytest.fixture(scope="module")
def seeded_batch(stories_path):
    """50 seeds at temperature 1.0 and one greedy request per kind, all in one LLM.generate."""
    rows = [(kind, seed) for kind in CHECKS for seed in [*SEEDS, None]]
    with LLM(str(stories_path), device="cpu", max_num_seqs=len(rows)) as llm:
        outs = llm.generate([PROMPT] * len(rows), [constrained(kind, seed) for kind, seed in rows])
        stats = llm.engine.stats()
    return rows, outs, stats


@pytest.mark.parametrize("kind", list(CHECKS))
def test_every_seeded_output_obeys_its_constraint(seeded_batch, kind):
    rows, outs, _ = seeded_batch
    texts = set()
    for (k, seed), out in zip(rows, outs):
        if k == kind:
            assert_valid(kind, out.outputs[0], f"seed {seed}")
            texts.add(out.outputs[0].text)
    assert len(texts) >= (2 if kind == "choice" else 10)      # temperature 1.0 explores


def test_stats_count_compiles_and_fills(seeded_batch):
    _, _, stats = seeded_batch
    assert stats.num_grammars_compiled == len(CHECKS)               # one compile per constraint, cached
    assert stats.grammar_compile_time_s > 0
    assert stats.num_grammar_fill_steps > 0 and stats.grammar_fill_time_s > 0
    assert 0 < stats.grammar_fill_p50_s <= stats.grammar_fill_p99_s
    assert stats.step_time_breakdown_s["grammar_fill"] == pytest.approx(stats.grammar_fill_time_s)
    json.dumps(stats.to_dict())


def test_structured_rows_are_marked_in_the_stats_and_the_monitor(stories_path):
    from minillm.tui.request_table import row_cells
    engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu"))
    engine.add_request("c", PROMPT, constrained("json", seed=1))
    engine.add_request("u", PROMPT, GREEDY)
    engine.step()
    rows = {r.request_id: r for r in engine.stats().requests}
    assert rows["c"].is_structured and not rows["u"].is_structured
    assert row_cells(rows["c"], 16)[0].plain == "◆ c" and row_cells(rows["u"], 16)[0].plain == "■ u"
    engine.shutdown()


def test_n_completions_each_obey_the_constraint(stories_path):
    with LLM(str(stories_path), device="cpu") as llm:
        out = llm.generate(PROMPT, constrained("date", seed=7, n=4))[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert_valid("date", c)


# ----------------------------------------------------------------------------- mixed batches

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def mixed(stories_path):
    """16 unconstrained greedy prompts and 12 constrained requests (greedy and seeded), each
    with its output when generated alone."""
    golden = json.loads((stories_path / "reference.json").read_text())["greedy_from_bos_200_ids"]
    prompts = [[1] + golden[1 + 3 * i: 4 + 4 * i] for i in range(16)]
    params = [GREEDY] * len(prompts)
    kinds = []
    for i, kind in enumerate(["json", "date", "email", "choice", "arithmetic", "json"] * 2):
        prompts.append([1] + golden[50 + i: 56 + 2 * i])
        params.append(constrained(kind, seed=None if i % 2 else 100 + i))
        kinds.append(kind)
    with LLM(str(stories_path), device="cpu", enable_prefix_caching=False) as llm:
        alone = [llm.generate([p], sp)[0].outputs[0] for p, sp in zip(prompts, params)]
    return prompts, params, kinds, alone


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("preempt", [False, True], ids=["roomy", "preempting"])
def test_mixed_batch_gives_every_request_its_alone_output(stories_path, mixed, async_scheduling, preempt):
    prompts, params, kinds, alone = mixed
    pool = dict(num_kv_blocks=40, block_size=4, max_model_len=128) if preempt else {}
    with LLM(str(stories_path), device="cpu", async_scheduling=async_scheduling, **pool) as llm:
        together = [o.outputs[0] for o in llm.generate(prompts, params)]
        if preempt:
            assert llm.engine.scheduler.num_preemptions > 0
            assert llm.engine.block_manager.num_free_blocks == 40
    num_plain = len(prompts) - len(kinds)
    assert [c.token_ids for c in together[:num_plain]] == [c.token_ids for c in alone[:num_plain]]
    for kind, c, solo in zip(kinds, together[num_plain:], alone[num_plain:]):
        assert_valid(kind, c)
        assert c.token_ids == solo.token_ids and c.text == solo.text


# ----------------------------------------------------------------------------- engine behaviour

def test_a_complete_grammar_stops_even_under_ignore_eos_and_min_tokens(stories_path):
    with LLM(str(stories_path), device="cpu") as llm:
        outs = llm.generate([PROMPT] * 2, [constrained("choice", seed=3, ignore_eos=True, min_tokens=40),
                                           constrained("date", seed=4, ignore_eos=True)])
    for kind, out in zip(["choice", "date"], outs):
        c = out.outputs[0]
        assert_valid(kind, c)
        assert c.stop_reason is None and len(c.token_ids) < 40
        assert llm.get_tokenizer().decode(c.token_ids) == c.text       # the last token is text, not EOS


def test_a_stop_string_on_the_token_that_completes_the_grammar_is_the_stop_reason(stories_path):
    """The grammar and the stop string end the output on the same token: the text is cut at the stop
    string, which is the stop_reason, as vLLM's output processor has it."""
    regex = StructuredOutputsParams(regex="abc")
    with LLM(str(stories_path), device="cpu") as llm:
        outs = llm.generate(["Tom is"] * 3, [SamplingParams(temperature=0, max_tokens=20, stop=stop,
                                                            structured_outputs=regex, include_stop_str_in_output=keep)
                                             for stop, keep in ((["c"], False), (["bc"], True), (["b"], False))])
    assert [(o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs] == \
        [("ab", "stop", "c"), ("abc", "stop", "bc"), ("a", "stop", "b")]


def test_ignore_eos_under_a_grammar_that_may_go_on_runs_to_max_tokens(stories_path):
    # At temperature 5 the model samples EOS wherever the grammar may end; ignore_eos keeps it out.
    params = [SamplingParams(temperature=5.0, seed=seed, max_tokens=200, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(regex="(a|b)*a[ab]{5}"))
              for seed in range(8)]
    with LLM(str(stories_path), device="cpu", max_num_seqs=8) as llm:
        outs = llm.generate([PROMPT] * 8, params)
    for out in outs:
        c = out.outputs[0]
        assert (c.finish_reason, len(c.token_ids)) == ("length", 200), c
        assert re.fullmatch("[ab]*", c.text), c.text


def test_a_grammar_a_request_drove_into_llguidances_limits_is_compiled_again_for_the_next(stories_path):
    # The copies of a compiled grammar share its lexer states, and a limit counts them all: a
    # request that runs into it must not leave the cached grammar failing every later request.
    regex = "((a{1,100}){1,100}){1,97}"

    def greedy(max_tokens):
        return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                              structured_outputs=StructuredOutputsParams(regex=regex))

    with LLM(str(stories_path), device="cpu") as llm:
        before = llm.generate([PROMPT], [greedy(10)])[0].outputs[0]
        long = llm.generate([PROMPT], [greedy(100)])[0].outputs[0]
        after = [llm.generate([PROMPT], [greedy(10)])[0].outputs[0] for _ in range(2)]
    assert (before.text, before.finish_reason) == ("a" * 10, "length")
    assert long.finish_reason == "error" and "too many expressions" in long.stop_reason, long
    for c in after:
        assert (c.text, c.finish_reason) == ("a" * 10, "length"), c


def run_until(engine, predicate, max_steps=2000):
    outputs = {}
    for _ in range(max_steps):
        if predicate(outputs):
            return outputs
        for out in engine.step():
            outputs[out.request_id] = out
    raise AssertionError("the engine did not get there")


@pytest.fixture
def gated_compile(monkeypatch):
    """Compiles of the constraint a test registers block on the pool until the gate opens."""
    real, gated = so.serialize_grammar, {}

    def serialize(key, *args):
        if key in gated:
            gated[key][1].set()
            assert gated[key][0].wait(timeout=120)
        return real(key, *args)

    def gate(params):
        gated[params.key] = (threading.Event(), threading.Event())
        return gated[params.key]

    monkeypatch.setattr(so, "serialize_grammar", serialize)
    return gate


def test_a_request_waits_for_its_grammar_while_others_run(stories_path, gated_compile):
    engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu"))
    params = StructuredOutputsParams(regex="[a-z]{3}-slow")
    gate, entered = gated_compile(params)
    engine.add_request("c", PROMPT, SamplingParams(temperature=0, max_tokens=20, structured_outputs=params))
    engine.add_request("u", PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert entered.wait(timeout=120)                                # compiling on the pool
    outs = run_until(engine, lambda o: "u" in o and o["u"].finished)
    assert "c" not in outs and engine.requests["c"].metrics.first_scheduled_time is None
    row = {r.request_id: r for r in engine.stats().requests}["c"]
    assert row.state == "waiting" and row.is_structured
    gate.set()
    outs = run_until(engine, lambda o: "c" in o and o["c"].finished)
    assert re.fullmatch("[a-z]{3}-slow", outs["c"].outputs[0].text)
    assert not engine.has_unfinished_requests()
    engine.shutdown()


def test_a_failed_compile_finishes_only_that_request_with_an_error(stories_path, monkeypatch):
    engine = LLMEngine(EngineConfig(model=str(stories_path), device="cpu"), log=lambda msg: None)
    params = StructuredOutputsParams(regex="[0-9]+-fails")
    real = so.serialize_grammar

    def broken(key, *args):
        if key == params.key:
            raise StructuredOutputsError("regex", "the compiler gave up")
        return real(key, *args)

    monkeypatch.setattr(so, "serialize_grammar", broken)
    engine.add_request("bad", PROMPT, SamplingParams(max_tokens=8, structured_outputs=params))
    engine.add_request("ok", PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outs = run_until(engine, lambda o: all(k in o and o[k].finished for k in ("bad", "ok")))
    bad = outs["bad"].outputs[0]
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert bad.stop_reason == "structured_outputs.regex: the compiler gave up"
    assert outs["ok"].outputs[0].finish_reason == "length" and len(outs["ok"].outputs[0].token_ids) == 8
    assert engine.stats().num_requests_finished == {"error": 1, "length": 1}
    engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_token_the_grammar_refuses_ends_the_request_with_an_error(stories_path, monkeypatch, async_scheduling):
    import minillm.ops.numpy as npops
    monkeypatch.setattr(npops, "apply_token_bitmask", lambda logits, bitmask, rows: None)   # the mask is lost
    with LLM(str(stories_path), device="cpu", async_scheduling=async_scheduling) as llm:
        outs = llm.generate([PROMPT] * 2, [constrained("date"), GREEDY])
    c = outs[0].outputs[0]
    # Greedy says "," first, which the grammar refuses: the output stops before it.
    assert c.finish_reason == "error" and c.token_ids == [] and c.text == ""
    first = outs[1].outputs[0].token_ids[0]                             # the greedy request's first token
    assert c.stop_reason.startswith(f"structured_outputs: token {first} is not allowed")
    assert outs[1].outputs[0].finish_reason == "length"


def test_no_structure_asked_no_manager_and_no_llguidance(stories_path):
    code = ("import sys; from minillm import LLM, SamplingParams\n"
            f"llm = LLM({str(stories_path)!r}, device='cpu')\n"
            "out = llm.generate(['Once'], SamplingParams(max_tokens=4))[0]\n"
            "print(llm.engine.structured_outputs is None, 'llguidance' in sys.modules, out.finished)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[1])     # this checkout's minillm
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False", "True"]


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs,field", [
    (dict(json={"type": "strin"}), "json"),
    (dict(regex="a(b"), "regex"),
    (dict(grammar="start: undefined_rule"), "grammar"),
    (dict(choice=[]), "choice"),
    (dict(json={"type": "object"}, regex="a"), "structured_outputs"),
    # llguidance clamps an integer bound past 64 bits: 1e19 as a minimum let 2**63 - 1 through.
    (dict(json={"type": "integer", "minimum": 1e19, "maximum": 2e19}), "json"),
    (dict(json={"type": "object", "properties": {"n": {"type": ["integer", "null"], "exclusiveMaximum": -1e20}}}),
     "json"),
])
def test_bad_constraints_are_value_errors_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs))


def test_structured_outputs_must_be_its_params_object(stories_path):
    with pytest.raises(ValueError, match="^structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {"type": "object"}})
    params = SamplingParams(max_tokens=4)
    params.structured_outputs = {"regex": "a"}                    # set after construction
    with LLM(str(stories_path), device="cpu") as llm:
        with pytest.raises(ValueError, match="^structured_outputs"):
            llm.generate([PROMPT], params)
        assert not llm.engine.has_unfinished_requests()


def test_the_vllm_import_path_works():
    from minillm.sampling_params import StructuredOutputsParams as FromSamplingParams
    assert FromSamplingParams is StructuredOutputsParams


# ----------------------------------------------------------------------------- the CLI

def test_generate_options_constrain_the_output(stories_path, tmp_path):
    from test_cli import minillm
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    runs = {"json": ["--json-schema", str(schema)], "choice": sum((["--choice", c] for c in CHOICES), []),
            "date": ["--regex", DATE]}
    for kind, options in runs.items():
        result = minillm("generate", str(stories_path), "--device", "cpu", "-p", PROMPT, "-p", "Lily went",
                         "--temperature", "1.0", "--seed", "5", "--n", "3", "--max-tokens", str(MAX_TOKENS),
                         "--json", *options)
        assert result.returncode == 0, result.stderr
        for line in result.stdout.splitlines():
            for completion in json.loads(line)["outputs"]:
                assert completion["finish_reason"] == "stop" and CHECKS[kind][1](completion["text"]), completion


@pytest.mark.parametrize("options,message", [
    (["--regex", "a(b"], "--regex: invalid regular expression"),
    (["--json-schema", "/no/such/schema.json"], "--json-schema: cannot read /no/such/schema.json"),
    (["--regex", "a", "--choice", "b"], "give one of --json-schema, --regex, --choice, --grammar, not --regex and --choice"),
])
def test_generate_refuses_bad_structure_options(stories_path, options, message):
    """A usage error (status 2) naming the option, as every other bad option value is."""
    from test_cli import minillm
    result = minillm("generate", str(stories_path), "--device", "cpu", "-p", PROMPT, *options)
    assert result.returncode == 2 and message in result.stderr and result.stdout == ""
    assert result.stderr.startswith("minillm generate: error: ")


def test_tensor_parallel_engine_gives_the_same_constrained_outputs(stories_path):
    params = [constrained(kind, seed=20 + i) for i, kind in enumerate(CHECKS)] + [GREEDY]
    with LLM(str(stories_path), device="cpu") as llm:
        one = [o.outputs[0] for o in llm.generate([PROMPT] * len(params), params)]
    with LLM(str(stories_path), device="cpu", tensor_parallel_size=2) as llm:
        two = [o.outputs[0] for o in llm.generate([PROMPT] * len(params), params)]
    assert [c.token_ids for c in two] == [c.token_ids for c in one]
    for kind, c in zip(CHECKS, two):
        assert_valid(kind, c)


def test_a_missing_sampling_params_in_the_list_is_refused(stories_path):
    with LLM(str(stories_path), device="cpu") as llm:
        with pytest.raises(ValueError, match="sampling_params"):
            llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=2), None])
