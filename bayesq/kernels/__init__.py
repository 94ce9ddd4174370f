"""Dequantising matmul kernels for packed BayesQ weights.

``packed.py`` (the in-memory layout the kernels read), ``reference.py`` (PyTorch: the CPU path
and the test oracle), ``triton_dequant.py`` (Triton GEMV and dequantise kernels) and
``launcher.py`` (input checks, backend choice, fallback to the reference).
"""

from bayesq.kernels.launcher import dequant_linear, dequantize, triton_available
from bayesq.kernels.packed import PackedWeight, pack_weight

__all__ = ["PackedWeight", "dequant_linear", "dequantize", "pack_weight", "triton_available"]
