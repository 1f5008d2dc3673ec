"""Wire pieces on their own: chunk planning and verification, conversions, leases."""

from __future__ import annotations

import time

import pytest
import torch
from kvrelay.engine.outputs import RequestOutput, TokenLogprob
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.chunk_wire import checksum, decode_server_message, encode_chunk_message
from kvrelay.kvtransfer.convert import output_from_proto, output_to_proto, params_from_proto, params_to_proto
from kvrelay.kvtransfer.errors import ChunkError, LayoutMismatchError
from kvrelay.kvtransfer.layout import (
    MESSAGE_OVERHEAD,
    ChunkRange,
    ChunkVerifier,
    KVLayout,
    check_layout,
    chunk_header,
    plan_chunks,
)
from kvrelay.kvtransfer.leases import Lease, LeaseTable
from kvrelay.v1 import kv_pb2

LAYOUT = KVLayout("m", "rev1", "float32", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)


def _chunk(r: ChunkRange, num_tokens: int = 10, layout: KVLayout = LAYOUT, dtype=torch.float32):
    t = torch.randn(r.layer_end - r.layer_start, 2, r.block_end - r.block_start, layout.block_size,
                    layout.num_kv_heads, layout.head_dim).to(dtype)
    wire = encode_chunk_message(chunk_header(layout.to_proto(), r, num_tokens), t)
    # What any protobuf parser makes of the hand-framed bytes: a plain KVChunk with data.
    msg = kv_pb2.PrefillServerMessage.FromString(wire).chunk
    return msg, t


@pytest.mark.parametrize("max_bytes", [MESSAGE_OVERHEAD + 512, MESSAGE_OVERHEAD + 1500, MESSAGE_OVERHEAD + 5000,
                                       4 * 2**20])
def test_plan_covers_every_slice_once_within_the_message_bound(max_bytes):
    per = LAYOUT.bytes_per_block_layer  # 512
    seen = torch.zeros(3, 7, dtype=torch.int32)
    for r in plan_chunks(LAYOUT, 0, 3, 7, max_bytes):
        assert (r.layer_end - r.layer_start) * (r.block_end - r.block_start) * per <= max_bytes - MESSAGE_OVERHEAD
        seen[r.layer_start:r.layer_end, r.block_start:r.block_end] += 1
    assert bool((seen == 1).all())


@pytest.mark.parametrize("max_bytes", [MESSAGE_OVERHEAD + 512, MESSAGE_OVERHEAD + 5000, 4 * 2**20])
def test_blocks_the_receiver_holds_are_neither_planned_nor_accepted(max_bytes):
    """first_block: the decode worker's prefix cache holds blocks [0, 4) of 7."""
    seen = torch.zeros(3, 7, dtype=torch.int32)
    for r in plan_chunks(LAYOUT, 0, 3, 7, max_bytes, block_start=4):
        seen[r.layer_start:r.layer_end, r.block_start:r.block_end] += 1
    assert bool((seen[:, 4:] == 1).all()) and not seen[:, :4].any()
    v = ChunkVerifier(LAYOUT, num_tokens=100, num_blocks=7, first_block=4)
    with pytest.raises(ChunkError, match=r"outside 3 layers x blocks \[4, 7\)"):
        v.accept(_chunk(ChunkRange(0, 3, 3, 5), num_tokens=100)[0])
    with pytest.raises(ChunkError, match="incomplete"):
        v.check_complete()
    v.accept(_chunk(ChunkRange(0, 3, 4, 7), num_tokens=100)[0])
    v.check_complete()


def test_plan_refuses_a_message_bound_below_one_block_of_one_layer():
    with pytest.raises(ValueError, match="raise --max-message-bytes"):
        plan_chunks(LAYOUT, 0, 3, 7, MESSAGE_OVERHEAD + 100)


def test_verified_chunk_round_trips_exactly():
    v = ChunkVerifier(LAYOUT, num_tokens=10, num_blocks=3)
    msg, t = _chunk(ChunkRange(0, 3, 0, 3))
    r, got = v.verify(kv_pb2.KVChunk.FromString(msg.SerializeToString()))
    assert r == ChunkRange(0, 3, 0, 3) and torch.equal(got, t)
    v.check_complete()


