"""Decode worker: receives prefilled KV blocks and generates tokens."""
