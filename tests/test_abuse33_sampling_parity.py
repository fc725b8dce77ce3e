"""SamplingParams and LLM.generate take what vLLM's take, and the sampler carries it safely: logit
biases of any size (a ban by -1e9 or -inf, a forced token by 1e9 or inf), an infinite logit under
every sampling rule, priorities as any sequence of integers. stories260K on the CPU."""
import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.ops import numpy as npops

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm(stories_path):
    with LLM(str(stories_path), device="cpu", max_model_len=128, scheduling_policy="priority") as model:
        yield model


def gen(llm, **kw):
    return llm.generate([PROMPT], SamplingParams(**kw), use_tqdm=False)[0].outputs[0].token_ids


def test_the_numpy_sampler_takes_an_infinite_logit_under_every_rule():
    logits = np.zeros((1, 64), np.float32)
    logits[0, 7], logits[0, 40] = 3.0, np.inf
    for temperature, top_k, top_p, min_p in [(1.0, 0, 1.0, 0.0), (1.0, 3, 1.0, 0.0), (1.0, 0, 0.9, 0.0),
                                             (1.0, 0, 1.0, 0.1), (0.5, 0, 0.9, 0.1), (0.5, 3, 0.9, 0.1)]:
        for u in (0.0, 0.5, 0.999):
            ids = npops.sample(logits.copy(), np.float32([temperature]), np.int32([top_k]), np.float32([top_p]),
                               np.float32([min_p]), np.float32([u]))
            assert ids.tolist() == [40], (temperature, top_k, top_p, min_p, u)
    # a finite logit that the temperature scales past float32's range is the same
    logits[0, 40] = 3e38
    ids = npops.sample(logits, np.float32([0.1]), np.int32([0]), np.float32([0.9]), np.float32([0.1]),
                       np.float32([0.5]))
    assert ids.tolist() == [40]


def test_a_repetition_penalty_that_scales_a_logit_past_float32_samples_under_top_p_and_min_p(llm):
    """repetition_penalty 1.2e-38 (taken: float32's smallest normal) divides a repeated token's positive
    logit into inf; under top_p with min_p the NumPy sampler then raised inside the engine's step."""
    out = gen(llm, temperature=0.5, top_p=0.9, min_p=0.1, repetition_penalty=1.2e-38, seed=1, max_tokens=8,
              ignore_eos=True)
    assert len(out) == 8
