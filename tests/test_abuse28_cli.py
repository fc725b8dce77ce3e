"""serve's start-up values that ServerOptions checks, named as the flags they came from; an empty
served_model_name in the LLM API; an arrival_time of 0 in the async engines."""
from __future__ import annotations

import asyncio

import pytest
from test_abuse25_serving import async_llm, config, thread_engine  # noqa: F401 - the engines, as fixtures
from test_cli import STORIES, needs_stories, run_main

from minillm.engine import LLMEngine, check_arrival_time
from minillm.sampling_params import SamplingParams


def one_line(err: str) -> str:
    """The single line a failed command printed (asserting there is one, and no traceback)."""
    assert "Traceback" not in err, err
    [line] = err.strip().splitlines()
    return line


@pytest.fixture
def started(monkeypatch):
    """serve's run_server stubbed: what it was started with, once main() returns."""
    seen: dict = {}

    def fake_run_server(engine_config, host="127.0.0.1", port=8000, options=None, monitor=False, core_hook=None):
        seen.update(config=engine_config, options=options)
        return 0

    monkeypatch.setattr("minillm.server.app.run_server", fake_run_server)
    return seen


# ---- serve's start-up values ---------------------------------------------------------------------------

@needs_stories
@pytest.mark.parametrize("flags, flag", [
    (("--served-model-name", ""), "--served-model-name"),
    (("--served-model-name", "a", "--served-model-name", " "), "--served-model-name"),
    (("--root-path", "llm"), "--root-path"),
    (("--response-role", " "), "--response-role"),
    (("--api-key", ""), "--api-key"),
    (("--timeout-graceful-shutdown", "nan"), "--timeout-graceful-shutdown"),
    (("--timeout-graceful-shutdown", "0"), "--timeout-graceful-shutdown"),
    (("--timeout-graceful-shutdown", "inf"), "--timeout-graceful-shutdown"),
])
def test_serve_values_server_options_refuses_are_usage_errors_naming_the_flag(capsys, started, flags, flag):
    # They exited 1 naming the Python field (served_model_name must be ...), where every other bad
    # flag is a usage error (status 2) naming the flag as typed.
    status, out, err = run_main(capsys, "serve", str(STORIES), "--device", "cpu", "--port", "0", *flags)
    assert (status, out, started) == (2, "", {})
    line = one_line(err)
    assert f"Invalid value for '{flag}'" in line, line
    assert flag.lstrip("-").replace("-", "_") not in line, line


# ---- LLM(served_model_name=...) ------------------------------------------------------------------------

@pytest.mark.parametrize("names", ["", " ", ["stories", ""], ["\t"]])
def test_an_empty_served_model_name_is_a_value_error_as_the_server_makes_it(stories_path, names):
    # LLM(served_model_name="") was taken (as the model's name) where ServerOptions refuses it.
    from minillm import LLM
    from minillm.server.app import ServerOptions
    with pytest.raises(ValueError, match="served_model_name"):
        ServerOptions(served_model_name=names)
    with pytest.raises(ValueError) as info:
        LLM(str(stories_path), device="cpu", served_model_name=names)
    assert str(info.value).startswith("served_model_name must be"), info.value
    assert repr(names) in str(info.value), info.value


# ---- arrival_time in the async engines -----------------------------------------------------------------

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


async def _last_output(engine, request_id: str, arrival_time):
    outputs = [out async for out in engine.generate("Once", ONE_TOKEN, request_id, arrival_time=arrival_time)]
    return outputs[-1]


@pytest.mark.parametrize("engine_name", ["async_llm", "thread_engine"])
@pytest.mark.parametrize("arrival_time", [0, 0.0, 1.5])
def test_an_arrival_time_is_kept_as_the_offline_engine_keeps_it(request, config, engine_name,  # noqa: F811
                                                                 arrival_time):
    # `arrival_time or time.time()` replaced 0 by the clock, where LLMEngine keeps it.
    offline = LLMEngine(config, log=lambda _: None)
    try:
        offline.add_request("offline", "Once", ONE_TOKEN, arrival_time=arrival_time)
        [want] = offline.step()
    finally:
        offline.shutdown()
    engine = request.getfixturevalue(engine_name)
    got = asyncio.run(_last_output(engine, f"arrival-{engine_name}-{arrival_time}", arrival_time))
    assert got.finished and got.metrics.arrival_time == want.metrics.arrival_time == arrival_time


@pytest.mark.parametrize("engine_name", ["async_llm", "thread_engine"])
@pytest.mark.parametrize("arrival_time", [False, True, float("nan"), "0"])
def test_an_arrival_time_no_engine_takes_is_refused_as_the_offline_engine_refuses_it(request, engine_name,
                                                                                       arrival_time):
    engine = request.getfixturevalue(engine_name)
    with pytest.raises(ValueError) as info:
        asyncio.run(_last_output(engine, f"bad-arrival-{engine_name}", arrival_time))
    with pytest.raises(ValueError) as offline:
        check_arrival_time(arrival_time)
    assert str(info.value) == str(offline.value)
