"""Kernel tests run the Triton kernels in Triton's CPU interpreter.

TRITON_INTERPRET must be in the environment before the kernel modules are first imported (triton
decides at @triton.jit time whether a kernel is compiled or interpreted), so it is set here, at
collection time. The rest of the suite is unaffected: it never imports the Triton kernels, and
"auto" still picks the torch backend on a machine without CUDA.
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

if "kvrelay.kernels.triton_ops" in sys.modules and os.environ["TRITON_INTERPRET"] != "1":
    raise RuntimeError("the Triton kernels were imported before TRITON_INTERPRET=1 was set")
