"""The persistent input batch: a step's token rows and block tables, built with numpy in
preallocated (pinned, on CUDA) host memory and sent to the device in one non-blocking copy.

Each sequence keeps a row of a host block table for as long as it lives; a step writes only the
block ids appended since the last step (one, when a decode crosses a block boundary), so no step
turns Python lists into tensors. Row contents are trusted until `Sequence.table_epoch` changes:
the scheduler bumps it whenever it frees a sequence's blocks, the only way a table is replaced.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from kvrelay.engine.lora.stacked import step_plan
from kvrelay.engine.model import StepBatch
from kvrelay.engine.multimodal.inputs import image_rows
from kvrelay.engine.multimodal.mrope import rotary_positions
from kvrelay.engine.sequence import Sequence, Status

_ALIGN = 16  # bytes: every typed region starts aligned for int64 views


class BlockTableRows:
    """A host table [capacity, max_blocks] int32 with one row per live sequence."""

    def __init__(self, max_blocks: int, capacity: int = 64):
        self.max_blocks = max_blocks
        self.table = np.zeros((capacity, max_blocks), dtype=np.int32)
        # seq -> [row, table_epoch, blocks written]
        self._rows: dict[Sequence, list[int]] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def row(self, seq: Sequence) -> int:
        """seq's row, brought up to date with seq.block_table."""
        entry = self._rows.get(seq)
        if entry is None:
            entry = self._rows[seq] = [self._take_row(), seq.table_epoch, 0]
        table = seq.block_table
        if entry[1] != seq.table_epoch or entry[2] > len(table):
            entry[1], entry[2] = seq.table_epoch, 0
        written = entry[2]
        if written < len(table):
            if len(table) > self.max_blocks:
                raise ValueError(f"sequence holds {len(table)} blocks, more than max_model_len allows")
            if len(table) - written == 1:
                self.table[entry[0], written] = table[written]
            else:
                self.table[entry[0], written : len(table)] = table[written:]
            entry[2] = len(table)
        return entry[0]

    def _take_row(self) -> int:
        if not self._free:
            self._sweep()
        if not self._free:  # every row live: grow
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    def _sweep(self) -> None:
        """Give back rows of sequences that finished (or wait, preempted: rewritten on return)."""
        for seq in [s for s in self._rows if s.status in (Status.FINISHED, Status.WAITING)]:
            self._free.append(self._rows.pop(seq)[0])

    def __len__(self) -> int:
        return len(self._rows)


