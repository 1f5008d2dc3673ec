"""Compute kernels: Triton implementations beside plain torch references."""
