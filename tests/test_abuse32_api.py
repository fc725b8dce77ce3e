"""The OpenAI-compatible endpoints as a vLLM user drives them (the openai client and raw HTTP), at
their edges: each defect found there, pinned."""
from __future__ import annotations

from test_server_helpers import chat_template_server, story_streams  # noqa: F401 (the server and healthy fixtures)


def test_model_cards_carry_vllms_parent_and_permission(http):
    """vLLM's ModelCard has parent (null for a base model) and permission (one ModelPermission), which
    proxies and dashboards read (olla's vLLM profile); the cards had neither."""
    for card in [*http.get("/v1/models").json()["data"], http.get("/v1/models/stories").json()]:
        assert card["parent"] is None and card["max_model_len"] == 256
        [permission] = card["permission"]
        assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
        assert {k: permission[k] for k in ("allow_sampling", "allow_logprobs", "allow_view", "organization",
                                           "allow_create_engine", "allow_fine_tuning", "group", "is_blocking")} == \
            {"allow_sampling": True, "allow_logprobs": True, "allow_view": True, "organization": "*",
             "allow_create_engine": False, "allow_fine_tuning": False, "group": None, "is_blocking": False}