class Staging:
    """One host byte buffer carved into typed regions per step, and its device twin."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device = device
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.host_np = self.host.numpy()
        # On CPU the step reads the host buffer itself: nothing to send.
        self.dev = self.host if device.type == "cpu" else torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.used = 0

    def reset(self) -> None:
        self.used = 0

    def take(self, count: int, dtype: np.dtype) -> tuple[np.ndarray, int]:
        """A host region of count elements, and its byte offset."""
        dtype = np.dtype(dtype)
        offset = self.used
        end = offset + count * dtype.itemsize
        if end > self.host_np.shape[0]:
            raise ValueError(f"step inputs need {end} bytes, more than the {self.host_np.shape[0]} reserved")
        self.used = -(-end // _ALIGN) * _ALIGN
        return self.host_np[offset:end].view(dtype), offset

    def send(self) -> None:
        if self.dev is not self.host:
            self.dev[: self.used].copy_(self.host[: self.used], non_blocking=True)

    def device_view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        count = 1
        for n in shape:
            count *= n
        return self.dev[offset : offset + count * dtype.itemsize].view(dtype).view(shape)


@dataclass
class BuiltStep:
    batch: StepBatch
    sample_idx: list[int]  # positions in the scheduled list of sequences that sample a token
    num_real: int  # decode rows before padding (graph steps); all rows otherwise
    logits_rows: list[int]  # per sampling sequence, its rows of logits (1; every token's for all_logits)
    # Prompt logprobs: (index in seqs, first position, rows) of prefill chunks whose positions that
    # predict a prompt token get logits too, after the sampling rows.
    prompt_spans: list[tuple[int, int, int]] = field(default_factory=list)
    # Overlapped steps: per decode row, the index of its input token in the previous step's sampled
    # tokens (still on the device), or -1 where the host wrote the id; None when no row has one.
    token_src: torch.Tensor | None = None


class InputBatch:
    """Builds StepBatch for the scheduled sequences: decodes first, then packed prefill chunks."""

    def __init__(self, block_size: int, max_model_len: int, max_num_seqs: int, max_num_tokens: int,
                 device: torch.device):
        self.bs = block_size
        self.device = device
        self.max_blocks = -(-max_model_len // block_size)
        self.tables = BlockTableRows(self.max_blocks, capacity=max(64, max_num_seqs))
        rows = max_num_seqs
        nbytes = 8 * (5 * max_num_tokens + rows) + 4 * (rows * self.max_blocks + 3 * rows + 2) + 16 * _ALIGN
        # Two, used in turn: with steps overlapped (async scheduling) the host builds step N+1
        # while step N's copy may still be queued behind step N-1 on the device. The engine waits
        # for step N-1 before it builds N+1, so the buffer N+1 reuses is free.
        self._stagings = [Staging(nbytes, device), Staging(nbytes, device)]
        self._turn = 0

    def build(self, seqs: list[Sequence], num_new: list[int], pad_decode_to: int | None = None,
              all_logits: frozenset[int] = frozenset(), prompt_rows: frozenset[int] = frozenset(),
              token_src: dict[int, int] | None = None, adapters: list[int] | None = None,
              images: list[int] | None = None, rope: list[int] | None = None) -> BuiltStep:
        """pad_decode_to: a decode-only step padded to this many rows (CUDA graph buckets); padding
        rows write no K/V (slot -1) and attend to nothing (length 0). all_logits: indices of seqs
        whose every new token gets a row of logits (speculative verification), not only the last.
        token_src: index in seqs -> index in the previous step's sampled tokens, for decodes whose
        input token the host does not know yet (see BuiltStep.token_src). adapters: per sequence of
        seqs, its LoRA adapter's index or -1 (StepBatch.lora); None when none has one. images: indices
        of seqs whose chunk may hold image placeholders (features made: StepBatch.images). rope:
        indices of seqs with M-RoPE positions (kvrelay.engine.multimodal.mrope)."""
        bs = self.bs
        # Decode rows: single-token decodes, and the short extend chunks of speculative verification
        # (all_logits), one row per token: the row at position p attends to the cache up to p, which
        # the step has written by then. So verification runs the batched decode kernel, not a
        # prefill kernel launched per tiny chunk.
        dec, pre = [], []
        for i, n in enumerate(num_new):
            (dec if n == 1 or i in all_logits else pre).append(i)
        if not all_logits:
            nd = len(dec)
            counts_dec = None
            rows_dec = np.fromiter((self.tables.row(seqs[i]) for i in dec), dtype=np.int64, count=nd)
            pos_dec = np.fromiter((seqs[i].num_computed for i in dec), dtype=np.int64, count=nd)
            ids_dec = np.fromiter((seqs[i].token_ids[seqs[i].num_computed] for i in dec), dtype=np.int64,
                                  count=nd)
        else:
            counts_dec = np.fromiter((num_new[i] for i in dec), dtype=np.int64, count=len(dec))
            nd = int(counts_dec.sum())
            rows_dec = np.repeat(np.fromiter((self.tables.row(seqs[i]) for i in dec), dtype=np.int64,
                                             count=len(dec)), counts_dec)
            starts = np.fromiter((seqs[i].num_computed for i in dec), dtype=np.int64, count=len(dec))
            first = np.cumsum(counts_dec) - counts_dec
            pos_dec = np.repeat(starts, counts_dec) + (np.arange(nd) - np.repeat(first, counts_dec))
            ids_dec = np.fromiter(
                (t for i in dec for t in seqs[i].token_ids[seqs[i].num_computed : seqs[i].num_computed + num_new[i]]),
                dtype=np.int64, count=nd)
        pad = 0 if pad_decode_to is None else pad_decode_to - nd
        if pad < 0 or pad and pre:
            raise ValueError("only a decode-only step is padded, and never to fewer rows than it has")

        # Prefill chunks: token rows packed one sequence after another.
        pre_rows = [self.tables.row(seqs[i]) for i in pre]
        pre_starts = np.fromiter((seqs[i].num_computed for i in pre), dtype=np.int64, count=len(pre))
        pre_counts = np.fromiter((num_new[i] for i in pre), dtype=np.int64, count=len(pre))
        num_pre_tokens = int(pre_counts.sum())
        total = nd + pad + num_pre_tokens

        st = self._stagings[self._turn]
        self._turn ^= 1
        st.reset()
        tok, tok_off = st.take(3 * total, np.int64)
        ids, positions, slots = tok[:total], tok[total : 2 * total], tok[2 * total :]
        ids[:nd], positions[:nd] = ids_dec, pos_dec
        tables = self.tables.table
        if nd:
            slots[:nd] = tables[rows_dec, pos_dec // bs].astype(np.int64) * bs + pos_dec % bs
        if pad:
            ids[nd : nd + pad] = 0
            positions[nd : nd + pad] = 0
            slots[nd : nd + pad] = -1
        if pre:
            seq_of_token = np.repeat(np.arange(len(pre)), pre_counts)
            first = np.cumsum(pre_counts) - pre_counts
            pos = pre_starts[seq_of_token] + (np.arange(num_pre_tokens) - first[seq_of_token])
            positions[nd:] = pos
            row_of_token = np.asarray(pre_rows, dtype=np.int64)[seq_of_token]
            slots[nd:] = tables[row_of_token, pos // bs].astype(np.int64) * bs + pos % bs
            ids[nd:] = np.concatenate(
                [seqs[i].token_ids[s : s + c] for i, s, c in zip(pre, pre_starts.tolist(), pre_counts.tolist())]
            )

        # Rows whose step reaches the last known token sample the next one; a prefill row's logits
        # come from its chunk's last token.
        sample_idx, logits_rows, rows_per_sample = [], [], []
        if counts_dec is None:
            for r, i in enumerate(dec):
                if seqs[i].num_computed + 1 == len(seqs[i].token_ids):
                    sample_idx.append(i)
                    logits_rows.append(r)
            rows_per_sample = [1] * len(sample_idx)
        else:
            end = 0
            for i, n in zip(dec, counts_dec.tolist()):
                end += n
                if seqs[i].num_computed + n == seqs[i].num_tokens:
                    sample_idx.append(i)
                    count = n if i in all_logits else 1
                    logits_rows.extend(range(end - count, end))
                    rows_per_sample.append(count)
        ends = (nd + pad + np.cumsum(pre_counts) - 1).tolist()
        for k, i in enumerate(pre):
            if seqs[i].num_computed + num_new[i] == seqs[i].num_tokens:
                sample_idx.append(i)
                count = num_new[i] if i in all_logits else 1
                logits_rows.extend(range(ends[k] - count + 1, ends[k] + 1))
                rows_per_sample.append(count)
        prompt_spans = []
        for k, i in enumerate(pre):
            if i in prompt_rows:  # positions p of the chunk with a prompt token at p + 1
                start, count = int(pre_starts[k]), num_new[i]
                n = min(start + count, seqs[i].prompt_len - 1) - start
                if n > 0:
                    first_row = ends[k] - count + 1
                    logits_rows.extend(range(first_row, first_row + n))
                    prompt_spans.append((i, start, n))
        num_logits = len(logits_rows) + pad
        lg, lg_off = st.take(num_logits, np.int64)
        lg[: len(logits_rows)] = logits_rows
        if pad:
            lg[len(logits_rows) :] = np.arange(nd, nd + pad)

        rows_d = nd + pad
        wd = max((len(seqs[i].block_table) for i in dec), default=0)  # rows may repeat a sequence
        wp = max((len(seqs[i].block_table) for i in pre), default=0)
        dbt, dbt_off = st.take(rows_d * wd, np.int32)
        dbt = dbt.reshape(rows_d, wd)
        if nd and wd:
            dbt[:nd] = tables[rows_dec, :wd]
        if pad and wd:
            dbt[nd:] = 0
        dlen, dlen_off = st.take(rows_d, np.int32)
        dlen[:nd] = pos_dec + 1
        dlen[nd:] = 0
        pbt, pbt_off = st.take(len(pre) * wp, np.int32)
        if pre and wp:
            pbt.reshape(len(pre), wp)[:] = tables[np.asarray(pre_rows), :wp]
        pqsl, pqsl_off = st.take(len(pre) + 1, np.int32)
        pqsl[0] = 0
        pqsl[1:] = np.cumsum(pre_counts)
        plen, plen_off = st.take(len(pre), np.int32)
        plen[:] = pre_starts + pre_counts
        first_row = {}
        if images or rope:  # each scheduled sequence's first row in the step
            dec_first = range(len(dec)) if counts_dec is None else (np.cumsum(counts_dec) - counts_dec).tolist()
            first_row = dict(zip(dec, dec_first)) | dict(zip(pre, (nd + pad + np.cumsum(pre_counts) - pre_counts).tolist()))
        if rope:  # before the send: the rows' positions become rotary positions
            rotary_positions(positions, [(seqs[i].images, seqs[i].num_computed, num_new[i], first_row[i]) for i in rope])
        src_off = None
        if token_src:
            if all_logits:
                raise ValueError("an overlapped step carries no speculative verification")
            src, src_off = st.take(nd, np.int64)
            src[:] = np.fromiter((token_src.get(i, -1) for i in dec), dtype=np.int64, count=nd)
        st.send()

        v = st.device_view
        tok_dev = v(tok_off, (3, total), torch.int64)
        batch = StepBatch(
            input_ids=tok_dev[0],
            positions=tok_dev[1],
            slot_mapping=tok_dev[2],
            num_decode=rows_d,
            decode_block_tables=v(dbt_off, (rows_d, wd), torch.int32),
            decode_seq_lens=v(dlen_off, (rows_d,), torch.int32),
            prefill_block_tables=v(pbt_off, (len(pre), wp), torch.int32),
            prefill_query_start_loc=v(pqsl_off, (len(pre) + 1,), torch.int32),
            prefill_seq_lens=v(plen_off, (len(pre),), torch.int32),
            logits_indices=v(lg_off, (num_logits,), torch.int64),
            prefill_fresh_max_len=int(pre_counts.max()) if pre and not pre_starts.any() else 0,
        )
        if adapters is not None:
            per_seq = np.asarray(adapters, dtype=np.int64)
            per_token = np.concatenate([np.repeat(per_seq[dec], 1 if counts_dec is None else counts_dec),
                                        np.full(pad, -1, dtype=np.int64), np.repeat(per_seq[pre], pre_counts)])
            batch.lora = step_plan(per_token, self.device)
        if images:
            batch.images = image_rows([(seqs[i].images, seqs[i].num_computed, num_new[i], first_row[i])
                                       for i in images], self.device)
        src_dev = None if src_off is None else v(src_off, (nd,), torch.int64)
        return BuiltStep(batch, sample_idx, nd, rows_per_sample, prompt_spans, src_dev)
