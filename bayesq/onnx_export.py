"""A quantised model as one ONNX file that stock ONNX Runtime runs: its quantised Linear layers as
``com.microsoft`` ``MatMulNBits`` nodes holding the codes, scales and zero-points bit for bit.

``MatMulNBits`` computes ``Y = A W^T`` for a weight ``W`` (N, K) stored as ``bits``-bit codes in
blocks of ``block_size`` along K (each row padded to whole blocks), one scale per block and a
``bits``-bit zero-point per block, ``W[n, k] = scale[n, k // block] * (code[n, k] - zero[n, k // block])``:
exactly BayesQ's asymmetric uniform grid (:class:`bayesq.grids.UniformGrids`,
``scale * (code - zero)``) on row-aligned groups of ``block_size`` weights. Packing (what the
runtime reads): codes ``bits`` at a time into bytes, the first code in the lowest bits, shape
(N, blocks, block_size * bits / 8); scales (N * blocks,) in the activations' float type;
zero-points packed the same way per row, (N * ceil(blocks * bits / 8),) uint8.

A layer whose rows hold several widths (BayesQ's within-layer allocation, one width per output
row) becomes one ``MatMulNBits`` node per width over that width's rows, their outputs
concatenated and put back in row order by one ``Gather`` (its int32 indices are stored too). A
layer with a stored per-input-channel scale ``s`` (AWQ: ``W_hat = decoded / s``) reads its input
divided by ``s`` first, ``Y = (A / s) decoded^T``: one ``Div`` node, ``s`` stored as float16 (as
AWQ counts it) and cast to float32 once by the runtime.

The graph is the quantised model's own ONNX export (``torch.onnx.export``, dynamo, batch and
sequence axes dynamic); each quantised layer's ``MatMul`` / ``Gemm`` is found by the value of
its weight initializer (the dequantised weight, transposed as the exporter stores it) and
replaced. A quantised layer that the format cannot hold (another codebook, a width outside
:data:`WIDTHS`, a group size that is not a block size, widths that change within a row, a
convolution, a layer whose weight the exporter did not keep as one initializer) stays in floating
point in the file, with its reason in :attr:`OnnxExport.kept` and the file's metadata.

The file needs ``onnxruntime`` (and ``numpy`` for its inputs) to run: no torch, no bayesq.
"""

from __future__ import annotations

import hashlib
import json
import re
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from bayesq.forward import Batch, eval_mode
from bayesq.grids import UniformGrids
from bayesq.result import QuantizedWeight

WIDTHS = (2, 4, 8)  # the code widths MatMulNBits runs
BLOCK_SIZES = (16, 32, 64, 128, 256)  # its block sizes along K (powers of two, at least 16)
OPSET = 18
DOMAIN = "com.microsoft"


class OnnxExportError(ValueError):
    """The model could not be written as an ONNX file (the message names the module or the cause)."""


@dataclass(frozen=True)
class Segment:
    """The rows of one layer at one width, as ``MatMulNBits`` stores them.

    Attributes:
        bits: code width.
        rows: (N_b,) int64 output rows, ascending.
        codes: (N_b, blocks, block_size * bits / 8) uint8 packed codes.
        scales: (N_b * blocks,) float32.
        zeros: (N_b * ceil(blocks * bits / 8),) uint8 packed zero-points.
    """

    bits: int
    rows: np.ndarray
    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.zeros.nbytes


