"""ONNX Runtime's own weight-only quantisers: the peers of the ``onnxruntime`` target, in its format.

``onnxruntime.quantization.matmul_nbits_quantizer`` turns the ``MatMul`` nodes of an FP32 ONNX
graph into ``MatMulNBits`` nodes (the format :mod:`bayesq.onnx_export` writes): RTN (its default
algorithm: round to nearest on each block's min/max, asymmetric), HQQ (half-quadratic zero-point
and scale search) and GPTQ (error feedback on the calibration inputs' Hessian, read through a
calibration data reader). Its ``Gemm`` nodes (a classifier's pooler and head, a CNN's classifier)
and convolutions stay in floating point there; :func:`matmulnbits_bits` counts what a file holds
as ``MatMulNBits``, so a peer's true bits are those of the weights it quantised.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np

from bayesq.onnx_export import _inputs


class PeerAlgorithm(str, Enum):
    """An ONNX Runtime weight-only quantiser."""

    RTN = "rtn"
    HQQ = "hqq"
    GPTQ = "gptq"


@dataclass(frozen=True)
class Peer:
    """One ONNX Runtime quantiser at one width and block size (``ort-<algorithm>-<bits>b-b<block>``).

    ONNX Runtime 1.32's GPTQ packs zero-points across rows when a row has an odd number of blocks
    (a reshape error, e.g. K = 384 at block 128): give it a block that divides K evenly."""

    algorithm: PeerAlgorithm
    bits: int = 4
    block: int = 128

    def __post_init__(self) -> None:
        object.__setattr__(self, "algorithm", PeerAlgorithm(self.algorithm))
        if self.bits not in (2, 4, 8):
            raise ValueError(f"peer {self.algorithm.value}: bits = {self.bits}; MatMulNBits runs 2, 4 or 8")
        if self.algorithm is PeerAlgorithm.GPTQ and self.bits != 4:
            raise ValueError(f"peer gptq: bits = {self.bits}; ONNX Runtime's GPTQ quantises to 4 bits")
        if self.block < 16 or self.block & (self.block - 1):
            raise ValueError(f"peer {self.algorithm.value}: block = {self.block}; use a power of two, at least 16")

    @property
    def name(self) -> str:
        return f"ort-{self.algorithm.value}-{self.bits}b-b{self.block}"


class _Reader:
    """ONNX Runtime's calibration data reader protocol (``get_next``, iteration) over the model's batches
    (tensors, tuples or dicts of tensors), each as the graph's inputs ``names`` (in order)."""

    def __init__(self, batches: Iterable, names: Sequence[str]) -> None:
        def feed(batch) -> dict:
            args, kwargs = _inputs(batch)
            named = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
            return {k: v.detach().cpu().numpy() for k, v in named.items()}

        self.items = iter([feed(b) for b in batches])

    def get_next(self):
        return next(self.items, None)

    def __iter__(self):
        return iter(self.get_next, None)


def ort_quantize(fp_path: str | Path, peer: Peer, out: str | Path, calibration: Sequence = (),
                 accuracy_level: int = 1) -> Path:
    """Quantise the FP32 graph at ``fp_path`` with ONNX Runtime's ``peer`` and save it to ``out``.

    Args:
        calibration: the model's batches (tensors, or dicts of the graph's inputs), read by GPTQ only.
        accuracy_level: written on every ``MatMulNBits`` node (1: float32 compute, 4: int8
            activations).

    Raises:
        ValueError: GPTQ without calibration batches.
    """
    import onnx
    from onnxruntime.quantization import matmul_nbits_quantizer as q

    logging.getLogger("onnxruntime").setLevel(logging.WARNING)
    model = onnx.load(str(fp_path))
    b, block = peer.bits, peer.block
    if peer.algorithm is PeerAlgorithm.RTN:
        algo = q.DefaultWeightOnlyQuantConfig(block_size=block, bits=b, accuracy_level=accuracy_level)
    elif peer.algorithm is PeerAlgorithm.HQQ:
        algo = q.HQQWeightOnlyQuantConfig(block_size=block, bits=b)
    else:
        if not calibration:
            raise ValueError(f"{peer.name}: ONNX Runtime's GPTQ reads calibration inputs; none were given")
        names = [i.name for i in model.graph.input]
        algo = q.GPTQWeightOnlyQuantConfig(_Reader(calibration, names), block_size=block)
    quant = q.MatMulNBitsQuantizer(model, bits=b, block_size=block, is_symmetric=False, accuracy_level=accuracy_level,
                                   algo_config=algo)
    quant.process()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    quant.model.save_model_to_file(str(out))
    return Path(out)


def matmulnbits_bits(path: str | Path) -> tuple[int, int]:
    """(bits stored, weights held) of the ``MatMulNBits`` nodes of an ONNX file: their codes,
    scales and zero-points (inputs 1-3), over ``K * N`` weights each."""
    import onnx

    m = onnx.load(str(path))
    sizes = {i.name: int(np.prod(i.dims)) * (4 if i.data_type == onnx.TensorProto.FLOAT else 1)
             for i in m.graph.initializer}
    stored = weights = 0
    for node in m.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            weights += attrs["K"] * attrs["N"]
            stored += 8 * sum(sizes.get(i, 0) for i in node.input[1:4])
    return stored, weights


__all__ = ["Peer", "PeerAlgorithm", "matmulnbits_bits", "ort_quantize"]