def test_framed_chunk_is_read_without_copying_the_payload():
    r = ChunkRange(0, 3, 0, 3)
    t = torch.randn(3, 2, 3, 4, 2, 8)
    wire = encode_chunk_message(chunk_header(LAYOUT.to_proto(), r, 10), t)
    rx = decode_server_message(wire)
    assert rx.kind() == "chunk" and rx.payload is not None and rx.payload.obj is wire  # a view, no copy
    assert rx.msg.chunk.data == b"" and rx.msg.chunk.block_end == 3 and rx.msg.chunk.layout.model_revision == "rev1"
    got_r, got = ChunkVerifier(LAYOUT, 10, 3).verify(rx.msg.chunk, rx.payload)
    assert got_r == r and torch.equal(got, t)
    # The same bytes flipped at the payload's last byte: caught by the checksum.
    bad = decode_server_message(wire[:-1] + bytes([wire[-1] ^ 1]))
    with pytest.raises(ChunkError, match="checksum mismatch"):
        ChunkVerifier(LAYOUT, 10, 3).verify(bad.msg.chunk, bad.payload)


def test_generically_serialised_messages_decode_too():
    """Another implementation's protobuf encoder (fields in number order, checksum after data)
    and every non-chunk message go through the same deserializer."""
    msg, t = _chunk(ChunkRange(0, 1, 0, 2))
    wire = kv_pb2.PrefillServerMessage(chunk=msg).SerializeToString()
    rx = decode_server_message(wire)
    assert rx.payload is not None and bytes(rx.payload) == msg.data
    assert torch.equal(ChunkVerifier(LAYOUT, 10, 3).verify(rx.msg.chunk, rx.payload)[1], t)
    done = kv_pb2.PrefillServerMessage(done=kv_pb2.PrefillDone(first_token_id=7, total_bytes=99))
    rx = decode_server_message(done.SerializeToString())
    assert rx.kind() == "done" and rx.payload is None and rx.msg == done
    from google.protobuf.message import DecodeError

    with pytest.raises(DecodeError):
        decode_server_message(b"\x12\x05\x42\xff\xff")  # a chunk whose data length runs past the end


def test_bfloat16_chunks_round_trip():
    lay = KVLayout("m", "r", "bfloat16", 4, 1, 2, 8)
    msg, t = _chunk(ChunkRange(0, 1, 0, 2), layout=lay, dtype=torch.bfloat16)
    _, got = ChunkVerifier(lay, 10, 2).verify(msg)
    assert got.dtype == torch.bfloat16 and torch.equal(got, t)


def test_corrupted_payload_fails_the_checksum():
    msg, _ = _chunk(ChunkRange(0, 1, 0, 1))
    msg.data = bytes([msg.data[0] ^ 0x80]) + msg.data[1:]
    with pytest.raises(ChunkError, match="checksum mismatch"):
        ChunkVerifier(LAYOUT, 10, 3).verify(msg)


def test_accepted_chunk_yields_its_bytes_only_after_the_checksum():
    """accept() checks layout, range and size; the checksum waits for checked_tensor(), which the
    decode worker calls on the engine thread right before the copy, so corrupted bytes never
    reach a block."""
    msg, t = _chunk(ChunkRange(0, 1, 0, 1))
    good = ChunkVerifier(LAYOUT, 10, 3).accept(msg)
    assert good.range == ChunkRange(0, 1, 0, 1) and torch.equal(good.checked_tensor(), t)
    msg.data = msg.data[:-1] + bytes([msg.data[-1] ^ 1])
    bad = ChunkVerifier(LAYOUT, 10, 3).accept(msg)
    with pytest.raises(ChunkError, match="checksum mismatch"):
        bad.checked_tensor()


@pytest.mark.parametrize("field,value", [("dtype", "bfloat16"), ("model_revision", "rev2"), ("block_size", 8),
                                         ("num_kv_heads", 4), ("model_id", "other")])
def test_layout_mismatch_names_the_field(field, value):
    msg, _ = _chunk(ChunkRange(0, 1, 0, 1))
    setattr(msg.layout, field, value)
    with pytest.raises(LayoutMismatchError, match=field):
        ChunkVerifier(LAYOUT, 10, 3).verify(msg)
    with pytest.raises(LayoutMismatchError, match=field):
        check_layout(LAYOUT, KVLayout.from_proto(msg.layout), "test")


