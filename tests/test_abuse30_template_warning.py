"""A chat template that does not compile is warned of once by the process that renders chats: an
engine core beside its API servers (token ids out) says nothing, so `minillm serve` warned twice."""
from __future__ import annotations

import logging

from test_abuse30_models import stories_copy
from test_abuse30b_models import BROKEN_TEMPLATE, with_tokenizer_config

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.engine_core.core import TokenOutputs
from minillm.output_processor import TextOutputs


def test_only_an_engine_that_renders_chats_warns_of_its_template(tmp_path, caplog):
    path = with_tokenizer_config(stories_copy(tmp_path), chat_template=BROKEN_TEMPLATE)
    warned = {}
    for processor in (TokenOutputs, TextOutputs):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="minillm"):
            LLMEngine(EngineConfig(model=str(path), device="cpu"), output_processor=processor).shutdown()
        warned[processor] = caplog.text.count("does not compile")
    assert warned == {TokenOutputs: 0, TextOutputs: 1}
