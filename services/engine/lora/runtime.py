"""Loading and unloading LoRA adapters while the engine serves (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter), in one process. Both run on the engine thread between steps.

Loading takes a free slot (one whose adapter was unloaded and that no live sequence uses any
more) or a new one, then restacks every projection. Unloading only stops new requests from naming
the adapter: sequences already running keep its slot, and its weights, until they finish. A
runtime load's prefix-cache key is name@N, so a new adapter under an old name never reuses the
old one's K/V.
"""

from __future__ import annotations

from kvrelay.engine.lora.adapter import LoRAAdapter


class LoRAUpdateError(ValueError):
    """A load or unload that cannot be done; status: the HTTP status the gateway answers with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _check(engine) -> None:
    if engine.executor is not None:
        raise LoRAUpdateError("loading LoRA adapters at run time needs the model in the engine's process "
                              "(no tensor or pipeline parallelism); name them with --lora-modules instead", 501)
    if getattr(engine.model, "adapters", None) is None:
        raise LoRAUpdateError("this engine serves no LoRA adapters: start it with --enable-lora", 501)


def _slots_in_use(engine) -> set[int]:
    return {s.lora for seqs in engine.requests.values() for s in seqs if not s.finished and s.lora >= 0}


def _retired_free(lora, busy: set[int]) -> list[int]:
    """Slots no loaded adapter owns and no live sequence uses."""
    return [k for k in range(len(lora.slots)) if lora.index.get(lora.names[k]) != k and k not in busy]


def add_adapter(engine, adapter: LoRAAdapter) -> None:
    """Serve adapter (read and checked off the engine thread) from the next step on."""
    _check(engine)
    lora = engine.model.adapters
    if adapter.name in lora.index:
        raise LoRAUpdateError(f"The LoRA adapter {adapter.name!r} has already been loaded; unload it first")
    if adapter.name == engine.model_name:
        raise LoRAUpdateError(f"{adapter.name!r} is the base model's name")
    free = _retired_free(lora, _slots_in_use(engine))
    slots = [None if j in free else a for j, a in enumerate(lora.slots)]  # unused unloaded adapters go
    k = free[0] if free else len(slots)
    if k == len(slots):
        slots.append(None)
    slots[k] = adapter
    lora.attach(engine.model.w, engine.config, engine.dtype, slots)  # raises before changing anything
    if k == len(lora.names):
        lora.names.append("")
        lora.cache_keys.append("")
    lora.loads += 1
    lora.names[k], lora.cache_keys[k] = adapter.name, f"{adapter.name}@{lora.loads}"
    lora.index[adapter.name] = k


def remove_adapter(engine, name: str) -> None:
    """Refuse new requests for name; its running sequences finish with it (its weights go with the
    last of them, at the next load)."""
    _check(engine)
    lora = engine.model.adapters
    if name not in lora.index:
        raise LoRAUpdateError(f"The LoRA adapter {name!r} is not loaded", 404)
    k = lora.index.pop(name)
    if k not in _slots_in_use(engine):
        lora.slots[k] = None
        lora.attach(engine.model.w, engine.config, engine.dtype, lora.slots)
