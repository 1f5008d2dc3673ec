"""Workloads for `kvrelay bench`: what each request asks, before any load shape is applied.

Every dataset yields Sessions. A Session is one request for the single-shot datasets (random,
sharegpt, prefix, jsonl) and several turns for `conversation`, whose turns run in order, each
resending the history with the server's earlier replies. Prompt lengths are counted with a
tokenizer when a model folder is given (see client.py); else the server's `usage` gives them.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

DATASETS = ("random", "sharegpt", "prefix", "conversation", "jsonl")

# Without a tokenizer, synthetic text is drawn from plain words (about one token each for
# English tokenizers); the true counts then come from the server's usage.
_WORD_TEXT = """
the a cat dog sun tree house river bird little big happy sad girl boy mom dad friend play run
jump see look find ball red blue green small tall day night park sky rain snow cake milk book
toy car walk talk smile laugh sing song star moon fish boat hill road door window garden flower
cloud wind went saw said was had one two three very good new old warm cold fast slow kind brave
quiet loud
"""
WORDS = tuple(_WORD_TEXT.split())


@dataclass
class Turn:
    text: str  # the user's message (the prompt, for a single-shot request)
    output_len: int | None  # max_tokens to ask for; None: the server's default


@dataclass
class Session:
    turns: list[Turn]
    system: str | None = None  # a shared system prompt (the prefix dataset)
    index: int = 0


@dataclass
class DatasetConfig:
    name: str = "random"
    path: str | None = None
    num_prompts: int = 100
    seed: int = 0
    random_input_len: int = 128
    random_output_len: int = 32
    random_range_ratio: float = 0.0
    sharegpt_output_len: int | None = None
    prefix_len: int = 256
    suffix_len: int = 32
    num_prefixes: int = 4
    prefix_output_len: int = 32
    num_turns: int = 3
    turn_len: int = 32
    turn_output_len: int = 32
    jsonl_output_len: int = 128
    extra: dict = field(default_factory=dict)


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    d = DatasetConfig()
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset", "--dataset-name", dest="dataset", default=d.name, choices=DATASETS)
    g.add_argument(
        "--dataset-path", default=None, help="local file of the sharegpt/jsonl/conversation dataset"
    )
    g.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"requests to send (conversation: sessions); default {d.num_prompts}, or unlimited "
        "with --duration",
    )
    g.add_argument("--seed", type=int, default=d.seed, help="seed of lengths, texts, arrivals and tenants")
    g.add_argument("--random-input-len", type=int, default=d.random_input_len)
    g.add_argument("--random-output-len", type=int, default=d.random_output_len)
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=d.random_range_ratio,
        help="lengths uniform in [len*(1-r), len*(1+r)]",
    )
    g.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="max_tokens of every sharegpt request (default: the recorded reply's length)",
    )
    g.add_argument("--prefix-repetition-prefix-len", dest="prefix_len", type=int, default=d.prefix_len)
    g.add_argument("--prefix-repetition-suffix-len", dest="suffix_len", type=int, default=d.suffix_len)
    g.add_argument("--prefix-repetition-num-prefixes", dest="num_prefixes", type=int, default=d.num_prefixes)
    g.add_argument(
        "--prefix-repetition-output-len", dest="prefix_output_len", type=int, default=d.prefix_output_len
    )
    g.add_argument("--num-turns", type=int, default=d.num_turns, help="conversation: turns per session")
    g.add_argument(
        "--turn-len", type=int, default=d.turn_len, help="conversation: words per synthetic user turn"
    )
    g.add_argument(
        "--turn-output-len", type=int, default=d.turn_output_len, help="conversation: max_tokens per turn"
    )
    g.add_argument(
        "--jsonl-output-len",
        type=int,
        default=d.jsonl_output_len,
        help="jsonl: max_tokens of lines that give no output_len",
    )


def config_from_args(args: argparse.Namespace, num_prompts: int) -> DatasetConfig:
    return DatasetConfig(
        name=args.dataset,
        path=args.dataset_path,
        num_prompts=num_prompts,
        seed=args.seed,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        sharegpt_output_len=args.sharegpt_output_len,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        num_prefixes=args.num_prefixes,
        prefix_output_len=args.prefix_output_len,
        num_turns=args.num_turns,
        turn_len=args.turn_len,
        turn_output_len=args.turn_output_len,
        jsonl_output_len=args.jsonl_output_len,
    )


class TextMaker:
    """Synthetic text of a given length: token-exact with a tokenizer, else in words."""

    def __init__(self, tokenizer, rng: random.Random):
        self.tok = tokenizer
        self.rng = rng
        if tokenizer is not None:
            special = set(tokenizer.special_ids) | {tokenizer.bos_token_id, tokenizer.eos_token_id}
            # Word-like ids decode to text that re-encodes to about as many ids.
            self.ids = [
                i
                for i in range(tokenizer.vocab_size)
                if i not in special and (tokenizer.id_to_token(i) or "").lstrip("▁Ġ").isalpha()
            ]

    def make(self, length: int) -> str:
        if self.tok is None:
            return " ".join(self.rng.choice(WORDS) for _ in range(max(1, length)))
        ids = [self.rng.choice(self.ids) for _ in range(max(1, length))]
        text = self.tok.decode(ids)
        for _ in range(4):  # trim until the text re-encodes to at most `length` tokens
            over = len(self.tok.encode(text, add_special_tokens=False)) - length
            if over <= 0:
                break
            ids = ids[: max(1, len(ids) - over)]
            text = self.tok.decode(ids)
        return text


def _lengths(rng: random.Random, mean: int, ratio: float) -> int:
    low, high = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    return rng.randint(low, high)


def _random(cfg: DatasetConfig, text: TextMaker, rng: random.Random) -> list[Session]:
    return [
        Session(
            [
                Turn(
                    text.make(_lengths(rng, cfg.random_input_len, cfg.random_range_ratio)),
                    _lengths(rng, cfg.random_output_len, cfg.random_range_ratio),
                )
            ]
        )
        for _ in range(cfg.num_prompts)
    ]


def _prefix(cfg: DatasetConfig, text: TextMaker, rng: random.Random) -> list[Session]:
    """N shared system prompts x M suffixes each, shuffled: measures prefix caching and routing."""
    if cfg.num_prefixes < 1:
        raise ValueError("--prefix-repetition-num-prefixes: must be at least 1")
    prefixes = [text.make(cfg.prefix_len) for _ in range(cfg.num_prefixes)]
    sessions = [
        Session([Turn(text.make(cfg.suffix_len), cfg.prefix_output_len)], system=prefixes[i % len(prefixes)])
        for i in range(cfg.num_prompts)
    ]
    rng.shuffle(sessions)
    return sessions


def _read_records(path: str | None, dataset: str) -> list:
    if not path:
        raise ValueError(f"--dataset-path: the {dataset} dataset reads a local file; none given")
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--dataset-path: {path} is not a file")
    raw = p.read_text()
    try:
        if raw.lstrip().startswith("["):
            return json.loads(raw)
        return [json.loads(line) for line in raw.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise ValueError(f"--dataset-path: {path} is neither a JSON list nor JSON lines ({e})") from e


def _sharegpt_turns(record) -> list[tuple[str, str | None]]:
    """[(human text, recorded reply or None)] of one ShareGPT conversation."""
    convo = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(convo, list):
        return []
    pairs, pending = [], None
    for msg in convo:
        who, value = msg.get("from"), msg.get("value")
        if not isinstance(value, str) or not value.strip():
            continue
        if who in ("human", "user"):
            if pending is not None:
                pairs.append((pending, None))
            pending = value
        elif who in ("gpt", "assistant") and pending is not None:
            pairs.append((pending, value))
            pending = None
    return pairs


def _reply_len(tokenizer, reply: str | None, override: int | None) -> int | None:
    if override is not None:
        return override
    if reply is None:
        return None
    if tokenizer is not None:
        return max(1, len(tokenizer.encode(reply, add_special_tokens=False)))
    return max(1, math.ceil(len(reply) / 4))  # the usual ~4 characters per token


def _sharegpt(cfg: DatasetConfig, tokenizer, rng: random.Random) -> list[Session]:
    records = [r for r in _read_records(cfg.path, "sharegpt") if _sharegpt_turns(r)]
    if not records:
        raise ValueError(
            f"--dataset-path: {cfg.path} holds no ShareGPT conversation with a human turn "
            '(expected [{"conversations": [{"from": "human", "value": ...}, ...]}])'
        )
    rng.shuffle(records)
    sessions = []
    for i in range(cfg.num_prompts):
        prompt, reply = _sharegpt_turns(records[i % len(records)])[0]
        sessions.append(Session([Turn(prompt, _reply_len(tokenizer, reply, cfg.sharegpt_output_len))]))
    return sessions


def _conversation(cfg: DatasetConfig, text: TextMaker, tokenizer, rng: random.Random) -> list[Session]:
    """Multi-turn sessions: from a ShareGPT file's human turns when given, else synthetic."""
    if cfg.path:
        convos = [t for t in map(_sharegpt_turns, _read_records(cfg.path, "conversation")) if t]
        if not convos:
            raise ValueError(f"--dataset-path: {cfg.path} holds no ShareGPT conversation with a human turn")
        return [
            Session(
                [
                    Turn(q, _reply_len(tokenizer, a, cfg.turn_output_len))
                    for q, a in convos[i % len(convos)][: cfg.num_turns]
                ]
            )
            for i in range(cfg.num_prompts)
        ]
    return [
        Session([Turn(text.make(cfg.turn_len), cfg.turn_output_len) for _ in range(cfg.num_turns)])
        for _ in range(cfg.num_prompts)
    ]


