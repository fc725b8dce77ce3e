"""Sampling rules that leave a row no token to sample, on stories260K (CPU).

A row whose every logit is -inf samples id 0: allowed_token_ids all banned by bad_words, or by
min_tokens (its ban of EOS and stop tokens), went on emitting token 0 as if the model had chosen
it. Rules that leave the first token nothing are refused where the request enters; rules that do
so later end the request with finish_reason "error" before that token.
"""
from __future__ import annotations

import pytest
from test_server_helpers import chat_template_server, sse_events, story_streams  # noqa: F401 (server, healthy)
from test_step_pipeline import _decoding_with_a_match
from test_step_pipeline import create_scheduler as create_spec_scheduler

from minillm import LLM, SamplingParams, StructuredOutputsParams
from minillm.sampling_params import RequestOutputKind
from minillm.sequence import SequenceStatus
from minillm.step import StepOutput

PROMPT = "Once upon a time"
EOS = 2
A, B = 261, 268                 # "a" and "b"; "a a" is [A, A]
HEALTHY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=[False, True], ids=["one-step", "async"])
def llm(request, stories_path):
    """The engine as on the CPU, and with step t+1 launched before step t is read (as on the GPU)."""
    with LLM(str(stories_path), device="cpu", max_num_seqs=8, async_scheduling=request.param) as engine:
        yield engine


def healthy_alone(llm) -> list[int]:
    return llm.generate([PROMPT], HEALTHY)[0].outputs[0].token_ids


@pytest.mark.parametrize("kwargs, rules", [
    (dict(allowed_token_ids=[265], bad_words=["the"]), "but bad_words ban all of them"),
    (dict(allowed_token_ids=[EOS], min_tokens=2), "but min_tokens=2 (which bans EOS and stop_token_ids"),
    (dict(allowed_token_ids=[EOS], min_tokens=1, ignore_eos=True), "but min_tokens=1"),
    (dict(allowed_token_ids=[100, 101], stop_token_ids=[100, 101], min_tokens=3), "but min_tokens=3"),
    (dict(allowed_token_ids=[EOS, 265], bad_words=["the"], min_tokens=1), "but bad_words and min_tokens=1"),
])
def test_rules_that_leave_the_first_token_nothing_are_refused_naming_allowed_token_ids(llm, kwargs, rules):
    # Each sampled id 0 at every step below min_tokens (at every step of the first), and returned it
    # as output: [0, 0, 0, 0, 0, 0], [0, 0, 2].
    with pytest.raises(ValueError, match=r"^allowed_token_ids must hold a token the first output token may take") \
            as info:
        llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, **kwargs))
    assert rules in str(info.value)
    assert not llm.llm_engine.has_unfinished_requests()


def test_stop_tokens_that_cover_the_vocabulary_under_min_tokens_are_refused_naming_min_tokens(llm):
    params = SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=[t for t in range(512) if t != EOS])
    with pytest.raises(ValueError, match=r"^min_tokens must leave a token the first output token may take, but "
                                         r"min_tokens=1 \(which bans EOS and stop_token_ids until then\) ban every"):
        llm.generate([PROMPT], params)


def test_rules_that_leave_a_token_are_taken(llm):
    # EOS and "a" allowed, EOS banned for two tokens: "a" twice, then whatever the model prefers.
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2,
                                                allowed_token_ids=[EOS, A]))[0].outputs[0]
    assert out.token_ids[:2] == [A, A] and set(out.token_ids) <= {EOS, A} and out.finish_reason != "error"
    # A grammar whose one sentence is empty lifts min_tokens' ban of EOS: allowing only EOS is no conflict.
    empty = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=3, allowed_token_ids=[EOS],
                           structured_outputs=StructuredOutputsParams(regex=""))
    out = llm.generate([PROMPT], empty)[0].outputs[0]
    assert (out.finish_reason, out.text) == ("stop", ""), out.stop_reason


def test_a_bias_of_minus_100_on_every_allowed_token_masks_none_of_them(llm):
    # logit_bias adds to the logits (at most -100, as vLLM clamps it): the allowed tokens stay finite
    # and are sampled as their logits less 100 weigh them.
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, allowed_token_ids=[100, 101],
                            logit_bias={100: -100.0, 101: -100.0})
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert len(out.token_ids) == 12 and set(out.token_ids) <= {100, 101} and out.finish_reason == "length"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_bad_word_that_bans_every_allowed_token_mid_output_ends_the_request_with_an_error(llm, temperature):
    # "a" is the only token allowed and "a a" a bad word: the second row has nothing left. It
    # sampled id 0, then "a" again, and so on: [261, 0, 261, 0, 261, 0], finish_reason "length".
    alone = healthy_alone(llm)
    masked = SamplingParams(temperature=temperature, seed=1, max_tokens=6, allowed_token_ids=[A], bad_words=["a a"])
    healthy, out = (o.outputs[0] for o in llm.generate([PROMPT, PROMPT], [HEALTHY, masked]))
    assert healthy.token_ids == alone
    assert (out.token_ids, out.text, out.finish_reason) == ([A], " a", "error")
    assert out.stop_reason == ("allowed_token_ids: no allowed token is left to sample after 1 output token: "
                               "bad_words ban all of them; the output stops there")
    assert not llm.llm_engine.has_unfinished_requests()


