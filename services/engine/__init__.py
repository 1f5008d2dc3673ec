"""The inference engine: model loading, paged KV cache, scheduler, sampling, async API."""
