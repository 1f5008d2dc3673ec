"""Native CPU kernels (C, compiled on first use) against the torch references, their guards,
and how the registry and the engine choose them."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
from kernel_cases import DTYPES, assert_close, make_paged_case, randn
from kvrelay.kernels import cpu_native, native_ops, reference
from kvrelay.kernels.registry import get_ops

pytestmark = pytest.mark.skipif(
    cpu_native.unavailable_reason() is not None, reason=f"no native kernels: {cpu_native.unavailable_reason()}"
)


def run_case(seq_lens, block_size, num_kv_heads, group, head_dim, dtype, seed):
    rng = random.Random(seed)
    case = make_paged_case(rng, seq_lens, block_size, num_kv_heads, head_dim, dtype)
    q = randn((len(seq_lens), num_kv_heads * group, head_dim), dtype, seed + 1)
    k_cache, v_cache = case.layer()
    assert cpu_native.supports_decode(q, k_cache, v_cache)
    scale = head_dim**-0.5
    got = cpu_native.paged_decode_attention(q, k_cache, v_cache, case.block_tables, case.seq_lens, scale)
    want = reference.paged_decode_attention(q, k_cache, v_cache, case.block_tables, case.seq_lens, scale)
    assert_close(got, want)
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [8, 64, 80, 128])
def test_gqa_ratios_head_dims_dtypes(group, head_dim, dtype):
    # Length 1, an exact multiple of the block size and ragged lengths; head_dim 80 is no power of 2
    # (generic loops); fp32 at 64 and 128 takes the AVX-512 register loops where the CPU has them.
    run_case([1, 32, 45], block_size=16, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype, seed=group)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_many_sequences_take_the_whole_sequence_path(dtype):
    # Enough sequences that each task covers all KV heads of a sequence (the path long batches take).
    lens = [1 + (i * 37) % 300 for i in range(40)]
    run_case(lens, block_size=16, num_kv_heads=4, group=2, head_dim=64, dtype=dtype, seed=5)


@pytest.mark.parametrize("seed", range(6))
def test_randomised_shapes(seed):
    rng = random.Random(2000 + seed)
    block_size = rng.choice([1, 4, 16, 32])
    kv_heads = rng.choice([1, 2, 4])
    lens = [rng.randint(1, 120) for _ in range(rng.randint(1, 12))]
    run_case(lens, block_size, kv_heads, rng.choice([1, 2, 4]), rng.choice([16, 32, 64]), torch.float32, seed)


def test_int64_block_tables_and_a_non_contiguous_query():
    case = make_paged_case(random.Random(1), [20, 3], 8, 2, 32, torch.float32)
    q = randn((2, 12, 32), torch.float32, 2)[:, ::3]  # 4 heads, strided
    k_cache, v_cache = case.layer()
    got = cpu_native.paged_decode_attention(q, k_cache, v_cache, case.block_tables.long(), case.seq_lens, 0.2)
    want = reference.paged_decode_attention(q, k_cache, v_cache, case.block_tables, case.seq_lens, 0.2)
    assert_close(got, want)


def test_block_ids_outside_the_cache_are_an_error_not_a_wild_read():
    case = make_paged_case(random.Random(2), [40], 16, 2, 32, torch.float32)
    k_cache, v_cache = case.layer()
    q = randn((1, 2, 32), torch.float32, 3)
    tables = case.block_tables.clone()
    tables[0, 1] = k_cache.shape[0]  # one past the last block
    with pytest.raises(ValueError, match="outside the KV cache"):
        cpu_native.paged_decode_attention(q, k_cache, v_cache, tables, case.seq_lens, 0.2)
    tables[0, 1] = -1
    with pytest.raises(ValueError, match="outside the KV cache"):
        cpu_native.paged_decode_attention(q, k_cache, v_cache, tables, case.seq_lens, 0.2)
    with pytest.raises(ValueError, match="block table"):
        cpu_native.paged_decode_attention(q, k_cache, v_cache, case.block_tables[:, :1], case.seq_lens, 0.2)


def test_unsupported_layouts_fall_back_to_the_reference():
    case = make_paged_case(random.Random(3), [10, 30], 8, 2, 16, torch.float32)
    k_cache, v_cache = case.layer()
    q = randn((2, 4, 16), torch.float32, 4)
    # K/V heads not packed [block_size, Hkv, D]: the kernel would read the wrong rows.
    k_t, v_t = k_cache.transpose(1, 2).contiguous().transpose(1, 2), v_cache.transpose(1, 2).contiguous().transpose(1, 2)
    assert not cpu_native.supports_decode(q, k_t, v_t)
    assert not cpu_native.supports_decode(q.double(), k_cache.double(), v_cache.double())
    assert not cpu_native.supports_decode(q.half(), k_cache, v_cache)  # mixed dtypes
    got = native_ops.paged_decode_attention(q, k_t, v_t, case.block_tables, case.seq_lens, 0.3)
    want = reference.paged_decode_attention(q, k_cache, v_cache, case.block_tables, case.seq_lens, 0.3)
    assert_close(got, want)



@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 512 crosses the threshold for using threads
def test_rms_norms_match_the_reference(rows):
    x, res, w = randn((rows, 512), torch.float32, 0) * 3, randn((rows, 512), torch.float32, 1), randn((512,),
                                                                                                  torch.float32, 2)
    assert cpu_native.supports_norm(x, w, res)
    out, summed = native_ops.fused_add_rms_norm(x, res, w, 1e-5)
    want_out, want_summed = reference.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(summed, want_summed)
    assert_close(out, want_out)
    assert torch.equal(x, randn((rows, 512), torch.float32, 0) * 3), "inputs must not be modified"
    # Rows a stride apart (a slice of a wider matrix) and a contiguous 3-D tensor (qk-norm heads).
    wide = randn((rows, 1024), torch.float32, 3)
    assert_close(native_ops.rms_norm(wide[:, :512], w, 1e-6), reference.rms_norm(wide[:, :512], w, 1e-6))
    heads = randn((rows, 8, 64), torch.float32, 4)
    assert_close(native_ops.rms_norm(heads, w[:64], 1e-6), reference.rms_norm(heads, w[:64], 1e-6))


def test_norms_outside_fp32_fall_back_to_the_reference():
    x, w = randn((5, 64), torch.bfloat16, 0), randn((64,), torch.bfloat16, 1)
    assert not cpu_native.supports_norm(x, w)
    assert torch.equal(native_ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    heads = randn((5, 12, 64), torch.float32, 2)[:, :8]  # strided heads cannot be viewed as rows
    assert not cpu_native.supports_norm(heads, randn((64,), torch.float32, 3))


@pytest.mark.parametrize("tokens", [1, 5, 200])
def test_rotary_is_the_reference_bit_for_bit(tokens):
    # q and k are views cut out of the fused qkv projection, as in the engine.
    qkv = randn((tokens, (8 + 2 * 2) * 64), torch.float32, 0)
    q, k = qkv[:, : 8 * 64].view(tokens, 8, 64), qkv[:, 8 * 64 : 10 * 64].view(tokens, 2, 64)
    cos_sin = randn((300, 64), torch.float32, 1)
    positions = torch.randint(0, 300, (tokens,), generator=torch.Generator().manual_seed(2))
    assert cpu_native.supports_rotary(positions, q, k, cos_sin)
    got_q, got_k = native_ops.rotary_embedding(positions, q, k, cos_sin)
    want_q, want_k = reference.rotary_embedding(positions, q, k, cos_sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    with pytest.raises(IndexError, match="positions must lie in"):
        cpu_native.rotary_embedding(positions + 300, q, k, cos_sin)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_matches_the_reference_and_skips_negative_slots(dtype):
    # value rows are a view into the fused qkv projection (strided), as in the engine.
    qkv = randn((6, 3 * 2 * 16), dtype, 0)
    key, value = randn((6, 2, 16), dtype, 1), qkv[:, 2 * 16 : 4 * 16].view(6, 2, 16)
    slots = torch.tensor([5, -1, 0, 17, 31, 8])
    caches = {}
    for name, fn in (("native", native_ops.write_kv), ("reference", reference.write_kv)):
        kv = torch.zeros(2, 4, 8, 2, 16, dtype=dtype)
        assert name != "native" or cpu_native.supports_write_kv(key, value, kv[0], kv[1], slots)
        fn(key, value, kv[0], kv[1], slots)
        caches[name] = kv
    assert torch.equal(caches["native"], caches["reference"])
    assert int((caches["native"][0].flatten(0, 1).abs().sum((1, 2)) > 0).sum()) == 5  # slot -1 skipped


def test_write_kv_refuses_a_slot_past_the_cache_and_writes_nothing():
    key = value = randn((3, 2, 16), torch.float32, 0)
    kv = torch.zeros(2, 4, 8, 2, 16)
    with pytest.raises(IndexError, match="past the KV cache's 32 slots"):
        cpu_native.write_kv(key, value, kv[0], kv[1], torch.tensor([0, 1, 32]))
    assert not kv.any()

def test_native_backend_takes_native_kernels_where_they_exist():
    ops = get_ops("native")
    assert ops.backend == "native"
    for name in ("paged_decode_attention", "rms_norm", "fused_add_rms_norm", "rotary_embedding", "write_kv",
                 "scatter_blocks"):
        assert getattr(ops, name) is getattr(native_ops, name)
    for name in ("paged_prefill_attention", "silu_and_mul", "gather_blocks"):
        assert getattr(ops, name) is getattr(reference, name)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run(
        [sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=180, check=False
    )


def test_build_goes_to_the_cache_folder_and_is_reused(tmp_path):
    code = "from kvrelay.kernels import cpu_native; print(cpu_native.build())"
    first = _python(code, KVRELAY_KERNEL_CACHE=str(tmp_path))
    assert first.returncode == 0, first.stderr
    path = first.stdout.split()[-1]
    assert path.startswith(str(tmp_path)) and os.path.exists(path)
    mtime = os.path.getmtime(path)
    second = _python(code, KVRELAY_KERNEL_CACHE=str(tmp_path))
    assert second.stdout.split()[-1] == path and os.path.getmtime(path) == mtime
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(path)]  # no temporary left behind


def test_without_a_compiler_auto_falls_back_to_torch_and_native_says_why(tmp_path):
    code = "from kvrelay.kernels.registry import get_ops; print(get_ops('auto').backend)"
    out = _python(code, KVRELAY_KERNEL_CACHE=str(tmp_path), CC="/nonexistent/cc")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["torch"]
    assert "using the torch kernels on CPU" in out.stderr and "no C compiler" in out.stderr
    forced = _python("from kvrelay.kernels.registry import get_ops; get_ops('native')",
                     KVRELAY_KERNEL_CACHE=str(tmp_path), CC="/nonexistent/cc")
    assert forced.returncode != 0 and "NativeKernelsUnavailable" in forced.stderr
    assert "install gcc or set CC" in forced.stderr


def test_disabled_by_environment():
    out = _python("from kvrelay.kernels.registry import get_ops; print(get_ops('auto').backend)",
                  KVRELAY_NATIVE_KERNELS="0")
    assert out.stdout.split() == ["torch"], out.stderr
    assert "KVRELAY_NATIVE_KERNELS=0" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default")
def test_cpu_engine_defaults_to_native_and_matches_the_torch_backend(caplog):
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.llm_engine import LLMEngine
    from kvrelay.engine.sampling_params import SamplingParams

    outputs = {}
    for backend in ("auto", "torch"):
        caplog.clear()
        with caplog.at_level("INFO", logger="kvrelay.engine.llm_engine"):
            engine = LLMEngine(EngineArgs(kernel_backend=backend))
        assert engine.ops.backend == ("native" if backend == "auto" else "torch")
        # The start-up line says which kernels run.
        assert f"kernels {engine.ops.backend}," in caplog.text and "engine ready: stories260K" in caplog.text
        for i, prompt in enumerate(["Once upon a time", "The little dog", "Lily"]):
            engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0.0), str(i))
        done: dict[str, list[int]] = {}
        while engine.has_work():
            for out in engine.step():
                done.setdefault(out.request_id, []).extend(out.new_token_ids)
        outputs[backend] = done
    assert outputs["auto"] == outputs["torch"]
    assert all(len(ids) > 10 for ids in outputs["auto"].values())


def test_an_unwritable_cache_folder_falls_back_with_the_fix_in_the_message(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache folder should be: mkdir fails, even as root
    out = _python("from kvrelay.kernels.registry import get_ops; print(get_ops('auto').backend)",
                  KVRELAY_KERNEL_CACHE=str(blocker / "kernels"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["torch"]
    assert "cannot write the kernel cache folder" in out.stderr and "KVRELAY_KERNEL_CACHE" in out.stderr


def test_kernels_use_torchs_thread_count_from_any_thread():
    # OpenMP's default team size is per calling thread, so a kernel called from an engine thread
    # would ignore torch.set_num_threads(1) unless the count is passed in: count the OS threads.
    code = """