def test_min_tokens_and_a_bad_word_that_leave_nothing_later_are_both_named(llm):
    # EOS and "a" allowed: "a" first (EOS is banned below min_tokens), then "a a" bans "a" and EOS is
    # still banned. It sampled id 0 until min_tokens was reached.
    alone = healthy_alone(llm)
    masked = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4, allowed_token_ids=[EOS, A], bad_words=["a a"])
    healthy, out = (o.outputs[0] for o in llm.generate([PROMPT, PROMPT], [HEALTHY, masked]))
    assert healthy.token_ids == alone
    assert (out.token_ids, out.finish_reason) == ([A], "error")
    assert "after 1 output token: bad_words and min_tokens=4 (which bans EOS and stop_token_ids until then) ban all " \
        "of them" in out.stop_reason


def test_a_delta_request_that_ends_with_no_token_is_reported(llm):
    # The request ends on a step that appends nothing to it: its last report is that end alone.
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=6, allowed_token_ids=[A], bad_words=["a a"],
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("masked", PROMPT, params)
    reports = []
    while engine.has_unfinished_requests():
        reports += [o for o in engine.step() if o.request_id == "masked"]
    assert [c.token_ids for o in reports for c in o.outputs] == [[A], []]
    assert reports[-1].finished and reports[-1].outputs[0].finish_reason == "error"


class _Tokenizer:
    """The table tokenizer bad words need: "a a" is [5, 5]."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return {"a a": [5, 5], " a a": [4, 5, 5]}[text]

    def __len__(self) -> int:
        return 64


def test_a_verified_draft_whose_row_had_nothing_left_is_dropped_with_the_tokens_after_it():
    # Drafts [5, 6, 7] are verified; the row after an accepted 5 has nothing left ("a a" bans 5, the
    # only token allowed) and samples id 0: the 5 is kept, the 0 is no sample and ends the sequence.
    sched = create_spec_scheduler(num_blocks=8, block_size=4, spec_k=3)
    seq = _decoding_with_a_match(sched, first=8, allowed_token_ids=[5], bad_words=["a a"])
    seq.params.update_from_tokenizer(_Tokenizer(), 64)
    seq.params.check_masks([0], 64)
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {seq.seq_id: [5, 6, 7]}
    appended = sched.update_from_output(out, StepOutput({seq.seq_id: [5, 0]}, num_accepted_tokens={seq.seq_id: 1}))
    assert [t for _, t in appended] == [5] and seq.output_token_ids == [8, 5]
    assert seq.status is SequenceStatus.FINISHED_ERROR and sched.masked_out == [seq]
    assert seq.stop_reason.startswith("allowed_token_ids: no allowed token is left to sample after 2 output tokens")
    assert sched.block_manager.num_used_blocks == 0


def test_rules_whose_bans_cannot_cover_the_allowed_tokens_are_not_checked_token_by_token():
    params = SamplingParams(allowed_token_ids=[5, 6], bad_words=["a a"], min_tokens=2)
    params.update_from_tokenizer(_Tokenizer(), 64)
    params.check_masks([0], 64)
    assert params._masked_row_check is None                  # 6 is never banned
    params = SamplingParams(allowed_token_ids=[5, 0], bad_words=["a a"], min_tokens=2)
    params.update_from_tokenizer(_Tokenizer(), 64)
    params.check_masks([0], 64)
    assert params._masked_row_check is not None              # 5 by the bad word, EOS by min_tokens


# ---- the API server ----------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
@pytest.mark.parametrize("rules", [dict(allowed_token_ids=[265], bad_words=["the"]),
                                   dict(allowed_token_ids=[EOS], min_tokens=2)])
def test_the_server_refuses_rules_that_leave_the_first_token_nothing_with_a_400_naming_allowed_token_ids(
        http, healthy_stream, path, body, rules):
    reply = http.post(path, json={"model": "stories", "max_tokens": 6, **body, **rules})
    assert reply.status_code == 400, reply.text[:500]
    error = reply.json()["error"]
    assert error["param"] == "allowed_token_ids"
    assert error["message"].startswith("allowed_token_ids must hold a token the first output token may take")


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_ends_a_completion_left_nothing_mid_output_with_finish_reason_error(http, healthy_stream, stream):
    body = {"model": "stories", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "allowed_token_ids": [A],
            "bad_words": ["a a"], "stream": stream}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text[:500]
    choices = [c for e in sse_events(reply.text.splitlines()) for c in e["choices"]] if stream \
        else reply.json()["choices"]
    assert "".join(c["text"] for c in choices) == " a"
    assert choices[-1]["finish_reason"] == "error"
    assert choices[-1]["stop_reason"].startswith("allowed_token_ids: no allowed token is left to sample")
    if not stream:
        assert reply.json()["usage"]["completion_tokens"] == 1
