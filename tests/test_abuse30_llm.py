"""vLLM offline scripts against LLM and SamplingParams: an interrupted or re-entered generate()
leaves the LLM usable, and NumPy booleans are taken where SamplingParams wants a bool."""
import threading

import numpy as np
import pytest

from minillm import LLM, SamplingParams

SAMPLED = SamplingParams(temperature=0.8, seed=5, max_tokens=12)
PROMPTS = ["Once upon a time there was a girl named Lily who liked", "The dog", "Lily liked to"]


@pytest.fixture(scope="module")
def expected(llm):
    """The texts of PROMPTS under SAMPLED, generated plainly."""
    return [out.outputs[0].text for out in llm.generate(PROMPTS, SAMPLED)]


class StepLimitExceeded(BaseException):
    """Raised past a bound on engine steps: what a drain that never ends would do."""


def _bounded_steps(engine, limit: int):
    """Wrap engine.step to raise StepLimitExceeded after `limit` calls; returns the undo."""
    real, calls = engine.step, [0]

    def step():
        calls[0] += 1
        if calls[0] > limit:
            raise StepLimitExceeded(f"engine.step() called {calls[0]} times")
        return real()

    engine.step = step
    return lambda: vars(engine).pop("step", None)


def test_an_interrupt_while_the_outputs_are_made_leaves_generate_usable(llm, expected):
    """Ctrl-C while a step turned finished requests into outputs (here: the detokenizer, as a hook)
    left them finished and never reported; generate's clean-up then stepped the engine for ever,
    so the interrupted call hung instead of raising KeyboardInterrupt."""
    tokenizer = llm.engine.tokenizer
    real_decode = tokenizer.decode_raw       # what the detokenizer calls

    def decode(*args, **kwargs):
        raise KeyboardInterrupt

    tokenizer.decode_raw = decode
    undo_steps = _bounded_steps(llm.engine, 200)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, SAMPLED)
    finally:
        undo_steps()
        vars(tokenizer).pop("decode_raw", None)
    assert tokenizer.decode_raw == real_decode
    assert [out.outputs[0].text for out in llm.generate(PROMPTS, SAMPLED)] == expected


@pytest.mark.parametrize("where", ["launch", "update_from_output"])
def test_an_interrupt_inside_a_step_leaves_generate_usable(llm, expected, where):
    """KeyboardInterrupt from inside the engine's step (a hook on the runner or the scheduler)."""
    owner = llm.engine.runner if where == "launch" else llm.engine.scheduler
    real, calls = getattr(owner, where), [0]

    def hooked(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    setattr(owner, where, hooked)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, SAMPLED)
    finally:
        vars(owner).pop(where, None)
    assert not llm.engine.get_num_unfinished_requests()
    assert [out.outputs[0].text for out in llm.generate(PROMPTS, SAMPLED)] == expected


def test_an_interrupt_while_a_request_is_queued_leaves_generate_usable(llm, expected):
    """Ctrl-C inside engine.add_request, after the request was registered and before all its n
    sequences were queued: generate did not abort that request (only those already added), which
    never finished, so the clean-up stepped for ever."""
    scheduler = llm.engine.scheduler
    real, calls = scheduler.add, [0]

    def add(seq):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return real(seq)

    scheduler.add = add
    undo_steps = _bounded_steps(llm.engine, 200)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, SamplingParams(n=2, seed=1, max_tokens=4))
    finally:
        undo_steps()
        vars(scheduler).pop("add", None)
    assert not llm.engine.get_num_unfinished_requests()
    assert [out.outputs[0].text for out in llm.generate(PROMPTS, SAMPLED)] == expected


def _run_in_thread(fn):
    """fn() on a thread; its result or exception (a deadlock fails the test instead of hanging it)."""
    result = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as exc:       # noqa: BLE001 - handed back to the test
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the call deadlocked"
    return result


@pytest.mark.parametrize("inner", ["generate", "chat", "reset_prefix_cache"])
def test_generate_called_again_from_its_own_progress_bar_is_refused_not_deadlocked(llm, expected, inner):
    """A use_tqdm callable whose update() calls back into the same LLM waited for ever on the
    lock its own generate() held; it is a RuntimeError that says why, and the outer call finishes."""
    calls = {
        "generate": lambda: llm.generate("Once", SAMPLED),
        "chat": lambda: llm.chat([{"role": "user", "content": "Hi"}], SAMPLED,
                                 chat_template="{{ messages[0]['content'] }}"),
        "reset_prefix_cache": llm.reset_prefix_cache,
    }
    seen = []

    class Bar:
        def __init__(self, total, **kwargs):
            pass

        def update(self, n):
            try:
                calls[inner]()
            except RuntimeError as exc:
                seen.append(str(exc))

        def close(self):
            pass

    result = _run_in_thread(lambda: llm.generate(PROMPTS, SAMPLED, use_tqdm=Bar))
    assert "error" not in result, result.get("error")
    assert [out.outputs[0].text for out in result["value"]] == expected
    assert len(seen) == len(PROMPTS)
    assert f"LLM.{inner}() was called while this thread's generate() runs" in seen[0]


def test_generate_from_two_threads_still_runs_one_after_the_other(llm, expected):
    """The same-thread refusal does not refuse a second thread: it waits for the first."""
    started, release = threading.Event(), threading.Event()

    class Bar:
        def __init__(self, total, **kwargs):
            pass

        def update(self, n):
            started.set()
            release.wait()

        def close(self):
            pass

    first = threading.Thread(target=lambda: llm.generate(PROMPTS, SAMPLED, use_tqdm=Bar), daemon=True)
    first.start()
    started.wait()
    second = {}
    worker = threading.Thread(target=lambda: second.update(out=llm.generate(PROMPTS, SAMPLED)), daemon=True)
    worker.start()
    release.set()
    first.join()
    worker.join()
    assert [out.outputs[0].text for out in second["out"]] == expected


@pytest.mark.parametrize("name", ["ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                                  "detokenize", "spaces_between_special_tokens"])
def test_numpy_booleans_are_taken_as_bools(name):
    """NumPy integers and floats were taken as Python's, but np.bool_ (a mask's element, a pandas
    column's) was refused as "must be true or false"."""
    for value in (np.True_, np.False_):
        params = SamplingParams(**{name: value})
        assert getattr(params, name) is bool(value)


def test_numpy_true_asks_for_one_logprob_as_true_does(llm):
    """vLLM takes logprobs=True as 1; np.True_ was refused."""
    params = SamplingParams(logprobs=np.True_, prompt_logprobs=np.True_, max_tokens=2)
    assert (params.logprobs, params.prompt_logprobs) == (1, 1)
    with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\], got False"):
        SamplingParams(logprobs=np.False_)      # as False is
    out = llm.generate("Once", params)[0]
    assert all(1 <= len(entry) <= 2 for entry in out.outputs[0].logprobs)


def test_dtype_takes_a_torch_dtype_as_vllm_does(stories_path):
    """vLLM's LLM(dtype=torch.float32): a torch.dtype was refused as "dtype must be auto, float32
    (float), float16 (half) or bfloat16, got torch.float32"; it is taken by its name."""
    torch = pytest.importorskip("torch")
    with LLM(str(stories_path), device="cpu", max_model_len=64, dtype=torch.float32) as model:
        assert model.engine.config.dtype == "float32"
        assert model.generate("Once", SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="got 'float64'"):
        LLM(str(stories_path), device="cpu", dtype=torch.float64)
