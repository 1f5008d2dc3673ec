"""Disaggregated prefill/decode with a mixture-of-experts model (Qwen2-MoE with a shared expert):
greedy tokens equal transformers', and the hand-off leaves no blocks behind."""

from __future__ import annotations

import shutil

import torch
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.worker_base import WorkerOptions
from pd_helpers import TOKENIZER_FILES, assert_all_free, start_pair, stop_pair

from kvrelay.models import BUNDLED_MODEL


def _tiny_qwen2_moe(path):
    import transformers

    config = transformers.Qwen2MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=96, norm_topk_prob=True)
    torch.manual_seed(99)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(BUNDLED_MODEL / name, path / name)
    return path, model.eval()


async def test_disaggregated_moe_equals_transformers(tmp_path):
    model_dir, hf = _tiny_qwen2_moe(tmp_path / "qwen2-moe")
    opts = WorkerOptions(max_message_bytes=16 * 1024, stream_min_tokens=0, layer_group_size=1)
    pair = await start_pair(model_dir, prefill_options=opts, decode_options=opts)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
        prompts = [list(range(3, 40)), list(range(3, 40)) + [77, 78, 79], [5, 9, 300, 41]]  # the 2nd: a prefix hit
        for i, prompt in enumerate(prompts):
            got = [t async for o in pair.client.generate(prompt, params, f"r{i}", prefill_addr=pair.prefill_addr)
                   for t in o.new_token_ids]
            with torch.no_grad():
                want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
            assert got == want[0, len(prompt):].tolist(), f"prompt {i}"
        assert pair.decode.metrics.kv_bytes._value.get() > 0
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)
