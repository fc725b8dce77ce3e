"""minillm bench serving reads vLLM's file datasets: --dataset-name sharegpt (first turn as the prompt, the
answer's token count as the output length, vLLM's length filter, shuffled with --seed) and --dataset-name
custom (a JSONL of {"prompt": ...}, --custom-output-len, the chat template unless --skip-chat-template); a
bad file or a flag of another dataset is one usage line naming the flag before any request is sent."""
from __future__ import annotations

import json
import random

import pytest
from test_server_helpers import chat_model_dir, running_server

from minillm.benchmarks import datasets
from minillm.benchmarks import serving as bench
from minillm.benchmarks.cli_args import BenchUsageError

# A ShareGPT file: four usable pairs, and one of each kind vLLM drops.
USABLE = [("Tell me a story about a dog.", "The dog ran to the park and played."),
          ("The cat sat.", "The cat sat on the mat and slept all day."),
          ("Once upon a time there was a girl.", "She had a red ball."),
          ("What did the boy see?", "The boy saw a big tree in the park.")]
DROPPED = [("Hi", "The dog ran to the park and played."),      # prompt under 4 tokens
           ("Tell me a story about a dog.", "ok"),             # answer under 4 tokens
           ("word " * 400, "The dog ran."),                    # prompt over 1024 tokens
           ("word " * 300, "word " * 400)]                     # prompt + answer over 2048 tokens


def _entry(prompt: str, answer: str) -> dict:
    return {"id": prompt[:8], "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer},
                                                {"from": "human", "value": "more"}]}


@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory):
    entries = [_entry(*pair) for pair in USABLE[:2] + DROPPED + USABLE[2:]]
    entries += [{"id": "one-turn", "conversations": [{"from": "human", "value": "Tell me a story about a dog."}]},
                {"id": "no-conversations"}]
    path = tmp_path_factory.mktemp("sharegpt") / "ShareGPT_V3_tiny.json"
    path.write_text(json.dumps(entries))
    return path


@pytest.fixture(scope="module")
def custom_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("custom") / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p, _ in USABLE) + "\n")
    return path


@pytest.fixture(scope="module")
def server(stories_path):
    with running_server(stories_path, max_model_len=256) as (url, _engine):
        yield url


def _args(*argv: str):
    return bench.parse_args(list(argv))


def _vllm_order(items: list, seed: int) -> list:
    """The order vLLM's load_data leaves them in: the global random module, seeded, shuffles them."""
    items = list(items)
    state = random.getstate()
    random.seed(seed)
    random.shuffle(items)
    random.setstate(state)
    return items


# ---- sampling --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 7])
def test_sharegpt_takes_the_first_turn_and_the_answers_length_in_vllms_order(sharegpt_file, tok, seed):
    args = _args("--dataset-name", "sharegpt", "--dataset-path", str(sharegpt_file), "--num-prompts", "4",
                 "--seed", str(seed))
    samples = datasets.sample_requests(args, tok)
    kept = [pair for pair in _vllm_order(USABLE[:2] + DROPPED + USABLE[2:], seed) if pair in USABLE]
    assert [s.prompt for s in samples] == [p for p, _ in kept]
    assert [s.expected_output_len for s in samples] == [len(tok(a).input_ids) for _, a in kept]
    assert [s.prompt_len for s in samples] == [len(tok(p).input_ids) for p, _ in kept]


def test_sharegpt_output_len_overrides_the_answer_and_lifts_its_floor(sharegpt_file, tok):
    args = _args("--dataset-name", "sharegpt", "--dataset-path", str(sharegpt_file), "--num-prompts", "5",
                 "--sharegpt-output-len", "2", "--disable-shuffle", "--no-oversample")
    samples = datasets.sample_requests(args, tok)
    # the pair whose answer is "ok" now counts, and so does the long pair whose answer made it too long;
    # the prompt over 1024 tokens still does not
    assert [s.prompt for s in samples] == [USABLE[0][0], USABLE[1][0], DROPPED[1][0], DROPPED[3][0], USABLE[2][0]]
    assert {s.expected_output_len for s in samples} == {2}


def test_too_few_usable_samples_are_oversampled_unless_no_oversample(sharegpt_file, tok, capsys):
    argv = ["--dataset-name", "sharegpt", "--dataset-path", str(sharegpt_file), "--num-prompts", "7"]
    samples = datasets.sample_requests(_args(*argv), tok)
    assert len(samples) == 7 and len({s.prompt for s in samples}) == 4       # vLLM draws the rest again
    assert samples[:4] == datasets.sample_requests(_args(*argv[:-1], "4"), tok)
    fewer = datasets.sample_requests(_args(*argv, "--no-oversample"), tok)
    assert len(fewer) == 4 and "--no-oversample: 4 of --num-prompts 7" in capsys.readouterr().err


