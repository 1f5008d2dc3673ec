"""Speculative decoding: proposers (n-gram prompt lookup) and lossless verification."""
