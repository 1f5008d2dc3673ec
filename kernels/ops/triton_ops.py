"""Every Triton op under the names the registry expects (signatures as in kvrelay.kernels.reference).

Importing this module imports triton and compiles nothing; kernels compile on first call per
shape class and dtype.
"""

# Weights stay as loaded on GPU (cuBLAS): prepack_linear returns None, so packed_linear is unused.
from kvrelay.kernels.reference import packed_linear, prepack_linear
from kvrelay.kernels.triton_activation import gelu_tanh_and_mul, silu_and_mul
from kvrelay.kernels.triton_decode_attention import paged_decode_attention
from kvrelay.kernels.triton_fp8 import fp8_linear, quantize_fp8
from kvrelay.kernels.triton_int8 import int8_matmul, quantize_int8
from kvrelay.kernels.triton_kv_cache import gather_blocks, scatter_blocks, write_kv
from kvrelay.kernels.triton_moe import fused_moe
from kvrelay.kernels.triton_norm import fused_add_rms_norm, rms_norm
from kvrelay.kernels.triton_prefill_attention import paged_prefill_attention
from kvrelay.kernels.triton_rotary import rotary_embedding

__all__ = [
    "fp8_linear",
    "fused_add_rms_norm",
    "fused_moe",
    "gather_blocks",
    "gelu_tanh_and_mul",
    "int8_matmul",
    "packed_linear",
    "paged_decode_attention",
    "paged_prefill_attention",
    "prepack_linear",
    "quantize_fp8",
    "quantize_int8",
    "rms_norm",
    "rotary_embedding",
    "scatter_blocks",
    "silu_and_mul",
    "write_kv",
]