def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack the last axis of ``values`` (uint8, each below ``2**bits``, length a multiple of
    ``8 / bits``) ``8 / bits`` to a byte, the first value in the lowest bits."""
    per = 8 // bits
    v = values.astype(np.uint8).reshape(*values.shape[:-1], -1, per)
    out = np.zeros(v.shape[:-1], dtype=np.uint8)
    for i in range(per):
        out |= v[..., i] << np.uint8(bits * i)
    return out


def segments(qw: QuantizedWeight) -> list[Segment]:
    """``qw``'s rows grouped by width, packed for ``MatMulNBits``.

    Raises:
        OnnxExportError: a layout the format cannot hold (:func:`unsupported` names why).
    """
    why = unsupported(qw)
    if why:
        raise OnnxExportError(f"{qw.blocks.name}: {why}")
    lb = qw.blocks
    n_out, block = lb.shape[0], lb.group_size
    per_row = lb.groups_per_row if lb.row_aligned else lb.row // block
    row_bits = qw.group_bits.reshape(n_out, per_row)
    out = []
    for b, book in sorted(qw.books.items()):
        sel = torch.nonzero(qw.group_bits == b).squeeze(1)  # book rows in this order
        rows = torch.nonzero(row_bits[:, 0] == b).squeeze(1)
        codes = qw.indices(sel).reshape(len(rows), per_row, block).cpu().numpy().astype(np.uint8)
        scale = book.scale.reshape(len(rows), per_row).cpu().numpy().astype(np.float32)
        zero = book.zero.reshape(len(rows), per_row).cpu().numpy().astype(np.uint8)
        pad = (-per_row) % (8 // b)  # zero-points pad each row to whole bytes
        zero = np.concatenate([zero, np.zeros((len(rows), pad), np.uint8)], 1)
        out.append(Segment(b, rows.cpu().numpy(), pack_bits(codes, b), scale.reshape(-1),
                           pack_bits(zero, b).reshape(-1)))
    return out


#: MatMulNBits' accuracy level written unless told: 4 (int8 activations). Measured on the embedded MiniLM
#: (docs/findings.md, 2026-12-07, "Accuracy level 4 by default"): 0.87-1.32x FP32's speed at batch 1 against
#: 0.17-0.44x at level 1 (whose 8-bit kernels are slow fallbacks), for +0.00005 to +0.00009 KL.
ACCURACY_LEVEL = 4

#: Measured on lite0 (docs/findings.md, ``benchmarks/onnx_speed.py --convolutions``): ONNX Runtime
#: dequantises a weight-only ``DequantizeLinear`` -> ``Conv`` on every call, 5-9x slower than FP32,
#: or (``session.disable_quant_qdq``) folds it into a float weight at load: FP32 speed and memory.
CONVOLUTION = ("a convolution: ONNX Runtime has no weight-only low-bit Conv kernel (DequantizeLinear -> Conv ran "
               "5-9x slower than FP32 on lite0), so it stays in floating point")


def convolutions(model: nn.Module) -> dict[str, str]:
    """The convolutions of ``model`` by module name, each with :data:`CONVOLUTION`: what a method
    leaves out (``exclude``) when it quantises for ONNX Runtime, so their bits are not spent on a
    layer the file keeps in floating point."""
    return {name: CONVOLUTION for name, mod in model.named_modules() if isinstance(mod, (nn.Conv1d, nn.Conv2d))}


def unsupported(qw: QuantizedWeight) -> str:
    """Why ``MatMulNBits`` cannot hold ``qw`` ("" when it can)."""
    lb = qw.blocks
    if len(lb.shape) != 2:
        return "a convolution: MatMulNBits holds matrices (kept in floating point)"
    if qw.split is not None:
        return "split input channels (OCS), which MatMulNBits does not store"
    if qw.col_scale is not None and qw.col_scale.shape[0] != 1:
        return "per-input-channel scales of a grouped layer (one Div on the input holds one scale per channel)"
    if any(not isinstance(book, UniformGrids) for book in qw.books.values()):
        return "a codebook other than uniform grids (MatMulNBits stores scale * (code - zero))"
    if not set(qw.books) <= set(WIDTHS):
        return f"widths {sorted(set(qw.books) - set(WIDTHS))} (MatMulNBits runs {list(WIDTHS)})"
    if lb.group_size not in BLOCK_SIZES:
        return f"group size {lb.group_size} (MatMulNBits blocks are {list(BLOCK_SIZES)})"
    if not lb.row_aligned and lb.row % lb.group_size:
        return "groups that straddle rows: quantise with row-aligned groups (quant.unit: channel)"
    per_row = lb.groups_per_row if lb.row_aligned else lb.row // lb.group_size
    row_bits = qw.group_bits.reshape(lb.shape[0], per_row)
    if bool((row_bits != row_bits[:, :1]).any()):
        return "widths that change within a row: quantise with quant.unit: channel or tensor"
    return ""


@dataclass(frozen=True)
class OnnxExport:
    """What :func:`export_onnx` wrote.

    Attributes:
        path: the ``.onnx`` file.
        quantized: layer -> its widths in the file (one ``MatMulNBits`` node per width).
        kept: quantised layer -> why it is in floating point in the file.
        file_bytes: size of the file.
        quantized_bits: bits the file stores for the quantised layers (packed codes, scales,
            zero-points, row-order indices, input scales), and ``quantized_weights`` the weights they hold.
        accuracy_level: the ``MatMulNBits`` accuracy level written (1: float32 compute,
            4: int8 activations).
        metadata: the file's ``metadata_props`` (the layers quantised and kept, the caller's).
    """

    path: Path
    quantized: Mapping[str, tuple[int, ...]]
    kept: Mapping[str, str]
    file_bytes: int
    quantized_bits: int
    quantized_weights: int
    accuracy_level: int
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def average_bits(self) -> float:
        """Bits per weight of the layers the file holds as ``MatMulNBits``."""
        return self.quantized_bits / max(1, self.quantized_weights)


def _inputs(batch: Batch) -> tuple[tuple, dict]:
    if isinstance(batch, Mapping):
        return (), {k: v for k, v in batch.items() if torch.is_tensor(v)}
    return (batch,), {}


def _dynamic(batch: Batch) -> Any:
    """Batch (and sequence) axes of every input dynamic."""
    def axes(t: torch.Tensor) -> dict:
        return {0: "batch", 1: "sequence"} if t.dim() == 2 and not t.is_floating_point() else {0: "batch"}
    if isinstance(batch, Mapping):
        return {k: axes(v) for k, v in batch.items() if torch.is_tensor(v)}
    return (axes(batch),)


def graph_of(model: nn.Module, batch: Batch, dynamic_shapes: Any = None):
    """The ONNX graph (``onnx.ModelProto``) of ``model`` on inputs like ``batch`` (dynamo export,
    opset 18, constants folded). ``dynamic_shapes``: the exporter's dynamic axes (default: the batch
    axis of every input, and the sequence axis of integer (B, T) inputs: token ids and masks); the
    exporter fixes an axis whose size in ``batch`` is 1, so give an example batch of 2 or more.

    Raises:
        OnnxExportError: the exporter's message, naming the module it stopped at where it says.
    """
    args, kwargs = _inputs(batch)
    try:
        with eval_mode(model), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(model, args, kwargs=kwargs or None, dynamo=True, verbose=False,
                                        dynamic_shapes=dynamic_shapes or _dynamic(batch), opset_version=OPSET,
                                        optimize=True)
    except Exception as err:  # the exporter raises many types; its message names the module
        said = re.sub(r"\x1b\[[0-9;]*m", "", str(err))[:2000]  # without the exporter's terminal colours
        raise OnnxExportError(f"torch.onnx.export could not export {type(model).__name__}: "
                              f"{type(err).__name__}: {said}") from err
    return program.model_proto


def _fingerprint(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, dtype=np.float32).tobytes() + repr(a.shape).encode()).hexdigest()


def _weight_nodes(graph) -> dict[str, list[tuple[int, bool]]]:
    """Fingerprint of a (N, K) weight -> the MatMul / Gemm nodes computing ``A W^T`` with it as an
    initializer, or as a ``Transpose`` of one (a head tied to an embedding table, which the
    exporter keeps once): (index of the node in the graph, is_gemm)."""
    from onnx import numpy_helper

    inits = {i.name: i for i in graph.initializer}
    transposed = {node.output[0]: node.input[0] for node in graph.node  # Transpose(W) -> W's initializer
                  if node.op_type == "Transpose" and node.input[0] in inits
                  and [list(a.ints) for a in node.attribute if a.name == "perm"] in ([[1, 0]], [])}
    found: dict[str, list] = {}
    for at, node in enumerate(graph.node):
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2:
            continue
        if node.input[1] in inits:
            b, flip = numpy_helper.to_array(inits[node.input[1]]), False
        elif node.op_type == "MatMul" and node.input[1] in transposed:
            b, flip = numpy_helper.to_array(inits[transposed[node.input[1]]]), True  # b is W (N, K) itself
        else:
            continue
        if b.ndim != 2 or b.dtype != np.float32:
            continue
        if node.op_type == "Gemm":
            attrs = {a.name: a for a in node.attribute}
            if attrs.get("transA") and attrs["transA"].i or any(
                    k in attrs and attrs[k].f != 1.0 for k in ("alpha", "beta")):
                continue
            w = b if attrs.get("transB") and attrs["transB"].i else b.T  # (N, K)
        else:
            w = b if flip else b.T
        found.setdefault(_fingerprint(w), []).append((at, node.op_type == "Gemm"))
    return found


def _drop_unused(graph) -> None:
    """Remove the nodes none of whose outputs is read (the Transposes a replaced MatMul read), then
    the initializers no node reads."""
    outputs = {o.name for o in graph.output}
    while True:
        used = {i for node in graph.node for i in node.input} | outputs
        keep = [n for n in graph.node if any(o in used for o in n.output)]
        if len(keep) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(keep)
    used = {i for node in graph.node for i in node.input}
    kept = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def _replacement(node, is_gemm: bool, name: str, segs: list[Segment], k: int, n: int, accuracy_level: int,
                 use: int = 0, col_scale: np.ndarray | None = None) -> tuple[list, list, int]:
    """(nodes, initializers, bits stored): MatMulNBits nodes for ``segs`` computing ``node``'s
    output. ``use`` > 0: another node reading the same (tied) weight, whose initializers the
    first use added (none added, no bits counted). ``col_scale``: (K,) float16 per-input-channel
    scale ``s``, the input divided by it first."""
    from onnx import TensorProto, helper, numpy_helper

    a, out = node.input[0], node.output[0]
    tag = name.replace(".", "_")
    at = f"{tag}_{use}" if use else tag  # node and value names of this use
    new, inits, stored = [], [], 0
    if col_scale is not None:
        if not use:
            inits.append(numpy_helper.from_array(col_scale, f"{tag}_in_scale"))
            stored += 16 * col_scale.size
        new += [helper.make_node("Cast", [f"{tag}_in_scale"], [f"{at}_in_scale32"], name=f"{at}_in_scale_Cast",
                                 to=TensorProto.FLOAT),
                helper.make_node("Div", [a, f"{at}_in_scale32"], [f"{at}_scaled_in"], name=f"{at}_in_scale_Div")]
        a = f"{at}_scaled_in"
    mm_out = out if not is_gemm or len(node.input) < 3 else f"{at}_mm"
    parts = []
    for s in segs:
        sfx = f"{tag}_w{s.bits}"
        y = mm_out if len(segs) == 1 else f"{at}_w{s.bits}_y"
        if not use:
            inits += [numpy_helper.from_array(s.codes, f"{sfx}_codes"),
                      numpy_helper.from_array(s.scales, f"{sfx}_scales"),
                      numpy_helper.from_array(s.zeros, f"{sfx}_zeros")]
            stored += 8 * s.nbytes
        new.append(helper.make_node("MatMulNBits", [a, f"{sfx}_codes", f"{sfx}_scales", f"{sfx}_zeros"], [y],
                                    name=f"{at}_w{s.bits}_MatMulNBits", domain=DOMAIN, K=k, N=len(s.rows), bits=s.bits,
                                    block_size=s.codes.shape[-1] * 8 // s.bits, accuracy_level=accuracy_level))
        parts.append(y)
    if len(segs) > 1:  # rows grouped by width, put back in order
        if not use:
            order = np.concatenate([s.rows for s in segs])
            position = np.empty(n, dtype=np.int32)
            position[order] = np.arange(n, dtype=np.int32)
            inits.append(numpy_helper.from_array(position, f"{tag}_row_order"))
            stored += 32 * n
        new += [helper.make_node("Concat", parts, [f"{at}_cat"], name=f"{at}_Concat", axis=-1),
                helper.make_node("Gather", [f"{at}_cat", f"{tag}_row_order"], [mm_out], name=f"{at}_Gather", axis=-1)]
    if mm_out != out:  # Gemm's bias
        new.append(helper.make_node("Add", [mm_out, node.input[2]], [out], name=f"{at}_bias"))
    return new, inits, stored


def export_onnx(qmodel: nn.Module, weights: Mapping[str, QuantizedWeight], batch: Batch, path: str | Path,
                *, accuracy_level: int = ACCURACY_LEVEL, metadata: Mapping[str, str] | None = None,
                dynamic_shapes: Any = None) -> OnnxExport:
    """Write ``qmodel`` (a quantised copy: its quantised layers hold the dequantised weights, as
    :func:`bayesq.result.quantized_copy` gives it) to ``path`` as ONNX, each layer of ``weights``
    that ``MatMulNBits`` can hold as such nodes (:func:`segments`), the rest of the graph as the
    exporter wrote it. ``batch``: example inputs (one batch as the model takes it);
    ``dynamic_shapes``: as :func:`graph_of`. ``accuracy_level``: of every ``MatMulNBits`` node
    (:data:`ACCURACY_LEVEL`: int8 activations, measured faster at a small KL cost).

    Raises:
        OnnxExportError: the export failed (nothing is written then).
    """
    import onnx

    if accuracy_level not in (0, 1, 2, 3, 4):
        raise OnnxExportError(f"accuracy_level = {accuracy_level}: MatMulNBits takes 0-4 (1: float32, 4: int8 "
                              "activations)")
    model = graph_of(qmodel, batch, dynamic_shapes)
    graph = model.graph
    nodes = _weight_nodes(graph)
    modules = dict(qmodel.named_modules())
    quantized, kept, bits, count, swap, inits = {}, {}, 0, 0, {}, []
    for name, qw in weights.items():
        why = unsupported(qw)
        w = modules[name].weight.detach().float().cpu().numpy()
        hits = nodes.get(_fingerprint(w.reshape(w.shape[0], -1))) if not why else None
        if not why and not hits:
            why = "the exporter did not keep its weight as one MatMul / Gemm initializer (kept as exported)"
        if why:
            kept[name] = why
            continue
        segs = segments(qw)
        s = None if qw.col_scale is None else qw.col_scale.reshape(-1).cpu().numpy().astype(np.float16)
        for use, (at, is_gemm) in enumerate(hits):  # a tied weight: one initializer, read by each node
            new, add, stored = _replacement(graph.node[at], is_gemm, name, segs, w.shape[1], w.shape[0],
                                            accuracy_level, use, s)
            swap[at] = new
            inits += add
            bits += stored
        count += w.size
        quantized[name] = tuple(s.bits for s in segs)
    rebuilt = [n for at, node in enumerate(graph.node) for n in swap.get(at, [node])]
    del graph.node[:]
    graph.node.extend(rebuilt)
    graph.initializer.extend(inits)
    _drop_unused(graph)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    meta = {"bayesq.quantized": json.dumps({k: list(v) for k, v in quantized.items()}),
            "bayesq.kept": json.dumps(kept), "bayesq.accuracy_level": str(accuracy_level), **(metadata or {})}
    for k, v in meta.items():
        model.metadata_props.append(onnx.StringStringEntryProto(key=k, value=v))
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    try:
        onnx.save(model, str(tmp))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return OnnxExport(path, quantized, kept, path.stat().st_size, bits, count, accuracy_level, meta)


def at_accuracy_level(model, level: int):
    """``model`` (an ``onnx.ModelProto``, changed in place and returned) with every ``MatMulNBits``
    node at accuracy ``level``."""
    for node in model.graph.node:
        for a in node.attribute:
            if node.op_type == "MatMulNBits" and a.name == "accuracy_level":
                a.i = level
    return model


class OnnxModel(nn.Module):
    """An ONNX file run by ONNX Runtime (CPU) behind the library's model interface: called on a
    batch as the exported model was, it returns the file's first output as a float32 tensor, or,
    for a model without a head (``features=True``), an object whose ``last_hidden_state`` is that
    output (:func:`bayesq.forward.output_likelihood` reads it as features). What
    :func:`bayesq.fidelity.score_examples` compares with the FP model: the runtime's own numbers.
    ``accuracy_level``: run every ``MatMulNBits`` node at this level instead of the file's (1:
    float32 compute, where the file's output is BayesQ's model's to float rounding).
    """

    def __init__(self, path: str | Path, threads: int | None = None, features: bool = False,
                 accuracy_level: int | None = None) -> None:
        import onnxruntime as ort

        super().__init__()
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        self.path, self.features = Path(path), features
        source: Any = str(path)
        if accuracy_level is not None:  # the same file with every MatMulNBits node at this level, in memory
            import onnx

            source = at_accuracy_level(onnx.load(str(path)), accuracy_level).SerializeToString()
        self.session = ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]

    def feed(self, batch: Batch) -> dict[str, np.ndarray]:
        """The session's inputs of ``batch`` (a tensor, tuple or dict as the model takes it)."""
        args, kwargs = _inputs(batch)
        feed = dict(zip(self.input_names, args)) | {k: v for k, v in kwargs.items() if k in self.input_names}
        return {k: v.detach().cpu().numpy() for k, v in feed.items()}

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> Any:
        feed = dict(zip(self.input_names, args)) | {k: v for k, v in kwargs.items() if k in self.input_names}
        y = torch.from_numpy(self.session.run(None, {k: v.detach().cpu().numpy() for k, v in feed.items()})[0])
        return SimpleNamespace(last_hidden_state=y) if self.features else y

    def latency_ms(self, batch: Batch, repeats: int = 20) -> float:
        """Median wall time of ``repeats`` runs on ``batch`` in milliseconds, after one warm-up run."""
        feed = self.feed(batch)
        self.session.run(None, feed)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.session.run(None, feed)
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)


