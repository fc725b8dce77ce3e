"""Compatibility defects: generate's structure options as usage errors, bench serving's prompts file
with a byte-order mark, vLLM's LLM() arguments at their defaults and load_format="safetensors"."""
import pytest

from minillm.config import EngineConfig
from minillm.llm import LLM
from minillm.sampling_params import SamplingParams
from test_cli import minillm

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
PROMPT = "Once upon a time"


# ---- generate: a bad structure option is a usage error naming the flag -----------------------------

@pytest.mark.parametrize("options, flag, message", [
    (["--regex", "a(b"], "--regex", "invalid regular expression"),
    (["--json-schema", "/no/such/schema.json"], "--json-schema", "cannot read /no/such/schema.json"),
    (["--regex", "a", "--choice", "b"], "--regex", "give one of --json-schema, --regex, --choice, --grammar, "
                                                   "not --regex and --choice"),
    (["--json-schema", "{path}", "--grammar", "{path}"], "--grammar", "not --json-schema and --grammar"),
])
def test_generate_bad_structure_options_are_usage_errors(stories_path, tmp_path, options, flag, message):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "string"}')
    options = [o.format(path=schema) for o in options]
    result = minillm("generate", str(stories_path), "--device", "cpu", "-p", PROMPT, *options)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("minillm generate: error:") and flag in result.stderr
    assert message in result.stderr and result.stdout == "" and result.stderr.count("\n") == 1


@pytest.mark.parametrize("content, message", [
    ("{not json", "the schema is not valid JSON"),
    ('{"type": 5}', "invalid JSON schema"),
])
def test_generate_invalid_json_schema_file_is_a_usage_error(stories_path, tmp_path, content, message):
    schema = tmp_path / "schema.json"
    schema.write_text(content)
    result = minillm("generate", str(stories_path), "--device", "cpu", "-p", PROMPT, "--json-schema", str(schema))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("minillm generate: error: --json-schema") and "\n" not in result.stderr.rstrip()
    assert message in result.stderr and result.stdout == ""


# ---- bench serving --prompts-file: a byte-order mark is no part of the first prompt -----------------

def test_bench_serving_prompts_file_drops_the_byte_order_mark(tmp_path):
    from minillm.benchmarks.serving import read_prompts_file
    path = tmp_path / "prompts.txt"
    path.write_bytes("Once upon a time\r\n\r\nLily went\r\n".encode("utf-8-sig"))
    assert read_prompts_file(str(path)) == ["Once upon a time", "Lily went"]


def test_bench_serving_prompts_file_keeps_characters_that_are_not_line_breaks(tmp_path):
    from minillm.benchmarks.serving import read_prompts_file
    path = tmp_path / "prompts.txt"
    path.write_text("a\fb\u2028c\nd\n", encoding="utf-8")
    assert read_prompts_file(str(path)) == ["a\fb\u2028c", "d"]


# ---- LLM(): vLLM's arguments at their defaults ----------------------------------------------------

# vLLM's defaults (EngineArgs / SchedulerConfig / ModelConfig / CompilationConfig)
VLLM_DEFAULTS = dict(max_num_partial_prefills=1, max_long_partial_prefills=1, long_prefill_token_threshold=0,
                     enable_prompt_embeds=False, cuda_graph_sizes=None, max_cudagraph_capture_size=None)


def test_llm_takes_vllms_defaults_of_arguments_minillm_has_no_setting_for(stories_path):
    with LLM(str(stories_path), device="cpu", max_model_len=128) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate([PROMPT], GREEDY)]
    with LLM(str(stories_path), device="cpu", max_model_len=128, **VLLM_DEFAULTS) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate([PROMPT], GREEDY)] == expected
    with LLM(str(stories_path), device="cpu", max_model_len=128, cuda_graph_sizes=[]) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate([PROMPT], GREEDY)] == expected


@pytest.mark.parametrize("kwargs, needle", [
    ({"max_num_partial_prefills": 4}, "max_num_partial_prefills=4 is not supported: minillm"),
    ({"max_long_partial_prefills": 2}, "max_long_partial_prefills=2 is not supported: minillm"),
    ({"long_prefill_token_threshold": 512}, "long_prefill_token_threshold=512 is not supported: minillm"),
    ({"enable_prompt_embeds": True}, "enable_prompt_embeds=True is not supported: minillm takes text or token ids"),
    ({"cuda_graph_sizes": [8, 16]}, r"cuda_graph_sizes=\[8, 16\] is not supported: minillm"),
    ({"max_cudagraph_capture_size": 64}, "max_cudagraph_capture_size=64 is not supported: minillm"),
])
def test_llm_refuses_other_values_of_those_arguments_saying_what_minillm_does(stories_path, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        LLM(str(stories_path), device="cpu", **kwargs)


def test_load_format_safetensors_means_auto(stories_path):
    assert EngineConfig(model="m", load_format="safetensors").load_format == "auto"
    with LLM(str(stories_path), device="cpu", max_model_len=128) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate([PROMPT], GREEDY)]
    with LLM(str(stories_path), device="cpu", max_model_len=128, load_format="safetensors") as llm:
        assert [o.outputs[0].token_ids for o in llm.generate([PROMPT], GREEDY)] == expected


def test_load_format_other_than_checkpoint_or_dummy_is_still_refused():
    with pytest.raises(ValueError, match="load_format must be 'auto' .*'dummy'"):
        EngineConfig(model="m", load_format="pt")


def test_cli_load_format_safetensors_generates_what_auto_does(stories_path):
    runs = [minillm("generate", str(stories_path), "--device", "cpu", "-p", PROMPT, "--max-tokens", "4",
                    "--temperature", "0", "--load-format", fmt) for fmt in ("auto", "safetensors")]
    assert all(r.returncode == 0 for r in runs), runs[1].stderr
    assert runs[1].stdout == runs[0].stdout and runs[0].stdout.strip()
