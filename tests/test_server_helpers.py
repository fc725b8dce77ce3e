"""Helpers the server test modules share: a real server on a free port, a chat-capable model copy."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from pathlib import Path

import httpx

from minillm.config import EngineConfig
from minillm.server.app import ServerOptions, ServerThread, create_app
from minillm.server.async_engine import AsyncLLMEngine

# Simple enough for the tiny model; BOS first, as stories260K was trained.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def chat_model_dir(src: Path, dst: Path) -> Path:
    """Copy a model directory and give its tokenizer_config.json a chat template."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file():
            shutil.copyfile(item, dst / item.name)
    config_path = dst / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return dst


@contextlib.contextmanager
def running_server(model: Path, api_key: str | None = None, served_model_name: str = "stories",
                   max_body_bytes: int | None = None, log_interval: float | None = None,
                   options: ServerOptions | None = None, **engine_kwargs):
    """Yield (base_url, AsyncLLMEngine) for a real server on 127.0.0.1; stop both afterwards.

    options: the server's options (limits, templates); api_key, served_model_name, max_body_bytes
    and log_interval override theirs.
    """
    options = dataclasses.replace(options or ServerOptions(), api_key=api_key, served_model_name=served_model_name,
                                  log_interval=log_interval)
    if max_body_bytes is not None:
        options = dataclasses.replace(options, limits=dataclasses.replace(options.limits,
                                                                          max_body_bytes=max_body_bytes))
    config = EngineConfig(model=str(model), device="cpu", **engine_kwargs)
    engine = AsyncLLMEngine.from_config(config)
    app = create_app(engine, options)
    server = ServerThread(app, "127.0.0.1", 0).start()
    try:
        yield server.url, engine
    finally:
        server.stop()
        engine.shutdown()


def get_stats(url: str, headers: dict | None = None) -> dict:
    """GET /v1/stats as a dict."""
    response = httpx.get(f"{url}/v1/stats", headers=headers or {}, timeout=10)
    response.raise_for_status()
    return response.json()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02):
    """Poll predicate() until it returns something truthy; return it (or the last value on timeout)."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


def sse_events(lines) -> list:
    """Parse `data: ...` lines into JSON objects, stopping at [DONE]."""
    events = []
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        events.append(json.loads(data))
    return events
