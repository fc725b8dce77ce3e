"""vLLM's offline API pieces around structured outputs and engine construction: LLM's
structured_outputs_config (checked as serve's --structured-outputs-config is), a request's
disable_additional_properties read the same offline and by the server, object schemas that list no keys
as vLLM's default backend (xgrammar, strict) reads them, and EngineArgs with LLMEngine.from_engine_args."""
from __future__ import annotations

import argparse
import dataclasses
import json

import jsonschema
import pytest
from test_abuse34_reasoning_structured import BIAS, END_THINK, SCHEMA, thinking_model

from minillm import LLM, EngineArgs, LLMEngine, SamplingParams, StructuredOutputsParams
from minillm.config import EngineConfig
from minillm.server.app import ServerOptions
from minillm.server.protocol import CompletionRequest
from minillm.server.structured import structured_outputs_params
from minillm.structured_output import StructuredOutputManager
from minillm.structured_outputs_config import StructuredOutputsConfig

UNITS = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def manager(tok):
    mgr = StructuredOutputManager.from_tokenizer(tok, 512, max_num_seqs=4)
    yield mgr
    mgr.shutdown()


def accepts(manager, params: StructuredOutputsParams, text: str) -> bool:
    """Whether the constraint takes text as a whole output."""
    matcher = manager.grammar_init(params).result().new_matcher()
    return matcher.accept_tokens(manager.ll_tokenizer.tokenize_str(text)) and matcher.can_terminate()


def engine_key(engine: LLMEngine, options: dict) -> tuple:
    """The constraint key the engine runs a UNITS request with (options: StructuredOutputsParams' own)."""
    params = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=UNITS, **options))
    engine.add_request("k", "Tom", params)
    key = engine.requests["k"].seqs[0].params.structured_outputs.key
    engine.abort_request("k")
    while engine.has_unfinished_requests():
        engine.step()
    return key


# ---- LLM(structured_outputs_config=...) ---------------------------------------------------------------

@pytest.mark.parametrize("config", [
    {"backend": "xgrammar"}, {"backend": "nope"}, {"disable_any_whitespace": False}, {"bogus": True},
    {"reasoning_parser": "nope"}, {"reasoning_parser_plugin": "x.py"}, {"enable_in_reasoning": "yes"}, [1],
], ids=["xgrammar", "unknown-backend", "whitespace", "unknown-key", "parser", "plugin", "not-bool", "not-object"])
def test_llm_refuses_a_structured_outputs_config_as_serve_does(stories_path, config):
    with pytest.raises(ValueError) as served:
        ServerOptions(structured_outputs_config=config)
    with pytest.raises(ValueError) as offline:
        LLM(str(stories_path), device="cpu", structured_outputs_config=config)
    assert str(offline.value) == str(served.value) and "structured_outputs_config" in str(offline.value)


def test_the_config_dataclass_has_vllms_fields_and_checks_them():
    assert [f.name for f in dataclasses.fields(StructuredOutputsConfig)] == [
        "backend", "disable_fallback", "disable_any_whitespace", "disable_additional_properties", "reasoning_parser",
        "reasoning_parser_plugin", "enable_in_reasoning"]
    with pytest.raises(TypeError, match="bogus"):
        StructuredOutputsConfig(bogus=1)
    with pytest.raises(ValueError, match="structured_outputs_config.backend"):
        StructuredOutputsConfig(backend="outlines")
    given = StructuredOutputsConfig(backend="guidance", disable_additional_properties=True)
    assert StructuredOutputsConfig.from_any(json.dumps(given.to_dict())) == given
    assert EngineConfig(model="m", structured_outputs_config={"backend": "guidance",
                                                               "disable_additional_properties": True}
                        ).structured_outputs_config == given


def test_llm_on_the_guidance_backend_reads_schemas_as_that_backend(stories_path):
    closed = StructuredOutputsParams(json=UNITS).key
    opened = StructuredOutputsParams(json=UNITS, disable_additional_properties=False).key
    assert closed != opened
    with LLM(str(stories_path), device="cpu", max_model_len=64,
             structured_outputs_config=StructuredOutputsConfig(backend="guidance")) as llm:
        assert engine_key(llm.llm_engine, {}) == opened
        assert engine_key(llm.llm_engine, {"disable_additional_properties": True}) == closed
        assert llm.generate(["Tom"], GREEDY)[0].outputs[0].text      # the engine runs as ever
    with LLM(str(stories_path), device="cpu", max_model_len=64,
             structured_outputs_config={"backend": "guidance", "disable_additional_properties": True}) as llm:
        assert engine_key(llm.llm_engine, {}) == closed
        assert engine_key(llm.llm_engine, {"disable_additional_properties": False}) == opened
    with LLM(str(stories_path), device="cpu", max_model_len=64, structured_outputs_config={}) as llm:
        assert engine_key(llm.llm_engine, {}) == closed


