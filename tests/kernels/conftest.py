"""Kernel tests run the Triton kernels in Triton's CPU interpreter.

TRITON_INTERPRET must be in the environment before the kernel modules are first imported (triton
decides at @triton.jit time whether a kernel is compiled or interpreted), so it is set here, at
collection time. The rest of the suite is unaffected: it never imports the Triton kernels, and
"auto" still picks the torch backend on a machine without CUDA.
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

_norm = sys.modules.get("kvrelay.kernels.triton_norm")
if _norm is not None and type(_norm._rms_norm_kernel).__name__ != "InterpretedFunction":
    raise RuntimeError("the Triton kernels were imported before TRITON_INTERPRET=1 was set")
