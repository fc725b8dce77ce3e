"""Models a user brings, end to end: tiny random checkpoints of each architecture minillm loads, saved by
transformers with a real tokenizer (byte-level BPE as Qwen2 / Llama 3 build theirs, SentencePiece-style BPE as
Llama 2 / Mistral), in each saved dtype, sharded or not, with unknown config keys and rope scalings. Text
prompts of mixed lengths (one past a KV block) go through LLM.generate in one batch, with chunked prefill,
tiny blocks or preemption; the prompt ids, greedy tokens and the sampled and prompt tokens' log-probabilities
must be transformers' own. The parity tests before these compared prompt logits and a lone greedy sequence of
id prompts; none went through the tokenizer, the sampler's logprobs or a batch."""
from __future__ import annotations

import json

import numpy as np
import pytest

from test_abuse29_models import build_model, edit_json, shard
from test_abuse29_tokenizers import save_llama3, save_mistral, save_qwen

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = ["Hello world! The quick brown fox jumps over the lazy dog. It's I'm we'll they've don't 12345",
           "def main():", "日本語のテキスト", "  leading spaces and\ttabs\n\nHello"]
NUM_TOKENS = 8
TOKENIZERS = {"llama3": save_llama3, "qwen": save_qwen, "mistral": save_mistral}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
UNKNOWN_KEYS = {"foo_bar": {"x": 1}, "use_cache": False, "pretraining_tp": 1, "attention_dropout": 0.0,
                "auto_map": {"AutoConfig": "configuration_x.XConfig"}, "transformers_version": "9.9.9"}
MODELS = {   # name: (arch, tokenizer, saved dtype, config fields, a config.json edit, a folder edit)
    "llama-tied-gqa2-llama3-rope-bf16": ("llama", "llama3", "bfloat16",
                                         dict(tie_word_embeddings=True, rope_scaling=LLAMA3, rope_theta=5e5), None, None),
    "qwen2-gqa4-yarn-bf16": ("qwen2", "qwen", "bfloat16", dict(num_attention_heads=8, num_key_value_heads=2, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}), None, None),
    "qwen3-mha-head-dim-32-fp16-unknown-keys": ("qwen3", "qwen", "float16", dict(num_key_value_heads=4, head_dim=32),
                                                lambda c: c.update(UNKNOWN_KEYS), None),
    "mistral-mqa-linear-rope-sharded": ("mistral", "mistral", "float32", dict(
        num_key_value_heads=1, sliding_window=None, rope_scaling={"rope_type": "linear", "factor": 2.0}), None, shard),
    "llama-spm-dynamic-rope-untied": ("llama", "mistral", "float32",
                                      dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), None, None),
}


