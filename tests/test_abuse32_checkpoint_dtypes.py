"""Checkpoints in each floating dtype transformers loads: F64 tensors (transformers builds a float64
model from them; vLLM casts them to its dtype) were refused ("has dtype F64; supported: F32, F16, BF16");
they load, cast to the dtype asked, like F32, F16 and BF16 ones and a mix of them."""
from __future__ import annotations

import numpy as np
import pytest

from minillm.loader import bf16_bits_to_float32, load_model_config, load_weights

from test_loader import save_numpy_checkpoint


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_float64_checkpoint_loads_cast_to_the_dtype_asked(tmp_path, dtype):
    path, state = save_numpy_checkpoint(tmp_path / "m", "llama", dtype=np.float64)
    config = load_model_config(path)
    assert config.torch_dtype == "float32"        # the widest dtype minillm computes in
    weights = load_weights(path, config, dtype)
    for name, value in state.items():
        got = bf16_bits_to_float32(weights[name]) if dtype == "bfloat16" else weights[name].astype(np.float32)
        np.testing.assert_allclose(got, value.astype(np.float32), rtol=1e-2 if dtype != "float32" else 1e-7,
                                   atol=1e-3 if dtype != "float32" else 0, err_msg=name)


def test_a_checkpoint_of_mixed_dtypes_loads(tmp_path):
    from safetensors.numpy import load_file, save_file
    path, state = save_numpy_checkpoint(tmp_path / "m", "llama")
    tensors = load_file(path / "model.safetensors")
    mixed = {name: value.astype(np.float64 if "norm" in name else np.float16 if "mlp" in name else np.float32)
             for name, value in tensors.items()}
    save_file(mixed, str(path / "model.safetensors"))
    weights = load_weights(path, load_model_config(path), "float32")
    for name, value in mixed.items():
        assert weights[name].dtype == np.float32 and np.array_equal(weights[name], value.astype(np.float32)), name
