"""Plugins through Python entry points: extend kvrelay by installing a package, not by editing it.

Groups (an entry point's name is what requests and flags select it by):
- kvrelay.architectures: an Architecture (kvrelay.engine.architectures.base), or a list of them;
- kvrelay.logits_processors: a class; its instance edits one sequence's logits per step
  (kvrelay.engine.logits_processors describes the contract);
- kvrelay.routing: a gateway routing policy, chosen with --routing-policy;
- kvrelay.kv_transports: a KVTransport subclass (kvrelay.kvtransfer.transport);
- kvrelay.gateway_hooks: request/response hooks in the gateway (kvrelay.gateway.hooks).

Every process loads them once at start (load_plugins); `--plugins a,b` or KVRELAY_PLUGINS=a,b
loads only the entry points or distributions named. An entry point that fails to import, a name
taken twice in a group, or a requested plugin that is not installed stops start-up with an error
naming it. docs/plugins.md has each group's contract and an example package.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from importlib import metadata

log = logging.getLogger(__name__)

GROUPS = (
    "kvrelay.architectures",
    "kvrelay.logits_processors",
    "kvrelay.routing",
    "kvrelay.kv_transports",
    "kvrelay.gateway_hooks",
)
ENV_VAR = "KVRELAY_PLUGINS"


class PluginError(RuntimeError):
    """A plugin could not be loaded; the message names it."""


@dataclass(frozen=True)
class Plugin:
    group: str
    name: str
    value: object  # what the entry point loaded
    distribution: str  # "package version"


_lock = threading.Lock()
_loaded: dict[str, dict[str, Plugin]] | None = None


def parse_selection(spec: str | None) -> frozenset[str] | None:
    """'a, b' -> {'a', 'b'}; None or '' -> None (load every installed plugin)."""
    if spec is None:
        spec = os.environ.get(ENV_VAR)
    names = frozenset(n.strip() for n in (spec or "").split(",") if n.strip())
    return names or None


def _distribution(ep: metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "", "unknown distribution"
    return dist.metadata["Name"], f"{dist.metadata['Name']} {dist.version}"


def _discover(only: frozenset[str] | None) -> dict[str, dict[str, Plugin]]:
    found: dict[str, dict[str, Plugin]] = {g: {} for g in GROUPS}
    matched: set[str] = set()
    for group in GROUPS:
        for ep in metadata.entry_points(group=group):
            dist_name, dist = _distribution(ep)
            if only is not None:
                hits = only & {ep.name, dist_name}
                if not hits:
                    continue
                matched |= hits
            if ep.name in found[group]:
                raise PluginError(
                    f"plugin {ep.name!r} in group {group} is provided twice: by {found[group][ep.name].distribution} "
                    f"and by {dist}; uninstall one, or pick one with --plugins / {ENV_VAR}"
                )
            try:
                value = ep.load()
            except Exception as exc:
                raise PluginError(
                    f"plugin {ep.name!r} ({group}, {ep.value}, from {dist}) failed to import: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            found[group][ep.name] = Plugin(group, ep.name, value, dist)
    missing = sorted((only or frozenset()) - matched)
    if missing:
        raise PluginError(f"--plugins / {ENV_VAR} names {missing}, but no installed plugin has that name")
    return found


def _register(found: dict[str, dict[str, Plugin]]) -> None:
    """Groups with a registry of their own take their entries now (a taken name is an error)."""
    from kvrelay.engine import architectures
    from kvrelay.engine.architectures.base import Architecture

    for plugin in found["kvrelay.architectures"].values():
        archs = plugin.value() if callable(plugin.value) and not isinstance(plugin.value, Architecture) else plugin.value
        for arch in archs if isinstance(archs, (list, tuple)) else [archs]:
            try:
                architectures.register(arch, source=f"plugin {plugin.name!r} ({plugin.distribution})")
            except (TypeError, ValueError) as exc:
                raise PluginError(str(exc)) from exc


def load_plugins(spec: str | None = None) -> dict[str, dict[str, Plugin]]:
    """Discover, import and register the installed plugins, once per process; later calls return
    the first result. spec: the --plugins value (None: $KVRELAY_PLUGINS, else every plugin)."""
    global _loaded
    with _lock:
        if _loaded is None:
            found = _discover(parse_selection(spec))
            _register(found)
            _loaded = found
            names = [f"{g.removeprefix('kvrelay.')}:{n} ({p.distribution})" for g in GROUPS for n, p in found[g].items()]
            log.info("plugins loaded: %s", ", ".join(names) if names else "none")
        return _loaded


def loaded(group: str) -> dict[str, Plugin]:
    """The plugins of a group loaded so far in this process (load_plugins first)."""
    return dict((_loaded or {}).get(group, {}))


def reset_for_tests() -> None:
    """Forget what was loaded (registered architectures stay registered)."""
    global _loaded
    with _lock:
        _loaded = None