import os, threading, torch
from kvrelay.kernels import cpu_native
torch.set_num_threads(1)
q = torch.randn(64, 8, 64); kv = torch.randn(2, 70, 16, 8, 64)
tables = torch.arange(64, dtype=torch.int32)[:, None]; lens = torch.full((64,), 16, dtype=torch.int32)
before = len(os.listdir('/proc/self/task'))
t = threading.Thread(target=lambda: cpu_native.paged_decode_attention(q, kv[0], kv[1], tables, lens, 0.1))
t.start(); t.join()
x = torch.randn(4096, 64)
t = threading.Thread(target=lambda: cpu_native.add_rms_norm(x, None, torch.ones(64), 1e-6))
t.start(); t.join()
import time
deadline = time.monotonic() + 5  # a joined thread's OS task can linger a moment under load
while len(os.listdir('/proc/self/task')) > before and time.monotonic() < deadline:
    time.sleep(0.01)
print(len(os.listdir('/proc/self/task')) - before)
"""
    out = _python(code, OMP_NUM_THREADS="2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0"]  # no OpenMP worker threads were started


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layers", [(0, 3), (1, 2), (2, 3)])
def test_scatter_blocks_matches_the_reference(layers, dtype):
    """The P/D hand-off's block scatter: bit for bit the reference, repeated ids included (last wins)."""
    from kvrelay.kernels import native_ops, reference

    start, end = layers
    ids = torch.tensor([0, 7, 3, 9, 7], dtype=torch.int32)
    buffer = torch.randn((end - start, 2, 5, 4, 2, 8)).to(dtype)
    got = torch.randn((3, 2, 10, 4, 2, 8)).to(dtype)
    want = got.clone()
    assert cpu_native.supports_scatter_blocks(got, ids, buffer, start, end)
    native_ops.scatter_blocks(got, ids, buffer, start, end)
    reference.scatter_blocks(want, ids, buffer, start, end)
    assert torch.equal(got, want)


