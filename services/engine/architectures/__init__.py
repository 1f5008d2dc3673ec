"""The architecture registry: config.json's `architectures` entry -> the module that maps that
family's config onto the decoder's building blocks and its checkpoint names onto weights.

Built in: Llama, Mistral, Qwen2, Qwen3 (llama.py), Gemma 2 and Gemma 3 text (gemma.py), Phi-3
(phi3.py), the mixture-of-experts families Mixtral (mixtral.py), Qwen2-MoE and Qwen3-MoE
(qwen_moe.py) over the shared sparse block (moe.py), the Llama family's sequence classifiers
(classify.py), and the decoders of LLaVA (llava.py) and Qwen2-VL / Qwen2.5-VL (qwen2_vl.py), whose
vision half is kvrelay.engine.multimodal.
Plugins add more through the `kvrelay.architectures` entry-point group (kvrelay.plugins); a name
registered twice is an error.
"""

from __future__ import annotations

from kvrelay.engine.architectures.base import Architecture
from kvrelay.engine.errors import ModelLoadError

_REGISTRY: dict[str, Architecture] = {}
_SOURCES: dict[str, str] = {}  # name -> who registered it


def register(arch: Architecture, source: str = "kvrelay") -> None:
    """Add an architecture; a name already taken raises ValueError naming both sources."""
    if not isinstance(arch, Architecture):
        raise TypeError(f"{source}: expected a kvrelay.engine.architectures.Architecture, got {type(arch).__name__}")
    held = _REGISTRY.get(arch.name)
    if held is arch:
        return  # the same object again (plugins loaded twice in one process)
    if held is not None:
        raise ValueError(
            f"architecture {arch.name!r} from {source} is already registered by {_SOURCES[arch.name]}"
        )
    _REGISTRY[arch.name] = arch
    _SOURCES[arch.name] = source


def unregister(name: str) -> None:
    """Drop an architecture (tests)."""
    _REGISTRY.pop(name, None)
    _SOURCES.pop(name, None)


def supported() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> Architecture:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ModelLoadError(f"unsupported architecture {name!r}; supported: {', '.join(supported())}") from None


def lookup(names: list[str], source: str = "config.json") -> Architecture:
    """The first of config.json's `architectures` that is registered; else one error listing them all."""
    for name in names:
        if name in _REGISTRY:
            return _REGISTRY[name]
    raise ModelLoadError(f"{source}: unsupported architecture {names!r}; supported: {', '.join(supported())}")


def _register_builtins() -> None:
    from kvrelay.engine.architectures import classify, gemma, llama, llava, mixtral, phi3, qwen2_vl, qwen_moe

    for module in (llama, gemma, phi3, mixtral, qwen_moe, classify, llava, qwen2_vl):
        for arch in module.ARCHITECTURES:
            register(arch)


_register_builtins()