def _jsonl(cfg: DatasetConfig) -> list[Session]:
    """Lines of {"prompt": ..., "output_len": n} (or a bare JSON string); cycled to --num-prompts."""
    turns = []
    for n, rec in enumerate(_read_records(cfg.path, "jsonl"), 1):
        if isinstance(rec, str):
            rec = {"prompt": rec}
        prompt = rec.get("prompt") if isinstance(rec, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f'--dataset-path: {cfg.path} record {n}: needs a non-empty string "prompt"')
        out = rec.get("output_len", rec.get("max_tokens", cfg.jsonl_output_len))
        if not isinstance(out, int) or out < 1:
            raise ValueError(f"--dataset-path: {cfg.path} record {n}: output_len must be a positive integer")
        turns.append(Turn(prompt, out))
    if not turns:
        raise ValueError(f"--dataset-path: {cfg.path} holds no prompt")
    return [Session([turns[i % len(turns)]]) for i in range(cfg.num_prompts)]


def load_dataset(cfg: DatasetConfig, tokenizer=None) -> list[Session]:
    """The dataset's sessions, in the order they are sent; seeded, so a run can be repeated."""
    rng = random.Random(cfg.seed)
    text = TextMaker(tokenizer, rng)
    if cfg.num_prompts < 1:
        raise ValueError("--num-prompts: must be at least 1")
    if cfg.name == "random":
        sessions = _random(cfg, text, rng)
    elif cfg.name == "prefix":
        sessions = _prefix(cfg, text, rng)
    elif cfg.name == "sharegpt":
        sessions = _sharegpt(cfg, tokenizer, rng)
    elif cfg.name == "conversation":
        sessions = _conversation(cfg, text, tokenizer, rng)
    elif cfg.name == "jsonl":
        sessions = _jsonl(cfg)
    else:
        raise ValueError(f"--dataset: unknown dataset {cfg.name!r}; choose from {', '.join(DATASETS)}")
    for i, s in enumerate(sessions):
        s.index = i
    return sessions


def load_tokenizer(path: str | None):
    """kvrelay's Tokenizer of a model folder, or None without one."""
    if not path:
        return None
    from kvrelay.engine.tokenizer import Tokenizer

    try:
        return Tokenizer(Path(path))
    except Exception as e:
        raise ValueError(f"--tokenizer: cannot load a tokenizer from {path}: {e}") from e
