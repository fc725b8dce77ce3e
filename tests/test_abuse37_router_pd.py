"""Prefill/decode disaggregation operated as a deployment is: a prefill server restarted under a
running decode server. The decode engine kept every prefill engine's pool it had ever mapped,
so each restart left the old pool's whole segment held (its name gone, its memory not) for as long
as the decode server ran."""
from __future__ import annotations

from pathlib import Path

from test_kv_transfer import PROMPTS, claim, prefill, run, wait_until_free

from minillm.config import EngineConfig
from minillm.engine import LLMEngine
from minillm.sampling_params import SamplingParams


def engine(stories_path, kv_role: str | None) -> LLMEngine:
    transfer = {"kv_role": kv_role} if kv_role else None
    return LLMEngine(EngineConfig(str(stories_path), device="cpu", block_size=8, num_kv_blocks=64,
                                  kv_transfer_config=transfer))


def mapped_segments() -> str:
    """This process's mappings of KV segments, as /proc names them (a removed one ends in (deleted))."""
    return "\n".join(line for line in Path("/proc/self/maps").read_text().splitlines() if "minillm-kv-" in line)


def test_a_restarted_prefill_engines_old_pool_is_unmapped_and_a_claim_on_it_computes(stories_path):
    consumer, plain = engine(stories_path, "kv_consumer"), engine(stories_path, None)
    first = second = None
    try:
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        ids = [plain.tokenizer.encode(text, add_special_tokens=True) for text in PROMPTS[:2]]
        reference = [run(plain, f"ref-{i}", p, greedy).outputs[0].text for i, p in enumerate(ids)]
        first = engine(stories_path, "kv_producer")
        served = run(consumer, "d0", ids[0], SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True,
            extra_args={"kv_transfer_params": claim(prefill(first, "p0", ids[0]), ids[0])}))
        assert served.outputs[0].text == reference[0] and served.kv_transfer_stats is not None
        # A claim granted just before its prefill engine went away, added after it went.
        orphan = claim(prefill(first, "p1", ids[1]), ids[1])
        old = orphan["remote_region"]["handle"]
        first.shutdown()
        first = None
        assert not Path(old).exists() and f"{old} (deleted)" in mapped_segments()
        second = engine(stories_path, "kv_producer")
        consumer.add_request("orphan", ids[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                              extra_args={"kv_transfer_params": orphan}))
        kv = claim(prefill(second, "p2", ids[0]), ids[0])
        consumer.add_request("d2", ids[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                          extra_args={"kv_transfer_params": kv}))
        outputs = {}
        while consumer.has_unfinished_requests():
            outputs.update({out.request_id: out for out in consumer.step()})
        assert outputs["d2"].outputs[0].text == reference[0] and outputs["d2"].kv_transfer_stats is not None
        assert old not in mapped_segments(), mapped_segments()
        # The orphan's pool was dropped: its prompt is computed here, never read from an unmapped pool.
        assert outputs["orphan"].outputs[0].text == reference[1] and outputs["orphan"].kv_transfer_stats is None
        assert consumer.stats(cells=1).kv_transfer_stale_claims == 1
        wait_until_free(second)
    finally:
        for e in (first, second, consumer, plain):
            if e is not None:
                e.shutdown()
