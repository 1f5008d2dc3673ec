"""Channel and server options shared by every kvrelay gRPC endpoint.

Message size is bounded explicitly (KV chunks stream in pieces below it). Keepalive pings let
a peer that vanished without closing its socket be noticed within seconds.
"""

from __future__ import annotations

from kvrelay.kvtransfer.layout import DEFAULT_MAX_MESSAGE_BYTES


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 2000),
        ("grpc.keepalive_timeout_ms", 2000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Reconnect quickly after a worker restarts.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 2000),
        ("grpc.keepalive_timeout_ms", 2000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 1000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),
    ]