def test_bad_ranges_sizes_duplicates_and_gaps_are_errors():
    v = ChunkVerifier(LAYOUT, 10, 3)
    msg, _ = _chunk(ChunkRange(0, 1, 2, 4))  # block 3 of 3
    with pytest.raises(ChunkError, match="outside"):
        v.verify(msg)
    msg, _ = _chunk(ChunkRange(0, 1, 0, 1), num_tokens=11)
    with pytest.raises(ChunkError, match="11 tokens"):
        v.verify(msg)
    msg, _ = _chunk(ChunkRange(0, 1, 0, 1))
    msg.data = msg.data[:-4]
    msg.xxh3_64 = checksum(msg.data)
    with pytest.raises(ChunkError, match="bytes"):
        v.verify(msg)
    msg, _ = _chunk(ChunkRange(0, 2, 0, 2))
    v.verify(msg)
    with pytest.raises(ChunkError, match="overlaps"):
        v.verify(_chunk(ChunkRange(1, 2, 1, 3))[0])
    with pytest.raises(ChunkError, match="never arrived"):
        v.check_complete()


def test_sampling_params_round_trip():
    for p in (SamplingParams(),
              SamplingParams(n=2, max_tokens=None, min_tokens=3, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1,
                             repetition_penalty=1.1, presence_penalty=-0.5, frequency_penalty=0.25, seed=2**40,
                             stop=["a", "bc"], stop_token_ids=[2, 7], ignore_eos=True, logprobs=0,
                             skip_special_tokens=False, include_stop_str_in_output=True,
                             logit_bias={3: -100.0, 300: 2.5})):
        assert params_from_proto(params_to_proto(p)) == p


def test_request_output_round_trip():
    outs = [
        RequestOutput("r", 0, [5, 6], "ab", [TokenLogprob(5, -0.25, [(5, -0.25), (9, -2.0)]),
                                              TokenLogprob(6, -1.5, [])], None, None, 10, 2, 4),
        RequestOutput("r", 1, [], "", None, "stop", "the", 10, 3),
        RequestOutput("r", 0, [2], "", None, "stop", 2, 10, 4),
        RequestOutput("r", 0, [], "", None, "abort", None, 10, 0),
    ]
    for out in outs:
        assert output_from_proto(output_to_proto(out)) == out


def test_lease_deadline_starts_when_the_prefill_is_done():
    table = LeaseTable()
    lease = Lease("l1", "r1", 10)
    table.add(lease)
    lease.renew(0.0)
    assert table.expired(time.monotonic() + 100) == []  # still computing: the stream covers it
    lease.compute_done = True
    lease.renew(1.0)
    assert table.expired() == []
    assert table.expired(time.monotonic() + 2) == [lease]
    assert table.by_request("r1") == [lease]
    table.remove(lease)
    assert len(table) == 0


def test_worker_refuses_a_message_bound_that_cannot_carry_one_block():
    from kvrelay.decode.worker import DecodeWorker
    from kvrelay.engine.async_engine import AsyncEngine
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.kvtransfer.worker_base import WorkerOptions

    with pytest.raises(ValueError, match="raise --max-message-bytes"):
        DecodeWorker(AsyncEngine(EngineArgs(num_kv_blocks=32)), WorkerOptions(max_message_bytes=4200))


def test_workers_keep_large_buffers_mapped_on_glibc():
    """Applied by a CPU LLMEngine and at worker start-up (serve_forever); glibc accepts both settings."""
    import platform

    from kvrelay.engine.malloc_tuning import keep_large_buffers_mapped

    applied = keep_large_buffers_mapped()
    if platform.libc_ver()[0] == "glibc":
        assert applied


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_from_views_of_the_cache_equals_the_gathered_chunk(dtype):
    """The prefill worker encodes CPU chunks from views of its blocks: same bytes as gathering them."""
    from kvrelay.kernels.reference import gather_blocks
    from kvrelay.kvtransfer.chunk_wire import payload_pieces, payload_size

    kv_cache = torch.randn(3, 2, 9, 4, 2, 8).to(dtype)
    blocks = [7, 2, 5]  # not in order, as a block table can be
    r = ChunkRange(1, 3, 0, 3)
    gathered = gather_blocks(kv_cache, torch.tensor(blocks), 1, 3)
    pieces = payload_pieces(kv_cache, blocks, 1, 3)
    assert payload_size(pieces) == payload_size(gathered) == gathered.numel() * gathered.element_size()
    from_views = encode_chunk_message(chunk_header(LAYOUT.to_proto(), r, 10), pieces)
    assert from_views == encode_chunk_message(chunk_header(LAYOUT.to_proto(), r, 10), gathered)
    rx = decode_server_message(from_views)
    assert rx.msg.chunk.xxh3_64 == checksum(gathered.contiguous().view(torch.uint8).numpy())
