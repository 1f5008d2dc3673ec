"""Routing policies from plugins (entry-point group kvrelay.routing), chosen with --routing-policy.

A policy is a class, instantiated once with no arguments, with
`pick(role: str, workers: list[Worker], hashes: list[int]) -> Worker | None`: role is
"prefill" or "decode"; workers are the live candidates (kvrelay.gateway.routing.Worker: address,
load, num_waiting, num_running, kv_blocks_free, cached_blocks, node), those that already failed
this request left out; hashes are the prompt's leading block hashes. It returns one of workers
(None: no worker now). It runs on the gateway's event loop for every request: keep it O(workers).
"""

from __future__ import annotations

GROUP = "kvrelay.routing"
BUILT_IN = "default"


def resolve(name: str | None):
    """The policy instance for --routing-policy name; None for the built-in rules."""
    if name in (None, "", BUILT_IN):
        return None
    from kvrelay.plugins import load_plugins

    available = load_plugins()[GROUP]
    if name not in available:
        raise ValueError(f"--routing-policy {name!r} is not loaded; available: {[BUILT_IN, *sorted(available)]}")
    return available[name].value()
