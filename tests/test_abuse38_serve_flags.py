"""vLLM serve flags an operator brings to `minillm serve`: --config (a YAML file of flags) and
--middleware (the operator's ASGI middleware). The command line is parsed in this process (the
server's start stubbed); the middleware's effect is seen on one real server."""
from __future__ import annotations

import httpx
import pytest
from starlette.middleware.base import BaseHTTPMiddleware
from test_abuse22_api_cli import started  # noqa: F401  (serve with run_server stubbed)
from test_cli import STORIES, needs_stories, run_main
from test_serve_vllm_flags import serve
from test_server_helpers import running_server

from minillm.server.app import ServerOptions

HERE = __name__       # the middleware below, by import path (tests/ is on sys.path)


class TagMiddleware(BaseHTTPMiddleware):
    """Marks every response: a class, added by app.add_middleware."""

    async def dispatch(self, request, call_next):
        response = await call_next(request)
        response.headers["x-tag"] = "class"
        return response


async def tag_function(request, call_next):
    """Marks every response: an async function, added as an http middleware."""
    response = await call_next(request)
    response.headers["x-fn"] = "function"
    return response


def not_async(request, call_next):
    return call_next(request)




# ---- --config -------------------------------------------------------------------------------------

def _yaml(tmp_path, text: str, name: str = "serve.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@needs_stories
def test_a_config_file_sets_the_flags_as_vllms_does(capsys, started, tmp_path):
    config = _yaml(tmp_path, "max_model_len: 0.25k\nenable-prefix-caching: false\nserved-model-name: [a, b]\n"
                             "allowed-origins: ['https://app.example']\nseed: 7\ndisable-log-stats: true\n"
                             "enforce-eager: false\noverride-generation-config: {temperature: 0.5}\n")
    assert serve(capsys, "--config", config) == (0, "")
    engine, options = started["config"], started["options"]
    assert (engine.max_model_len, engine.enable_prefix_caching, engine.seed) == (250, False, 7)
    assert engine.override_generation_config == {"temperature": 0.5}
    assert options.served_model_name == ("a", "b")
    assert options.allowed_origins == ("https://app.example",)
    assert options.log_interval is None


@needs_stories
def test_the_command_line_wins_over_the_config_file(capsys, started, tmp_path):
    config = _yaml(tmp_path, "max-model-len: 128\nserved-model-name: [a, b]\nenable-prefix-caching: false\n")
    flags = ("--max-model-len", "64", "--served-model-name", "z", "--enable-prefix-caching")
    assert serve(capsys, f"--config={config}", *flags) == (0, "")
    assert (started["config"].max_model_len, started["config"].enable_prefix_caching) == (64, True)
    assert started["options"].served_model_name == ("z",)


@needs_stories
def test_the_model_may_come_from_the_config_file(capsys, started, tmp_path):
    config = _yaml(tmp_path, f"model: {STORIES}\ndevice: cpu\n")
    assert run_main(capsys, "serve", "--config", config)[0] == 0
    assert started["config"].model == str(STORIES)


CONFIG_ERRORS = [
    ("quantization: awq\n", "quantization is not taken: minillm runs unquantized weights only"),
    ("frobnicate: 1\n", "'frobnicate' is no option of this command"),
    ("enforce-eager: yes please\n", "enforce-eager is a switch: give true or false, got 'yes please'"),
    ("port:\n", "port has no value"),
    ("[1, 2]\n", "must be a mapping of option names to values"),
    ("a: [\n", "not valid YAML"),
]


@needs_stories
@pytest.mark.parametrize("text, message", CONFIG_ERRORS)
def test_a_bad_config_file_is_one_usage_line_naming_it(capsys, started, tmp_path, text, message):
    config = _yaml(tmp_path, text)
    status, err = serve(capsys, "--config", config)
    assert (status, started) == (2, {})
    assert err.count("\n") == 1 and f"error: --config {config}: {message}" in err


@needs_stories
@pytest.mark.parametrize("flags, message", [
    (("--config",), "--config needs a YAML file of options"),
    (("--config", "/nonexistent/serve.yaml"), "--config /nonexistent/serve.yaml: no such file"),
    (("--config", "serve.json"), "--config serve.json: must be a YAML file (.yaml or .yml)"),
    (("--config", "a.yaml", "--config", "b.yaml"), "--config is given 2 times; give one file"),
])
def test_a_config_flag_that_names_no_yaml_file_is_one_usage_line(capsys, started, flags, message):
    status, err = serve(capsys, *flags)
    assert (status, started) == (2, {})
    assert err.count("\n") == 1 and f"error: {message}" in err


@needs_stories
def test_a_bad_value_in_the_config_file_is_the_flags_usage_error(capsys, started, tmp_path):
    status, err = serve(capsys, "--config", _yaml(tmp_path, "max-model-len: 0\n"))
    assert (status, started) == (2, {})
    assert "Invalid value for '--max-model-len': must be >= 1, got 0" in err


# ---- --middleware ---------------------------------------------------------------------------------

@needs_stories
def test_middleware_paths_reach_the_server_options(capsys, started):
    flags = ("--middleware", f"{HERE}.TagMiddleware", "--middleware", f"{HERE}.tag_function")
    assert serve(capsys, *flags) == (0, "")
    assert started["options"].middleware == (f"{HERE}.TagMiddleware", f"{HERE}.tag_function")


@needs_stories
@pytest.mark.parametrize("path, message", [
    ("nosuchmodule_abuse38.Check", "'nosuchmodule_abuse38.Check': importing nosuchmodule_abuse38 failed: "
                                   "ModuleNotFoundError"),
    (f"{HERE}.Missing", f"'{HERE}.Missing': module {HERE} has no Missing"),
    (f"{HERE}.not_async", f"'{HERE}.not_async' must be a class or an async function, got a function that is "
                          "not async"),
    (f"{HERE}.HERE", f"'{HERE}.HERE' must be a class or an async function, got a str"),
    ("Check", "must be an import path such as mypackage.auth.MyMiddleware, got 'Check'"),
])
def test_a_bad_middleware_is_a_usage_error_before_loading(capsys, started, path, message):
    status, err = serve(capsys, "--middleware", path)
    assert (status, started) == (2, {})
    assert err.count("\n") == 1 and f"Invalid value for '--middleware': {message}" in err


@pytest.fixture(scope="module")
def server(stories_path):
    """stories260K served with both middleware and an API key."""
    options = ServerOptions(middleware=(f"{HERE}.TagMiddleware", f"{HERE}.tag_function"))
    with running_server(stories_path, api_key="sk-38", options=options, max_num_seqs=2) as running:
        yield running


def test_the_middleware_runs_on_every_response_outside_the_key_check(server):
    with httpx.Client(base_url=server[0], timeout=60) as http:
        served = http.get("/v1/models", headers={"Authorization": "Bearer sk-38"})
        refused = http.get("/v1/models")
    assert served.status_code == 200 and refused.status_code == 401     # vLLM adds it last: it runs first
    for response in (served, refused):
        assert (response.headers["x-tag"], response.headers["x-fn"]) == ("class", "function")
