"""kvrelay: Kubernetes-native LLM inference.

Subpackages live in the design's folders and are mapped here by pyproject.toml:
kvrelay.engine (services/engine), kvrelay.kernels (kernels), and, as they land,
kvrelay.prefill, kvrelay.decode, kvrelay.gateway, kvrelay.operator.
"""

__version__ = "0.1.0"