def test_scatter_blocks_refuses_an_id_past_the_cache_and_writes_nothing():
    cache = torch.zeros((2, 2, 4, 4, 1, 8))
    with pytest.raises(IndexError, match="outside the KV cache's 4 blocks"):
        cpu_native.scatter_blocks(cache, torch.tensor([1, 4]), torch.ones((2, 2, 2, 4, 1, 8)), 0, 2)
    assert not cache.any()


def test_scatter_blocks_other_layouts_fall_back_to_the_reference():
    from kvrelay.kernels import native_ops, reference

    cache = torch.zeros((2, 2, 4, 4, 1, 8))
    buffer = torch.ones((2, 2, 4, 2, 1, 8)).transpose(2, 3)  # not contiguous
    assert not cpu_native.supports_scatter_blocks(cache, torch.tensor([0, 2]), buffer, 0, 2)
    assert not cpu_native.supports_scatter_blocks(cache, torch.tensor([0, 2]), torch.ones((2, 2, 2, 4, 1, 8),
                                                  dtype=torch.float64), 0, 2)  # another dtype: the reference casts
    want = cache.clone()
    native_ops.scatter_blocks(cache, torch.tensor([0, 2]), buffer, 0, 2)
    reference.scatter_blocks(want, torch.tensor([0, 2]), buffer, 0, 2)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layers", [(0, 3), (1, 2)])
