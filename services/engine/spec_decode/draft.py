"""Draft-model proposals: a smaller model with the target's vocabulary proposes K tokens for every
speculating sequence, greedily, in one batched loop of K forwards.

The draft's paged KV cache has the target's block count and is indexed by the target's block
tables: a sequence's blocks hold the target's K/V in the target cache and the draft's in the draft
cache, so the one block manager sizes and frees both, and preemption or a finished request frees
draft K/V with no bookkeeping of its own. What the draft tracks is only how far its own K/V is
valid per sequence (`_DraftView.num_computed`): proposals it fed itself stay valid when the target
accepts them, and are rewritten on the next step when rejected.

Proposals are the draft's argmax, so q is one-hot and verify.py's rule (accept d with p(d), else
draw from p without d) keeps sampling lossless at any temperature. For a sequence with a grammar
the argmax is taken over the tokens the grammar allows: a fork of its matcher follows the draft's
own proposals and masks each row (one mask per proposed token, as the target's verification
computes them), so the proposals are grammar-valid and are not cut at the first token the draft
would have got wrong syntactically. After a token that completes the grammar, one more proposal
(EOS, all the mask allows) ends the sequence's draft.
"""

from __future__ import annotations

from pathlib import Path

import torch
from kvrelay.engine import architectures
from kvrelay.engine.errors import ModelLoadError
from kvrelay.engine.model import DecoderModel
from kvrelay.engine.model_config import ModelConfig, load_model_config
from kvrelay.engine.runner.model_runner import ModelRunner
from kvrelay.engine.sequence import Sequence
from kvrelay.engine.structured.mask import mask_rows
from kvrelay.engine.tokenizer import Tokenizer
from kvrelay.engine.weights import assemble, pack_linears, read_tensors


def kv_bytes_per_block(config: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize


def load_draft_config(model_dir: str | Path, target: ModelConfig, target_tokenizer: Tokenizer) -> ModelConfig:
    """The draft's config, checked against the target: the verifier compares token ids, so the two
    must share a vocabulary (and a tokenizer, where the draft folder carries one)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"--speculative-model {model_dir}: model folder not found")
    config = load_model_config(model_dir)
    if config.vocab_size != target.vocab_size:
        raise ModelLoadError(
            f"--speculative-model {model_dir}: its vocabulary has {config.vocab_size} tokens, the target's "
            f"{target.vocab_size}; a draft must share the target's tokenizer and vocabulary"
        )
    if (model_dir / "tokenizer.json").is_file() and Tokenizer(model_dir).vocab() != target_tokenizer.vocab():
        raise ModelLoadError(
            f"--speculative-model {model_dir}: its tokenizer maps tokens to other ids than the target's; "
            "a draft must share the target's tokenizer"
        )
    return config


class _DraftView:
    """A sequence as the draft's input builder sees it: the target's tokens and block table, and
    the draft's own progress through them."""

    __slots__ = ("epoch", "num_computed", "seq")

    def __init__(self, seq: Sequence):
        self.seq = seq
        self.num_computed = 0
        self.epoch = seq.table_epoch

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.seq.token_ids)

    @property
    def block_table(self) -> list[int]:
        return self.seq.block_table

    @property
    def table_epoch(self) -> int:
        return self.seq.table_epoch

    @property
    def status(self):
        return self.seq.status


class DraftModel:
    def __init__(self, model_dir: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 ops, max_model_len: int):
        """Loads the weights (before the KV cache is planned, so the plan counts them)."""
        if config.max_context < max_model_len:
            raise ModelLoadError(
                f"--speculative-model {model_dir}: its context ({config.max_context} tokens) is shorter than the "
                f"target's max_model_len {max_model_len}; lower --max-model-len"
            )
        tensors = read_tensors(Path(model_dir), config, dtype)
        weights = assemble(config, {k: v.to(device) for k, v in tensors.items()})
        pack_linears(weights, ops.prepack_linear)
        build_model = architectures.get(config.architecture).build_model or DecoderModel
        self.model = build_model(config, weights, ops, max_model_len)
        self.config = config
        self.dtype, self.device, self.max_model_len = dtype, device, max_model_len
        self._views: dict[Sequence, _DraftView] = {}

    def allocate(self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 cuda_graphs: bool = False) -> None:
        """The draft's KV cache, indexed by the target's block ids, and its model runner (decode
        CUDA graphs where the target has them: the draft's K forwards are decode-only but the first)."""
        c = self.config
        shape = (c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.budget = max_num_batched_tokens
        self.runner = ModelRunner(self.model, self.kv_cache, block_size, self.max_model_len, max_num_seqs,
                                  max_num_batched_tokens)
        if cuda_graphs:
            self.runner.capture_graphs()

    def _view(self, seq: Sequence) -> _DraftView:
        view = self._views.get(seq)
        # New blocks (preempted and recomputed): the draft's K/V there is someone else's.
        if view is None or view.epoch != seq.table_epoch:
            view = self._views[seq] = _DraftView(seq)
        return view

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] greedy draft tokens for each seqs[i], whose last token the target has not
        computed yet. The draft first catches up on tokens it has not seen (the whole prompt, the
        first time) within its token budget; a sequence whose catch-up does not fit gets a chunk of
        it and no proposal this step."""
        views = [self._view(s) for s in seqs]
        out: list[list[int]] = [[] for _ in seqs]
        # The matchers of constrained sequences, forked: they follow the proposals (callers have
        # synced each grammar with its sequence's output).
        forks = {i: s.grammar.fork() for i, s in enumerate(seqs) if s.grammar is not None}
        ended: set[int] = set()  # constrained sequences whose last proposal completed the grammar
        active, num_new, room = [], [], self.budget
        for i, view in enumerate(views):
            if room <= 0:
                break
            n = min(view.num_tokens - view.num_computed, room)  # >= 1: at least the pending token
            active.append(i)
            num_new.append(n)
            room -= n
        while active:
            logits, sample_idx, _ = self.runner.execute([views[i] for i in active], num_new)
            masked = [(row, active[j]) for row, j in enumerate(sample_idx) if active[j] in forks]
            if masked:
                mask_rows(logits, [row for row, _ in masked], [forks[i] for _, i in masked],
                          [seqs[i].stop_ids for _, i in masked], seqs[masked[0][1]].grammar.vocab)
            best = logits.argmax(dim=-1).tolist() if sample_idx else []  # one small copy per forward
            for j, i in enumerate(active):
                views[i].num_computed += num_new[j]
            for row, j in enumerate(sample_idx):  # the sequences whose input reached the end
                i = active[j]
                out[i].append(best[row])
                seqs[i].token_ids.append(best[row])  # the next forward feeds it
                fork = forks.get(i)
                if fork is not None and (fork.is_stopped() or fork.try_consume_tokens([best[row]]) != 1):
                    ended.add(i)
            active = [i for i in active if 0 < len(out[i]) < ks[i] and i not in ended]
            num_new = [1] * len(active)
        for seq, proposal in zip(seqs, out):
            if proposal:
                del seq.token_ids[-len(proposal) :]
        # The last proposal of each was never fed: the draft's K/V ends one token before it.
        if len(self._views) > 4 * len(self.runner.inputs.tables.table):
            self._views = {s: v for s, v in self._views.items() if not s.finished}
        return out

    def rollback(self, seq: Sequence, valid_tokens: int) -> None:
        """After verification: the draft's K/V is valid for the first valid_tokens tokens only."""
        view = self._views.get(seq)
        if view is not None and view.num_computed > valid_tokens:
            view.num_computed = valid_tokens