def test_custom_reads_prompts_with_custom_output_len_and_the_chat_template(custom_file, stories_path, tmp_path, tok):
    chat_tok = datasets.load_tokenizer(str(chat_model_dir(stories_path, tmp_path / "chat")), "--tokenizer")
    argv = ["--dataset-name", "custom", "--dataset-path", str(custom_file), "--num-prompts", "3",
            "--custom-output-len", "5", "--disable-shuffle"]
    templated = datasets.sample_requests(_args(*argv), chat_tok)
    expected = [chat_tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=False) for p, _ in USABLE[:3]]
    assert [s.prompt for s in templated] == expected and expected[0] != USABLE[0][0]
    assert [s.expected_output_len for s in templated] == [5, 5, 5]
    plain = datasets.sample_requests(_args(*argv, "--skip-chat-template"), chat_tok)
    assert [s.prompt for s in plain] == [p for p, _ in USABLE[:3]]
    # on the chat endpoint the server renders the template: the prompt goes as the user message
    chat = datasets.sample_requests(_args(*argv, "--backend", "openai-chat"), chat_tok)
    assert [s.prompt for s in chat] == [p for p, _ in USABLE[:3]]
    shuffled = datasets.sample_requests(_args(*argv[:-1], "--skip-chat-template", "--seed", "3"), tok)
    assert [s.prompt for s in shuffled] == _vllm_order([p for p, _ in USABLE], 3)[:3]


# ---- usage errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--dataset-name", "sharegpt"], "--dataset-name sharegpt needs --dataset-path"),
    (["--dataset-path", "x.json"], "--dataset-path is read by --dataset-name sharegpt or custom, not random"),
    (["--dataset-name", "custom", "--dataset-path", "x.jsonl", "--sharegpt-output-len", "9"],
     "--sharegpt-output-len is read by --dataset-name sharegpt, not custom"),
    (["--dataset-name", "sharegpt", "--dataset-path", "x.json", "--skip-chat-template"],
     "--skip-chat-template is read by --dataset-name custom, not sharegpt"),
    (["--dataset-name", "sharegpt", "--dataset-path", "x.json", "--random-output-len", "9"],
     "--random-output-len is read by --dataset-name random, not sharegpt"),
    (["--dataset-name", "custom", "--dataset-path", "x.jsonl", "--prompt", "hi"],
     "--prompt is read by --dataset-name random, not custom"),
    (["--dataset-name", "custom", "--dataset-path", "x.jsonl", "--custom-output-len", "0"],
     "--custom-output-len must be in [1, 1048576], got 0"),
    (["--dataset-name", "sharegpt", "--dataset-path", "x.json", "--offline-model", "m"],
     "--offline-model runs random prompts only"),
])
def test_a_dataset_flag_that_does_not_fit_is_a_usage_error(argv, message):
    with pytest.raises(BenchUsageError) as info:
        bench.parse_args(argv)
    assert message in info.value.message, info.value.message


@pytest.mark.parametrize("name, text, message", [
    ("missing.json", None, "--dataset-path: cannot read"),
    ("dict.json", '{"conversations": []}', "holds a JSON dict, not ShareGPT's list"),
    ("broken.json", "[{", "is not JSON"),
    ("novalue.json", json.dumps([{"conversations": [{"from": "human"}, {"value": "x"}]}]),
     "entry 0's conversations[0] has no \"value\" string"),
    ("short.json", json.dumps([_entry("Hi", "ok")]), "has no usable sample for --dataset-name sharegpt"),
    ("data.jsonl", '{"text": "hi"}\n', "line 1 has no \"prompt\" string"),
    ("data.json", '{"prompt": "hi"}\n', "--dataset-name custom reads a JSONL file (.jsonl)"),
    ("plain.jsonl", '{"prompt": "hi"}\n', "tokenizer"),
])
def test_a_bad_dataset_file_is_one_usage_line_before_any_request(name, text, message, tmp_path, stories_path, capsys):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    dataset = "custom" if "prompt" in (text or "") or name.endswith(".jsonl") else "sharegpt"
    # port 9 has no server: a request sent would fail otherwise, not as a usage error
    status = bench.run_main(bench.main, "minillm bench serving", [
        "--port", "9", "--dataset-name", dataset, "--dataset-path", str(path), "--tokenizer", str(stories_path)])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and message in err, err


# ---- end to end ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dataset_argv", [
    ["--dataset-name", "sharegpt", "--num-prompts", "3"],
    ["--dataset-name", "custom", "--num-prompts", "2", "--custom-output-len", "3", "--skip-chat-template"],
])
def test_bench_serving_runs_each_dataset_against_a_server(dataset_argv, server, sharegpt_file, custom_file,
                                                          stories_path, tmp_path, capsys, tok):
    path = sharegpt_file if "sharegpt" in dataset_argv else custom_file
    out = tmp_path / "result.json"
    argv = [*dataset_argv, "--dataset-path", str(path), "--base-url", server, "--tokenizer", str(stories_path),
            "--result-file", str(out), "--save-detailed", "--disable-tqdm"]
    assert bench.main(argv) == 0, capsys.readouterr()
    table = capsys.readouterr().out
    assert f"dataset {dataset_argv[1]} {path}" in table, table
    expected = datasets.sample_requests(bench.parse_args(argv), tok)
    saved = json.loads(out.read_text())
    [result] = saved["results"]
    assert result["completed"] == len(expected) and result["failed"] == 0
    assert sorted(r["output_tokens"] for r in result["requests"]) == sorted(s.expected_output_len for s in expected)
    assert "dataset_samples" not in saved["args"]