def test_copy_blocks_between_caches_matches_the_reference(layers, dtype):
    """The direct hand-off's copy from a prefill worker's cache (12 blocks) into a decode
    worker's (10): bit for bit the reference, ids in any order."""
    from kvrelay.kernels import native_ops, reference

    start, end = layers
    src = torch.randn((3, 2, 12, 4, 2, 8)).to(dtype)
    src_ids, dst_ids = torch.tensor([11, 0, 5, 6]), torch.tensor([2, 9, 3, 4])
    got = torch.randn((3, 2, 10, 4, 2, 8)).to(dtype)
    want = got.clone()
    assert cpu_native.supports_copy_blocks(got, dst_ids, src, src_ids, start, end)
    native_ops.copy_blocks(got, dst_ids, src, src_ids, start, end)
    reference.copy_blocks(want, dst_ids, src, src_ids, start, end)
    assert torch.equal(got, want)
    assert torch.equal(got[start:end, :, 9], src[start:end, :, 0]) and not torch.equal(got[:, :, 0], src[:, :, 0])


def test_copy_blocks_refuses_an_id_outside_either_cache_and_writes_nothing():
    src, dst = torch.ones((2, 2, 6, 4, 1, 8)), torch.zeros((2, 2, 4, 4, 1, 8))
    for dst_ids, src_ids in (([1, 4], [0, 1]), ([1, 2], [0, 6]), ([-1, 2], [0, 1])):
        with pytest.raises(IndexError, match="outside its cache"):
            cpu_native.copy_blocks(dst, torch.tensor(dst_ids), src, torch.tensor(src_ids), 0, 2)
    assert not dst.any()
