"""Prefill worker: computes a prompt's KV cache and hands its blocks to a decode worker."""
