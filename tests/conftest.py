"""Shared fixtures: the stories260K model path and tiny Hugging Face models built on the fly."""
import functools
import os
import signal
from pathlib import Path

import pytest
from hypothesis import settings

# One BLAS thread in the test process and in every process it starts (set before NumPy is imported;
# a value given outside wins): the models here are tiny, and OpenBLAS's second thread spun on the
# other core for no gain (the engine tests took 61 s of CPU, 35 s with one thread, and less wall
# time), taking it from the subprocesses and background builds that run beside them.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# Ctrl-C's handler back where the run was started with SIGINT ignored (a background job of a shell
# without job control, nohup, some CI runners): the programs the tests start inherit an ignored
# SIGINT, and the tests that send them one would wait in vain.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Property tests draw the same examples on every run, so a red run is the code's doing and can be
# run again; MINILLM_HYPOTHESIS=explore draws new ones (what to run locally to hunt for bugs).
settings.register_profile("deterministic", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("MINILLM_HYPOTHESIS", "deterministic"))

REPO = Path(__file__).resolve().parents[1]
STORIES = Path(os.environ.get("MINILLM_TEST_MODEL", REPO.parent / "shared" / "models" / "stories260K"))


@pytest.fixture(scope="session")
def stories_path() -> Path:
    """The trained stories260K model directory (golden-text tests skip without it)."""
    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260K not found at {STORIES}; set MINILLM_TEST_MODEL")
    return STORIES


@pytest.fixture(scope="module")
def tok(stories_path):
    """stories260K's tokenizer (a module may define its own)."""
    from minillm.tokenizer import Tokenizer
    return Tokenizer.from_pretrained(stories_path)


@pytest.fixture(scope="module")
def llm(stories_path):
    """One stories260K LLM on the CPU for the module, max_model_len 128 (a module may define its own)."""
    from minillm import LLM
    with LLM(str(stories_path), device="cpu", max_model_len=128) as model:
        yield model


@pytest.fixture(scope="module")
def http(server):
    """One HTTP client for the module's server (the module defines `server`, yielding (url, engine)):
    building a client per request costs more than the request."""
    import httpx
    with httpx.Client(base_url=server[0], timeout=60) as client:
        yield client


@pytest.fixture
def healthy_stream(healthy):
    """A greedy stream in flight for the whole test (the module defines `healthy`, its
    HealthyStreams); the streams are checked when the module ends."""
    with healthy.in_flight():
        yield


@pytest.fixture(scope="session", autouse=True)
def one_tls_context_for_every_httpx_client():
    """httpx builds a TLS context from certifi's bundle for every client (about 25 ms of CPU), even
    for http:// URLs, and the server tests make hundreds (each httpx.get, post or stream is a client
    of its own, and wait_for polls with them): the first context made for each set of arguments
    serves every later client in this process. Plain HTTP never uses it."""
    from httpx._transports import default
    original = default.create_ssl_context
    cached = functools.lru_cache(maxsize=None)(original)

    def create_ssl_context(*args, **kwargs):
        try:
            return cached(*args, **kwargs)
        except TypeError:                     # an unhashable argument: build one as httpx does
            return original(*args, **kwargs)

    default.create_ssl_context = create_ssl_context
    yield
    default.create_ssl_context = original


def save_tiny_model(out_dir: Path, arch: str, dtype: str = "float32", **overrides) -> Path:
    """A tiny random HF model of one family (needs torch), vocabulary 512 unless overridden."""
    from make_fixtures import save_tiny_model as save
    return save(out_dir, arch, dtype, **{"vocab_size": 512, **overrides})


@pytest.fixture(scope="session")
def eos_model_path(stories_path, tmp_path_factory) -> Path:
    """stories260K with a second EOS id: its stories end on token 1, which then stops generation."""
    out = tmp_path_factory.mktemp("stories_eos")
    for f in stories_path.iterdir():
        if f.name != "generation_config.json":
            (out / f.name).symlink_to(f)
    (out / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": [2, 1]}')
    return out


def put_in_hf_cache(cache: Path, repo_id: str, files_from: Path, revision: str = "0123abcd") -> Path:
    """Lay a model out as huggingface_hub does (blobs, a snapshot of links, refs/main); the snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in sorted(files_from.iterdir()):
        blob = repo / "blobs" / f"blob-{f.name}"
        blob.write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def pytest_collection_finish(session) -> None:
    """Start the background work of the selected test modules (a module's start_in_background(its
    selected tests)), so that it runs beside the tests before them. Not for --collect-only, nor under
    pytest-xdist, whose every worker collects every module: the module's fixture starts it there."""
    if os.environ.get("PYTEST_XDIST_WORKER") or session.config.option.collectonly:
        return
    selected: dict = {}
    for item in session.items:
        if isinstance(item, pytest.Function):
            selected.setdefault(item.module, []).append(item)
    for module, items in selected.items():
        start = getattr(module, "start_in_background", None)
        if start is not None:
            start(items)


def pytest_sessionfinish(session) -> None:
    """Stop what pytest_collection_finish started, whether or not its tests ran."""
    for module in {item.module for item in getattr(session, "items", []) if isinstance(item, pytest.Function)}:
        stop = getattr(module, "stop_background", None)
        if stop is not None:
            stop()
