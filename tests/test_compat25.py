"""Compatibility defects: generate's structure options as usage errors, bench serving's
prompts file with a byte-order mark."""
import pytest

from test_cli import minillm

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
    (b"\xff\xfe{}", "is not UTF-8 text"),
])
def test_generate_invalid_json_schema_file_is_a_usage_error(stories_path, tmp_path, content, message):
    schema = tmp_path / "schema.json"
    schema.write_bytes(content if isinstance(content, bytes) else content.encode())
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
