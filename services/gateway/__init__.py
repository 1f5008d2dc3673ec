"""Gateway: OpenAI-compatible HTTP API, tenants, quotas, queueing, routing, metrics."""
