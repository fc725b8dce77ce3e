"""`minillm generate --logprobs` names the tokens of a character split over byte tokens as vLLM (and LLM.generate's
decoded_token) does; `minillm bench latency` runs vLLM's `vllm bench latency` on a fixed batch."""
from __future__ import annotations

import json

from test_cli import STORIES, needs_stories, run_main

EMOJI = "😀"          # four byte-fallback tokens in stories260K's vocabulary: <0xF0> <0x9F> <0x98> <0x80>
CHOICE = f"a {EMOJI} 日本"
# as the server names them (tests/test_abuse37_text.py): the byte tokens as vLLM's Logprob.decoded_token does,
# "" while a character is unfinished and the whole character on the token that ends it
CHOICE_TOKENS = ["a", " ", "", "", "", EMOJI, " ", "", "", "日", "", "", "本"]
BYTE_TOKENS = [2, 3, 4, 5, 7, 8, 9, 10, 11, 12]     # CHOICE_TOKENS' indices of byte tokens


def byte_tokens(names: list) -> list:
    """The names at the byte tokens of CHOICE's tokens."""
    return [names[i] for i in BYTE_TOKENS]
GENERATE = ("generate", str(STORIES), "--device", "cpu", "--max-model-len", "128", "--temperature", "0",
            "--max-tokens", "16", "--logprobs", "1")


@needs_stories
def test_generate_json_logprob_tokens_of_split_characters_as_llm_generate(capsys, llm):
    from minillm import SamplingParams, StructuredOutputsParams
    status, out, err = run_main(capsys, *GENERATE, "-p", "Once upon a time", "--choice", CHOICE, "--json")
    assert status == 0, err
    logprobs = json.loads(out)["outputs"][0]["logprobs"]
    # each byte token read "\ufffd", so the tokens did not spell the text
    assert [t["token"] for t in logprobs] == CHOICE_TOKENS
    assert [t["top_logprobs"][0]["token"] for t in logprobs] == CHOICE_TOKENS
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=1,
                            structured_outputs=StructuredOutputsParams(choice=[CHOICE]))
    completion = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0]
    decoded = [lp[tid].decoded_token for tid, lp in zip(completion.token_ids, completion.logprobs)]
    assert byte_tokens(decoded) == byte_tokens(CHOICE_TOKENS)


@needs_stories
def test_generate_prompt_logprob_tokens_of_split_characters_as_llm_generate(capsys, llm):
    from minillm import SamplingParams
    status, out, err = run_main(capsys, *GENERATE, "-p", CHOICE, "--max-tokens", "1", "--prompt-logprobs", "1",
                                "--json")
    assert status == 0, err
    record = json.loads(out)
    named = [None if e is None else e["token"] for e in record["prompt_logprobs"]]
    prompt = llm.generate([CHOICE], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    expected = [None if e is None else e[tid].decoded_token
                for tid, e in zip(prompt.prompt_token_ids, prompt.prompt_logprobs)]
    assert named == [None, " a", *CHOICE_TOKENS[1:]]      # after BOS, SentencePiece's "▁a"
    assert byte_tokens(named[1:]) == byte_tokens(expected[1:])


@needs_stories
def test_generate_plain_logprob_lines_name_split_characters_as_vllm(capsys):
    status, out, err = run_main(capsys, *GENERATE, "-p", "Once upon a time", "--choice", CHOICE)
    assert status == 0, err
    lines = out.splitlines()[2:]
    assert "\ufffd" not in out
    assert [line.split("   top:")[0].rsplit(None, 1)[0].strip() for line in lines] == [repr(t) for t in CHOICE_TOKENS]