def test_a_reasoning_parser_without_thinking_tokens_is_refused_at_start(stories_path):
    with pytest.raises(ValueError, match="structured_outputs_config.reasoning_parser 'qwen3'.*single tokens"):
        LLM(str(stories_path), device="cpu", structured_outputs_config={"reasoning_parser": "qwen3"})
    with LLM(str(stories_path), device="cpu", max_model_len=64,           # held from the first token: no tags needed
             structured_outputs_config={"reasoning_parser": "qwen3", "enable_in_reasoning": True}) as llm:
        params = SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA))
        jsonschema.validate(json.loads(llm.generate(["Tom"], params)[0].outputs[0].text), SCHEMA)


def test_llm_with_a_reasoning_parser_holds_only_what_follows_the_thinking(stories_path, tmp_path):
    model = thinking_model(stories_path, tmp_path / "thinking")
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=120, logit_bias=BIAS, skip_special_tokens=False,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA)) for seed in range(8)]
    with LLM(str(model), device="cpu", max_model_len=256,
             structured_outputs_config={"reasoning_parser": "deepseek_r1"}) as llm:
        outputs = [out.outputs[0] for out in llm.generate([[1, 403]] * 8, params)]
        tokenizer = llm.get_tokenizer()
    reasoned = 0
    for out in outputs:
        ids = list(out.token_ids)
        assert out.finish_reason == "stop" and END_THINK in ids, out.text
        k = ids.index(END_THINK)
        jsonschema.validate(json.loads(tokenizer.decode(ids[k + 1:])), SCHEMA)
        reasoned += k > 2 and not tokenizer.decode(ids[:k]).lstrip().startswith("{")
    assert reasoned >= 4                         # free words before </think>, which the schema would refuse


# ---- a request's disable_additional_properties, offline and through the server ---------------------------

@pytest.mark.parametrize("config", [{}, {"backend": "guidance"}, {"backend": "guidance",
                                                                   "disable_additional_properties": True}],
                         ids=["auto", "guidance", "guidance-closed"])
@pytest.mark.parametrize("options", [{}, {"disable_additional_properties": False},
                                     {"disable_additional_properties": True}], ids=["unset", "false", "true"])
def test_the_server_reads_a_requests_option_as_the_offline_engine_does(stories_path, config, options):
    req = CompletionRequest(model="m", prompt="x", structured_outputs={"json": UNITS, **options})
    served = structured_outputs_params(req, None, ServerOptions(structured_outputs_config=config)
                                       .disable_additional_properties)
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(stories_path), device="cpu", max_model_len=32,
                                                   structured_outputs_config=config), log=lambda line: None)
    try:
        assert engine_key(engine, options) == served.key
    finally:
        engine.shutdown()
    # vLLM's reading: under its default backend objects are closed whatever the request says (false is
    # its own default); under guidance the request's value where set, else the config's
    if config.get("backend") == "guidance":
        asked = options.get("disable_additional_properties")
        want_closed = asked if asked is not None else config.get("disable_additional_properties", False)
    else:
        want_closed = True
    assert (served.key == StructuredOutputsParams(json=UNITS).key) is want_closed


def test_a_false_under_the_default_backend_leaves_the_objects_closed_offline_as_served(llm):
    # vLLM's StructuredOutputsParams defaults disable_additional_properties to false: a script that writes
    # it out got open objects offline (closed through the server, and in vLLM).
    closed = StructuredOutputsParams(json=UNITS).key
    assert engine_key(llm.llm_engine, {"disable_additional_properties": False}) == closed
    req = CompletionRequest(model="m", prompt="x", structured_outputs={"json": UNITS,
                                                                       "disable_additional_properties": False})
    assert structured_outputs_params(req, None, ServerOptions().disable_additional_properties).key == closed
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=40, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "boolean"}}}, disable_additional_properties=False))
    for out in llm.generate(["Tom"] * 4, params):
        if out.outputs[0].finish_reason == "stop":
            assert set(json.loads(out.outputs[0].text)) <= {"a"}, out.outputs[0].text


# ---- object schemas that list no keys (xgrammar's strict mode) -------------------------------------------

@pytest.mark.parametrize("schema", [{"type": "object"}, {"type": "object", "title": "Meta", "description": "any"},
                                    {"type": "object", "additionalProperties": True}],
                         ids=["bare", "annotated", "said-open"])
