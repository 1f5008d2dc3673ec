"""KV hand-off between prefill and decode workers: transport interface, gRPC implementation, client."""
