"""Model folders as Hugging Face models ship them (Llama 3, Qwen, Mistral style tokenizer_config.json,
generation_config.json, a generation_config folder), read by minillm as transformers and vLLM read them."""
from __future__ import annotations

import json

import httpx
import pytest

from test_server_helpers import running_server


@pytest.fixture(scope="module")
def capped_folder(tmp_path_factory):
    """A generation_config folder (vLLM's --generation-config FOLDER) asking for max_new_tokens 5."""
    folder = tmp_path_factory.mktemp("gen-folder")
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5, "eos_token_id": 2}))
    return folder


@pytest.mark.parametrize("override, expected", [(None, 5), ({"max_new_tokens": 3}, 3)])
def test_a_generation_config_folders_max_new_tokens_caps_a_requests_max_tokens(stories_path, capped_folder,
                                                                                override, expected):
    """vLLM's server caps max_tokens by the folder's max_new_tokens (the override's over it), as it caps
    by override_generation_config's under auto: a request asking for 20 tokens got 20."""
    with running_server(stories_path, generation_config=str(capped_folder),
                        override_generation_config=override) as (url, _):
        body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 20, "ignore_eos": True,
                "temperature": 0}
        done = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert done["usage"]["completion_tokens"] == expected, done