def save_model(path, arch, tokenizer, dtype, fields, config_edit=None, folder_edit=None):
    """A tiny random model of arch beside a tokenizer of that family, its vocabulary padded past the tokenizer's."""
    TOKENIZERS[tokenizer](path)
    tokens = json.loads((path / "tokenizer.json").read_text())
    vocab = len(tokens["model"]["vocab"]) + len(tokens["added_tokens"]) + 24
    build_model(arch, dtype, **{"vocab_size": vocab, "max_position_embeddings": 256, **fields}).save_pretrained(path)
    if config_edit:
        edit_json(path / "config.json", config_edit)
    if folder_edit:
        folder_edit(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("a35-models")
    return {name: save_model(root / name, *spec) for name, spec in MODELS.items()}


def transformers_reference(path, prompts, num_tokens):
    """Per prompt: transformers' ids, greedy tokens, their logprobs and the prompt tokens' logprobs."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)           # two test workers on two cores: torch's spinning threads starve the other
    try:
        for prompt in prompts:
            out.append(_reference_one(tok, model, prompt, num_tokens))
    finally:
        torch.set_num_threads(threads)
    return out


def _reference_one(tok, model, prompt, num_tokens):
    """transformers' ids, greedy tokens, their logprobs and the prompt tokens' logprobs for one prompt."""
    ids = tok.encode(prompt)
    seq, logprobs = list(ids), []
    with torch.no_grad():
        prompt_lp = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
        for _ in range(num_tokens):
            lp = torch.log_softmax(model(torch.tensor([seq])).logits[0, -1], -1)
            seq.append(int(lp.argmax()))
            logprobs.append(float(lp[seq[-1]]))
    return ids, seq[len(ids):], logprobs, [float(prompt_lp[i - 1, ids[i]]) for i in range(1, len(ids))]


def minillm_outputs(path, prompts, num_tokens, **engine_args):
    """(LLM.generate's outputs of greedy tokens with logprobs and prompt logprobs, the LLM)."""
    from minillm import LLM, SamplingParams
    llm = LLM(str(path), device="cpu", **engine_args)
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    return llm.generate(prompts, params, use_tqdm=False), llm


def assert_matches_transformers(path, prompts=PROMPTS, num_tokens=NUM_TOKENS, **engine_args):
    """The LLM the outputs came from, once they matched."""
    reference = transformers_reference(path, prompts, num_tokens)
    assert max(len(ids) for ids, *_ in reference) > engine_args.get("block_size", 16)     # one prompt spans blocks
    outs, llm = minillm_outputs(path, prompts, num_tokens, **engine_args)
    for (ids, greedy, logprobs, prompt_logprobs), out in zip(reference, outs):
        got = out.outputs[0]
        assert out.prompt_token_ids == ids and got.token_ids == greedy, out.prompt
        np.testing.assert_allclose([d[t] for d, t in zip(got.logprobs, got.token_ids)], logprobs, atol=2e-4)
        assert out.prompt_logprobs[0] is None
        np.testing.assert_allclose([d[t] for d, t in zip(out.prompt_logprobs[1:], ids[1:])], prompt_logprobs,
                                   atol=2e-4)
    return llm


@pytest.mark.parametrize("name", list(MODELS))
def test_a_batch_of_text_prompts_matches_transformers(models, name):
    """Mixed lengths in one batch, prefill chunked at 24 tokens, 16-token blocks."""
    assert_matches_transformers(models[name], block_size=16, max_num_batched_tokens=24)


@pytest.mark.parametrize("engine_args", [dict(block_size=1), dict(block_size=2, max_num_batched_tokens=5),
                                         dict(block_size=32), dict(block_size=8, enable_prefix_caching=False),
                                         dict(block_size=4, num_kv_blocks=12, max_num_seqs=4,
                                              max_num_batched_tokens=16)],
                         ids=["block-1", "block-2-chunk-5", "block-32", "no-prefix-cache", "preempted"])
@pytest.mark.parametrize("name", ["qwen2-gqa4-yarn-bf16", "qwen3-mha-head-dim-32-fp16-unknown-keys"])
def test_engine_layouts_match_transformers(models, name, engine_args):
    """Tiny blocks, chunks shorter than a prompt, a pool too small for the batch (requests preempted and
    recomputed): the same tokens and logprobs for a GQA model with biases and an MHA one with wide heads."""
    if engine_args.get("block_size") == 32:
        prompts = [PROMPTS[0] * 2] + PROMPTS[1:]         # past one 32-token block
    else:
        prompts = PROMPTS
    engine = assert_matches_transformers(models[name], prompts, **engine_args).llm_engine
    assert (engine.scheduler.num_preemptions > 0) == ("num_kv_blocks" in engine_args)


def test_prompts_served_from_the_prefix_cache_match_transformers(models):
    """A second batch of the same prompts reads their full blocks from the cache."""
    from minillm import SamplingParams
    path = models["llama-tied-gqa2-llama3-rope-bf16"]
    llm = assert_matches_transformers(path, block_size=4)
    reference = transformers_reference(path, PROMPTS, NUM_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
    hits = llm.llm_engine.block_manager.prefix_cache_hits
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.llm_engine.block_manager.prefix_cache_hits > hits
    for (ids, greedy, logprobs, _), out in zip(reference, outs):
        assert out.outputs[0].token_ids == greedy
        np.testing.assert_allclose([d[t] for d, t in zip(out.outputs[0].logprobs, greedy)], logprobs, atol=2e-4)


def test_a_sliding_window_caps_the_context_and_matches_transformers_within_it(tmp_path):
    """Mistral with a 24-token window: the context is the window, a request stops at it (finish_reason
    length), and up to it the tokens and logprobs are transformers' own."""
    path = save_model(tmp_path / "m", "mistral", "mistral", "float32", dict(sliding_window=24))
    prompt = "def main():"
    [(ids, greedy, logprobs, _)] = transformers_reference(path, [prompt], 24)
    [out], _ = minillm_outputs(path, [prompt], 40, block_size=4)
    got = out.outputs[0]
    assert len(ids) + len(got.token_ids) == 24 and got.finish_reason == "length"
    assert got.token_ids == greedy[:len(got.token_ids)]
    np.testing.assert_allclose([d[t] for d, t in zip(got.logprobs, got.token_ids)], logprobs[:len(got.token_ids)],
                               atol=2e-4)


def test_a_small_max_position_embeddings_is_the_context(tmp_path):
    """max_position_embeddings 20: generation stops at 20 tokens, a prompt of 20 is refused naming the limit."""
    from minillm import LLM, SamplingParams
    path = save_model(tmp_path / "m", "llama", "llama3", "float32", dict(max_position_embeddings=20))
    llm = LLM(str(path), device="cpu")
    assert llm.llm_engine.max_model_len == 20
    [out] = llm.generate(["Hi there"], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 20 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="prompt has 20 tokens, which leaves no room under max_model_len 20"):
        llm.generate([list(range(3, 23))], SamplingParams(max_tokens=1), use_tqdm=False)


def test_tensor_parallel_ranks_match_transformers(models):
    """Two CPU ranks (KV heads, MLP columns and vocabulary rows split) on a biased GQA model with a vocabulary
    that does not split evenly."""
    from minillm import LLM, SamplingParams
    path = models["qwen2-gqa4-yarn-bf16"]
    reference = transformers_reference(path, PROMPTS[:3], 6)
    llm = LLM(str(path), device="cpu", tensor_parallel_size=2)
    try:
        outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0),
                            use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for (ids, greedy, logprobs, _), out in zip(reference, outs):
        got = out.outputs[0]
        assert out.prompt_token_ids == ids and got.token_ids == greedy
        np.testing.assert_allclose([d[t] for d, t in zip(got.logprobs, got.token_ids)], logprobs, atol=2e-4)


def test_an_unknown_architecture_with_a_real_tokenizer_is_refused_at_load(tmp_path):
    """A Gemma checkpoint (a model the tests have not seen) is refused before any weight is read, naming it."""
    from minillm import LLM
    path = tmp_path / "gemma"
    save_qwen(path)
    (path / "config.json").write_text(json.dumps({"architectures": ["GemmaForCausalLM"], "model_type": "gemma",
                                                  "vocab_size": 700, "hidden_size": 32}))
    with pytest.raises(ValueError, match="unsupported architecture GemmaForCausalLM; supported: LlamaForCausalLM"):
        LLM(str(path), device="cpu")
