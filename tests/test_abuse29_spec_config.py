"""speculative_config and kv_transfer_config given as Python dicts with keys that are not strings."""
from __future__ import annotations

import pytest

from minillm.config import EngineConfig
from minillm.kv_connector.transfer_config import KVTransferConfig
from minillm.spec_decode.config import SpeculativeConfig


@pytest.mark.parametrize("extra", [{1: 3, "foo": 2}, {None: 1, "prompt_lookup": 3}, {(1, 2): 0, 2.5: 1}])
def test_unknown_keys_of_any_type_are_a_value_error_naming_them(extra):
    # Keys of several types made sorting the unknown ones raise TypeError ('<' not supported).
    with pytest.raises(ValueError, match="speculative_config has unknown field") as info:
        SpeculativeConfig.from_dict({"num_speculative_tokens": 2, **extra})
    assert all(repr(k) in str(info.value) for k in extra)
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(model="unused", speculative_config={"num_speculative_tokens": 2, **extra})
    with pytest.raises(ValueError, match="kv_transfer_config has unknown keys") as info:
        KVTransferConfig.from_any({"kv_role": "kv_producer", **extra})
    assert all((k if isinstance(k, str) else repr(k)) in str(info.value) for k in extra)
