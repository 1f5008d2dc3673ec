"""K/V transports from plugins (entry-point group kvrelay.kv_transports), chosen on a decode
worker with --kv-transport NAME (any name but the built-in planes, kvrelay.kvtransfer.planes.BUILTIN).

The entry point is a factory `make(layout: KVLayout, options: WorkerOptions) -> KVTransport`
(a KVTransport subclass whose constructor takes those two arguments qualifies). The transport
must keep KVTransport.pull's contract (kvrelay.kvtransfer.transport): write only through
dest.write, tell the prefill worker on failure, return the first token. To wrap the built-in
transport, build kvrelay.kvtransfer.transport.GrpcKVTransport(layout, options.max_message_bytes,
options.handoff_timeout_s) inside the factory.
"""

from __future__ import annotations

from kvrelay.kvtransfer.layout import KVLayout
from kvrelay.kvtransfer.transport import KVTransport

GROUP = "kvrelay.kv_transports"


def plugin_transport(name: str, layout: KVLayout, options) -> KVTransport:
    from kvrelay.plugins import load_plugins

    available = load_plugins()[GROUP]
    if name not in available:
        raise ValueError(f"--kv-transport {name!r} is not loaded; loaded: {sorted(available) or 'none'}")
    transport = available[name].value(layout, options)
    if not isinstance(transport, KVTransport):
        raise TypeError(f"--kv-transport {name!r} built a {type(transport).__name__}, not a KVTransport")
    return transport
