"""Checkpoint variants on the GPU against the CPU decoder: head sizes the kernels vectorise and those
they do not, GQA ratios down to one KV head, Qwen2's biases, Qwen3's q/k norms, scaled rotary."""
import numpy as np
import pytest

from minillm import LLM, SamplingParams

from make_fixtures import write_tokenizer
from test_engine_gpu import gpu_prompt_logits
from test_loader import save_numpy_checkpoint
from test_model_parity import minillm_prompt_logits, rel_err

from gpu_support import HAS_GPU

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
VARIANTS = {   # name: (family, config fields)
    **{f"llama-head-dim-{d}": ("llama", dict(head_dim=d)) for d in (16, 32, 40, 48, 64, 80, 96, 100, 128, 256)},
    "llama-gqa-8-to-1": ("llama", dict(num_attention_heads=8, num_key_value_heads=1)),
    "llama-gqa-8-to-2": ("llama", dict(num_attention_heads=8, num_key_value_heads=2)),
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "llama-yarn": ("llama", dict(rope_scaling=YARN)),
    "qwen2-head-dim-96-mqa": ("qwen2", dict(head_dim=96, num_key_value_heads=1)),
    "qwen3-head-dim-128-gqa-4": ("qwen3", dict(head_dim=128, num_attention_heads=8, num_key_value_heads=2)),
    "qwen3-head-dim-80": ("qwen3", dict(head_dim=80)),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_on_the_gpu_matches_the_cpu(tmp_path, name):
    family, fields = VARIANTS[name]
    path, _ = save_numpy_checkpoint(tmp_path / name, family, **fields)
    write_tokenizer(path)
    ids = [1] + [int(t) for t in np.random.default_rng(1).integers(3, 160, size=40)]
    assert rel_err(gpu_prompt_logits(path, ids, "float32"), minillm_prompt_logits(path, ids)) < 1e-4
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = [LLM(str(path), device=device, dtype="float32", num_kv_blocks=32, block_size=16).generate(
        [ids[:9], ids[:23]], params) for device in ("cuda", "cpu")]
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]
