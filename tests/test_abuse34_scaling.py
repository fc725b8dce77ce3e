"""Host-side costs that must grow with what a request holds, not with its square: a DELTA output of
a long completion copies only its new token ids each step (it copied all of them, so the per-token
cost of a stream grew with the output), in the engine and in the API server's output processing.
Counted in token ids copied, never timed."""
from __future__ import annotations

import itertools

import pytest

from minillm.engine_core import messages as m
from minillm.engine_core.output_processor import OutputProcessor
from minillm.output_processor import add_token, completion_output, new_state
from minillm.sampling_params import RequestOutputKind, SamplingParams
from minillm.sequence import Sequence, SequenceStatus

NUM_TOKENS = 1500


class CountingIds(list):
    """A token-id list that counts the ids copied out of it by slices and iteration."""

    num_copied = 0

    def __getitem__(self, index):
        item = super().__getitem__(index)
        if isinstance(index, slice):
            self.num_copied += len(item)
        return item

    def __iter__(self):
        self.num_copied += len(self)
        return super().__iter__()


def story_ids(tok, count: int) -> list[int]:
    """count ids of ordinary text (repeated as needed)."""
    ids = tok.encode("Once upon a time, there was a little girl named Lily. She liked to play outside. ",
                     add_special_tokens=False)
    return list(itertools.islice(itertools.cycle(ids), count))


def delta_params(**kwargs) -> SamplingParams:
    params = SamplingParams(max_tokens=NUM_TOKENS, output_kind=RequestOutputKind.DELTA, **kwargs)
    params.validate()
    return params


@pytest.mark.parametrize("stop", [None, ["a stop string that never comes"]])
def test_engine_delta_outputs_copy_only_new_token_ids(tok, stop):
    prompt = tok.encode("Once upon a time")
    seq = Sequence("r", 0, prompt, delta_params(stop=stop), 0.0, None, NUM_TOKENS)
    seq.token_ids = CountingIds(seq.token_ids)
    state = new_state(tok, seq, incremental=True, delta=True)
    ids, text = story_ids(tok, NUM_TOKENS), []
    for i, token in enumerate(ids):
        seq.token_ids.append(token)
        if i == len(ids) - 1:
            seq.status = SequenceStatus.FINISHED_LENGTH
        else:
            seq.status = SequenceStatus.RUNNING
        add_token(state, seq, token, None)
        out = completion_output(state, seq)
        assert out.token_ids == [token]
        text.append(out.text)
    assert "".join(text) == tok.decode(prompt + ids)[len(tok.decode(prompt)):]
    # all of them every step was NUM_TOKENS ** 2 / 2 (1.1 million here)
    assert seq.token_ids.num_copied <= 4 * NUM_TOKENS


def test_api_server_delta_outputs_copy_only_new_token_ids(tok):
    proc = OutputProcessor(tok)
    proc.add("r", None, tok.encode("Once upon a time"), delta_params(), 0.0, handle=object())
    mirror = proc.requests["r"].seqs[0]
    mirror.token_ids = CountingIds()
    ids, received = story_ids(tok, NUM_TOKENS), []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        seq = m.SeqOutput(0, [token], finish_reason="length" if last else None)
        done = proc.process(m.StepOutputs(i, 0.0, [m.RequestStepOutput("r", [seq], last, 0, None, None, None)]), 0.0)
        received.extend(out.outputs[0].token_ids for _, out in done.outputs)
    assert received == [[token] for token in ids]
    assert mirror.token_ids.num_copied <= 4 * NUM_TOKENS
