"""Hand-crafted kv_transfer_params sent straight to a decode server: an address that can never answer
is the client's 400 at once."""
from __future__ import annotations

import httpx
import pytest
from test_server_helpers import openai_error, running_server

from minillm.kv_connector.lease import prompt_hash

MODEL = "stories"
IDS = [1, 403, 411, 263, 358, 282, 281, 431, 266, 275, 268, 369, 301, 291, 358, 392, 300, 31]   # stories260K ids


@pytest.fixture(scope="module")
def consumer(stories_path):
    with running_server(stories_path, served_model_name=MODEL, engine_core="thread",
                        kv_transfer_config={"kv_role": "kv_consumer"}) as (url, _):
        yield url


def decode_params(**override) -> dict:
    return {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9, "remote_lease_id": "0" * 32,
            "remote_num_tokens": len(IDS), "remote_prompt_hash": prompt_hash(IDS), **override}


@pytest.mark.parametrize("field", ["remote_host", "remote_lease_id", "remote_prompt_hash"])
def test_an_empty_string_field_is_a_400_naming_it(consumer, field):
    # An empty remote_host went to ZeroMQ as tcp://:PORT, which it takes and never connects: a 503
    # "did not answer within 5 s" (a status clients retry) for params that can never work.
    r = httpx.post(f"{consumer}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": IDS, "max_tokens": 4, "kv_transfer_params": decode_params(**{field: ""})})
    error = openai_error(r, 400, "kv_transfer_params")
    assert error["message"] == f"kv_transfer_params: {field} must be a non-empty string, got ''"
