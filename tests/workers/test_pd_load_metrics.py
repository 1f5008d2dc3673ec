"""The load stream and /metrics the gateway and operator read, and errors across the wire."""

from __future__ import annotations

import pytest
from kvrelay.engine.block_pool import prompt_block_hashes
from kvrelay.engine.errors import InvalidRequestError, PromptTooLongError
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.client import watch_load
from kvrelay.kvtransfer.worker_base import WorkerOptions
from pd_helpers import assert_all_free, free_port, load_report, metric_value, scrape, start_pair, stop_pair

PROMPT = list(range(40, 140))


async def test_load_stream_reports_prefix_cache_keys_and_pool_state():
    pair = await start_pair()
    try:
        before = await load_report(pair.prefill_addr)
        assert before.role == "prefill" and before.all_blocks_free and before.prefix_hashes_current == set()
        assert before.layout == pair.prefill.layout and before.max_model_len == 512
        params = SamplingParams(temperature=0.0, max_tokens=4)
        _ = [o async for o in pair.client.generate(PROMPT, params, prefill_addr=pair.prefill_addr)]
        reports = []
        async for r in watch_load(pair.prefill_addr, interval_s=0.05):
            reports.append(r)
            if len(reports) == 3:
                break
        # Full set on the first report of a stream, then only the digest while it is unchanged.
        assert reports[0].prefix_hashes is not None and reports[1].prefix_hashes is None
        assert reports[0].prefix_digest == reports[1].prefix_digest != 0
        assert set(prompt_block_hashes(PROMPT, 16)) <= reports[2].prefix_hashes_current
        assert reports[2].cached_prefix_blocks(PROMPT + [1, 2, 3]) == len(PROMPT) // 16
        assert reports[2].cached_prefix_blocks([9] * 40) == 0
        assert [r.sequence for r in reports] == [0, 1, 2]
        decode = await load_report(pair.decode_addr)
        assert decode.role == "decode" and decode.num_running == 0 and decode.all_blocks_free
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)


async def test_metrics_endpoint_serves_vllm_style_names():
    dport, pport = free_port(), free_port()
    pair = await start_pair(prefill_options=WorkerOptions(metrics_port=pport),
                            decode_options=WorkerOptions(metrics_port=dport))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        for _ in range(2):  # the second run hits the prefill worker's prefix cache
            _ = [o async for o in pair.client.generate(PROMPT, params, prefill_addr=pair.prefill_addr)]
        page = scrape(dport)
        for name in ("kvrelay:num_requests_waiting", "kvrelay:num_requests_running", "kvrelay:kv_cache_usage_perc",
                     "kvrelay:prefix_cache_hits_total", "kvrelay:prefix_cache_queries_total",
                     "kvrelay:num_preemptions_total", "kvrelay:kv_lease_expiries_total"):
            assert f"\n{name} " in page, name
        assert metric_value(page, "kvrelay:time_to_first_token_seconds_count") == 2
        assert metric_value(page, "kvrelay:inter_token_latency_seconds_count") == 10
        assert metric_value(page, "kvrelay:kv_transfer_seconds_count") == 2
        # The second hand-off finds the prompt's 6 full blocks in the decode worker's own prefix
        # cache and moves only the last, partial one.
        assert metric_value(page, "kvrelay:kv_transfer_bytes_total") == (7 + 1) * pair.decode.layout.bytes_per_block_layer * 5
        assert metric_value(page, "kvrelay:prefix_cache_hits_total") == 6 * 16
        assert metric_value(page, "kvrelay:kv_cache_usage_perc") == 0
        assert metric_value(page, "kvrelay:generation_tokens_total") == 12
        ppage = scrape(pport)
        assert metric_value(ppage, "kvrelay:prefix_cache_hits_total") == 96  # 6 full blocks of the 100 tokens
        assert metric_value(ppage, "kvrelay:kv_handoffs_total", 'outcome="ack"') == 2
        # The sender times each hand-off from its first chunk out to the ack, over the same bytes.
        assert metric_value(ppage, "kvrelay:kv_send_seconds_count") == 2
        assert metric_value(ppage, "kvrelay:kv_send_seconds_sum") > 0
        assert metric_value(ppage, "kvrelay:kv_send_bytes_total") == metric_value(page, "kvrelay:kv_transfer_bytes_total")
    finally:
        await stop_pair(pair)


async def test_bad_requests_raise_the_engine_errors_through_the_client():
    pair = await start_pair()
    try:
        with pytest.raises(PromptTooLongError) as err:
            _ = [o async for o in pair.client.generate([5] * 512, SamplingParams(max_tokens=1),
                                                       prefill_addr=pair.prefill_addr)]
        assert err.value.limit == 511 and err.value.field == "prompt"
        with pytest.raises(InvalidRequestError) as err:
            _ = [o async for o in pair.client.generate(PROMPT, SamplingParams(top_p=0.0),
                                                       prefill_addr=pair.prefill_addr)]
        assert err.value.field == "top_p"
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)
