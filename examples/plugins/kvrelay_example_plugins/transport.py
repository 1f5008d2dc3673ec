"""counting: the built-in gRPC K/V transport, counting hand-offs and bytes (a template for a
transport that adds accounting, tracing or retries around another; `kvrelay decode
--kv-transport counting`)."""

from __future__ import annotations

from typing import ClassVar

from kvrelay.kvtransfer.transport import GrpcKVTransport, KVTransport


class CountingTransport(KVTransport):
    instances: ClassVar[list[CountingTransport]] = []  # for the example's test

    def __init__(self, layout, options):
        self.inner = GrpcKVTransport(layout, options.max_message_bytes, options.handoff_timeout_s)
        self.pulls = 0
        self.bytes = 0
        CountingTransport.instances.append(self)

    async def pull(self, prefill_addr, request, dest):
        result = await self.inner.pull(prefill_addr, request, dest)
        self.pulls += 1
        self.bytes += result.bytes
        return result

    async def close(self) -> None:
        await self.inner.close()