def latencies(files: Mapping[str, str | Path], inputs: Mapping[Any, Batch], threads: int | None = None,
              repeats: int = 20, rounds: int = 3) -> dict[str, dict[Any, float]]:
    """Median latency (ms) of each ONNX file on each input batch: ``{file key: {input key: ms}}``.

    The files are timed in ``rounds`` rounds, each visiting every file with the only live
    session (created, warmed up, ``repeats`` calls per input, released): an idle session's
    spinning threads slow the one being timed (measured 2-6x on 2 cores when calls interleave).
    A file's latency is the median over rounds of its per-round medians, so drift over the run
    falls on every file alike."""
    per: dict[str, dict[Any, list[float]]] = {k: {b: [] for b in inputs} for k in files}
    for _ in range(rounds):
        for k, path in files.items():
            m = OnnxModel(path, threads=threads)
            for b, x in inputs.items():
                per[k][b].append(m.latency_ms(x, repeats))
            del m
    return {k: {b: statistics.median(v) for b, v in t.items()} for k, t in per.items()}


def run_onnx(path: str | Path, batch: Batch, threads: int | None = None, accuracy_level: int | None = None) -> np.ndarray:
    """The first output of the ONNX file at ``path`` on ``batch`` (ONNX Runtime, CPU), float32
    (``accuracy_level``: as :class:`OnnxModel`)."""
    args, kwargs = _inputs(batch)
    return OnnxModel(path, threads, accuracy_level=accuracy_level)(*args, **kwargs).numpy()


__all__ = ["ACCURACY_LEVEL", "WIDTHS", "at_accuracy_level", "BLOCK_SIZES", "CONVOLUTION", "convolutions", "OnnxExport", "OnnxExportError", "OnnxModel",
           "latencies",
           "Segment", "export_onnx", "graph_of", "pack_bits", "run_onnx", "segments", "unsupported"]
