"""Grammar compilation with llguidance, cached per spec.

Why llguidance (not xgrammar): it builds its tokenizer straight from the tokenizer.json text the
engine already reads (no transformers at run time: xgrammar's tokenizer info wants a transformers
tokenizer), compiles lazily (a new schema costs well under a millisecond to start, the mask work is
spread over the steps, so no request waits on a full ahead-of-time compile), covers JSON Schema
widely, and takes Lark and GBNF grammars, regexes and choices through one entry point
(`llguidance.grammar_from`). Compiled matchers are cached per (kind, value) and each sequence gets a
`deep_copy()` of the cached one.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict

from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.structured.spec import KINDS, MAX_SPEC_BYTES, GuidedSpec

CACHE_ENTRIES = 256
# JSON as json.dumps writes it: no free whitespace between tokens, so a model (a small one above all)
# cannot spend its max_tokens on newlines; a schema's own "x-guidance" options still override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_FORMATS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # kvrelay Tokenizer -> LLTokenizer
_tokenizers_lock = threading.Lock()


def _bad(spec: GuidedSpec, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{spec.field}: {message}", field=spec.field)


def ll_tokenizer(tokenizer, eos_ids: tuple[int, ...] = ()):
    """One llguidance tokenizer per kvrelay Tokenizer and EOS set (building one scans the vocabulary)."""
    import llguidance

    with _tokenizers_lock:
        per_tok = _tokenizers.setdefault(tokenizer, {})
        ll = per_tok.get(eos_ids)
        if ll is None:
            eos = list(eos_ids) or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None)
            ll = per_tok[eos_ids] = llguidance.LLTokenizer(tokenizer._tk.to_str(), n_vocab=tokenizer.vocab_size,
                                                           eos_token=eos)
        return ll


def grammar_text(spec: GuidedSpec) -> str:
    """The llguidance grammar for spec; raises InvalidRequestError naming spec.field."""
    import llguidance

    if spec.kind not in KINDS:
        raise _bad(spec, f"unknown constraint kind {spec.kind!r}; one of {sorted(KINDS)}")
    if len(spec.value.encode()) > MAX_SPEC_BYTES:
        raise _bad(spec, f"{len(spec.value.encode())} bytes, at most {MAX_SPEC_BYTES}")
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if spec.kind in ("json", "choice"):
        try:
            value = json.loads(spec.value)
        except json.JSONDecodeError as e:
            raise _bad(spec, f"not valid JSON: {e}") from e
        if spec.kind == "json" and not isinstance(value, (dict, bool)):
            raise _bad(spec, "a JSON schema must be an object")
        if spec.kind == "choice" and (not isinstance(value, list) or not value
                                      or not all(isinstance(c, str) and c for c in value)):
            raise _bad(spec, "must be a non-empty list of non-empty strings")
    try:
        if spec.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS)
        return llguidance.grammar_from(_FORMATS[spec.kind], spec.value)
    except BaseException as e:  # a Rust panic arrives as a BaseException (pyo3)
        _reraise_fatal(e)
        raise _bad(spec, f"rejected by the grammar compiler: {_first_line(str(e))}") from e


class GrammarCompiler:
    """Compiled matchers per spec for one tokenizer and EOS set; thread-safe (compiles run off the
    engine thread: AsyncEngine awaits `get` in a worker thread before the request reaches the engine)."""

    def __init__(self, tokenizer, eos_ids: tuple[int, ...] = ()):
        self.tokenizer = tokenizer
        self.eos_ids = tuple(sorted(eos_ids))
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # cache misses (a test reads it)

    def get(self, spec: GuidedSpec):
        """The cached, never-advanced matcher of spec (compiled on a miss). Copy before use."""
        key = spec.key()
        with self._lock:
            matcher = self._cache.get(key)
            if matcher is not None:
                self._cache.move_to_end(key)
                return matcher
        import llguidance

        grammar = grammar_text(spec)
        try:
            matcher = llguidance.LLMatcher(ll_tokenizer(self.tokenizer, self.eos_ids), grammar, log_level=0)
        except BaseException as e:  # a Rust panic arrives as a BaseException (pyo3)
            _reraise_fatal(e)
            raise _bad(spec, f"rejected by the grammar compiler: {_first_line(str(e))}") from e
        if matcher.is_error():
            raise _bad(spec, f"rejected by the grammar compiler: {_first_line(matcher.get_error())}")
        with self._lock:
            self._cache[key] = matcher
            self.compiled += 1
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, spec: GuidedSpec):
        """A fresh matcher for one sequence."""
        return self.get(spec).deep_copy()


def _reraise_fatal(e: BaseException) -> None:
    if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit, MemoryError)) or type(e).__name__ == "CancelledError":
        raise e


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " ".join(lines[:3])[:500] if lines else "invalid grammar"


_compilers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiler_for(tokenizer, eos_ids: tuple[int, ...] = ()) -> GrammarCompiler:
    """The shared compiler of a tokenizer (the gateway's validation and the engine share it in `serve`)."""
    with _tokenizers_lock:
        per_tok = _compilers.setdefault(tokenizer, {})
        key = tuple(sorted(eos_ids))
        if key not in per_tok:
            per_tok[key] = GrammarCompiler(tokenizer, key)
        return per_tok[key]