def test_a_bare_object_schema_takes_any_object(manager, schema):
    params = StructuredOutputsParams(json=schema)
    assert accepts(manager, params, '{"x":1,"y":{"z":[2]}}') and accepts(manager, params, "{}")
    nested = StructuredOutputsParams(json={"type": "object", "properties": {"meta": schema}, "required": ["meta"]})
    assert accepts(manager, nested, '{"meta":{"x":1}}') and not accepts(manager, nested, '{"meta":{},"z":1}')


@pytest.mark.parametrize("schema", [{"type": "object", "maxProperties": 3}, {"type": "object", "required": []},
                                    {"type": "object", "minProperties": 0}, {"type": "object", "properties": {}}],
                         ids=["maxProperties", "required-none", "minProperties-0", "no-properties"])
def test_an_object_schema_that_says_more_than_its_type_and_lists_no_keys_takes_only_the_empty_object(manager, schema):
    params = StructuredOutputsParams(json=schema)
    assert accepts(manager, params, "{}") and not accepts(manager, params, '{"x":1}')
    opened = StructuredOutputsParams(json=schema, disable_additional_properties=False)
    assert accepts(manager, opened, '{"x":1}')
    in_list = StructuredOutputsParams(json={"type": "array", "items": schema})
    assert accepts(manager, in_list, "[{},{}]") and not accepts(manager, in_list, '[{"x":1}]')


@pytest.mark.parametrize("schema,text", [
    ({"type": "object", "required": ["a"]}, '{"a":1}'),
    ({"type": "object", "minProperties": 1}, '{"a":1}'),
    ({"allOf": [{"type": "object", "required": []}, {"properties": {"a": {"type": "integer"}}}]}, '{"a":1}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"type": "object", "required": []}]},
     '{"a":1}'),
], ids=["required", "minProperties", "allOf", "beside-anyOf"])
def test_an_object_schema_with_no_keys_that_closed_could_not_be_met_stays_open(manager, schema, text):
    assert accepts(manager, StructuredOutputsParams(json=schema), text)


# ---- EngineArgs and LLMEngine.from_engine_args -------------------------------------------------------------

def test_engine_args_has_engine_configs_fields_and_refuses_others():
    num_config_fields = len(dataclasses.fields(EngineConfig))     # then vLLM's names LLM takes too
    assert [(f.name, f.default) for f in dataclasses.fields(EngineArgs)][:num_config_fields] == \
        [(f.name, f.default) for f in dataclasses.fields(EngineConfig)]
    with pytest.raises(TypeError, match="bogus"):
        EngineArgs(model="m", bogus=1)
    args = EngineArgs(model="m", max_model_len=64)
    args.max_model_len = 32                       # mutable, as vLLM's
    config = args.create_engine_config()
    assert isinstance(config, EngineConfig) and config.max_model_len == 32 and config.model == "m"
    with pytest.raises(ValueError, match="block_size"):
        EngineArgs(model="m", block_size=3).create_engine_config()
    namespace = argparse.Namespace(model="m", max_num_seqs=4, port=8000)    # a CLI's other flags are left out
    assert EngineArgs.from_cli_args(namespace) == EngineArgs(model="m", max_num_seqs=4)


def test_llm_engine_from_engine_args_runs_as_llm_does(stories_path):
    with LLM(str(stories_path), device="cpu", max_model_len=64) as llm:
        expected = llm.generate(["Once upon a time"], GREEDY)[0].outputs[0].token_ids
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(stories_path), device="cpu", max_model_len=64),
                                        log=lambda line: None)
    try:
        engine.add_request("r", "Once upon a time", GREEDY)
        done = []
        while engine.has_unfinished_requests():
            done += [out for out in engine.step() if out.finished]
        assert engine.max_model_len == 64 and list(done[0].outputs[0].token_ids) == list(expected)
    finally:
        engine.shutdown()


def test_from_engine_args_names_what_it_does_not_take(stories_path):
    args = EngineArgs(model=str(stories_path), device="cpu")
    with pytest.raises(ValueError, match="stat_loggers"):
        LLMEngine.from_engine_args(args, stat_loggers=[object()])
    with pytest.raises(ValueError, match="enable_multiprocessing"):
        LLMEngine.from_engine_args(args, enable_multiprocessing=True)
    with pytest.raises(TypeError, match="EngineArgs"):
        LLMEngine.from_engine_args(EngineConfig(model=str(stories_path)))


def test_vllms_imports_work():
    import minillm
    assert {"EngineArgs", "LLMEngine"} <= set(minillm.__all__)
    assert minillm.EngineArgs is EngineArgs and EngineArgs.__module__ == "minillm.engine_args"
