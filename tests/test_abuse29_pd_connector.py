"""A decode engine's lease on the prefill engine's blocks is given back only once no launched step
copies from them: a request aborted while the step carrying its load is in flight (asynchronous
scheduling) releases its lease when that step is read back, not at the abort."""
from minillm import SamplingParams

from test_kv_transfer import PROMPTS, claim, engines, prefill, wait_until_free


def test_an_abort_while_the_load_is_in_flight_releases_after_the_step(stories_path):
    producer, consumer, plain = engines(stories_path, async_scheduling=True)
    try:
        ids = plain.tokenizer.encode(PROMPTS[1], add_special_tokens=True)
        kv = prefill(producer, "p", ids)
        consumer.add_request("d", ids, SamplingParams(temperature=0, max_tokens=8,
                                                       extra_args={"kv_transfer_params": claim(kv, ids)}))
        consumer.step()                                  # launches the step with the load; it stays in flight
        [records] = consumer.kv_connector._loading.values()
        [state] = [record.state for record in records]
        consumer.abort_request("d")
        assert not state.is_released                     # released here, the producer could reuse the blocks
        consumer.step()                                  # the in-flight step is read back
        assert state.is_released and not consumer.kv_connector._loading
        wait_until_free(producer)
        assert producer.stats(cells=1).kv_transfer_leases_released == 1
    finally:
        for engine in (producer, consumer, plain):
            engine.shutdown()
