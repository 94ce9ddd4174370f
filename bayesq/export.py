"""The on-disk format of a quantised model: densely packed codes plus exactly the metadata the
storage accounting (``bayesq.storage``) charges, in one safetensors file.

Per quantised layer ``L`` (tensors, all little-endian):

    L/codes      uint8   bit stream of the codes, group by group, real weights only
                         (b_g bits each, no padding to 4 bits or to a byte between groups)
    L/header     uint8   each unit's bit-width as an index into the layer's bit set,
                         ceil(log2 |bit set|) bits per unit (absent when there is one choice)
    L/scale      fp16    one per group of a uniform grid or mu-law table (fp32 if scale_bits 32)
    L/zero       uint8   b_g-bit zero-point of each uniform-grid group, packed
    L/lut        fp16    2**b entries per unit with a Lloyd table, in unit order
    L/vq         fp16    (K, dim) VQ codebook (VQ layers)
    L/col_scale  fp16    AWQ's stored per-input-channel scales (groups, channels)
    L/split      int16   OCS's split input channels (k,): the layout's shape has c + k input
                         channels, the last k copies of these (int32 past 32,768 channels)
    fp/<key>             every other tensor of the model's state (biases, norms, embeddings), as is

So ``8 * (bytes of the L/* tensors)`` equals the accounted bits plus at most 7 bits of byte
rounding per packed stream. The safetensors header (JSON: the layer layouts, per-layer bit
sets, format name and version, the content hash, caller metadata) and the ``fp/`` tensors
are the fixed overhead the average bits do not count (:class:`ExportInfo` reports both).

Bit order: value ``i`` of a stream occupies stream bits ``[o_i, o_i + w_i)``, ``o_i = sum_{j<i} w_j``,
least significant bit first; stream bit ``t`` is bit ``t mod 8`` of byte ``t div 8``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch
from torch import nn

from bayesq.blocks import LayerBlocks, kept_matrices, tied_layers
from bayesq.books import CodeBook, Field, Slot, book_class
from bayesq.canonical import make_canonical
from bayesq.config import QuantConfig
from bayesq.harness.models.zoo import get_entry
from bayesq.harness.sources import build_skeleton
from bayesq.packing import ExportError, offsets_of, pack_bits, real_codes, unpack_bits
from bayesq.qlayers import replace_quantized
from bayesq.result import QuantizedWeight
from bayesq.storage import header_bits, split_index_dtype
from bayesq.tensorfile import file_sha256, save_tensors

FORMAT = "bayesq-packed"
VERSION = 1


@dataclass(frozen=True)
class ExportInfo:
    """Sizes of a written export.

    Attributes:
        path: the file.
        file_bytes: size on disk.
        payload_bits: 8 x bytes of the quantised layers' tensors (codes, headers, scales,
            zero-points, LUTs, codebooks, column scales); checked on writing to equal
            ``accounted_bits`` up to the byte rounding of each packed stream (< 8 bits).
        accounted_bits: the allocation's exact storage bits (what ``avg_bits`` is computed from).
        n_weights: quantised weights.
        fp_bytes: the non-quantised tensors (``fp/``).
        header_bytes: safetensors header (8-byte length + JSON).
        content_sha256: hash of the tensors and layouts (:func:`content_hash`).
        sha256: sha256 of the file's bytes (``sha256sum``).
        fp_matrix_weights: elements of the floating parameters with two or more dimensions
            stored in floating point (embeddings, excluded or unsupported layers; a tied one once).
        fp_matrix_bits: their bits as stored.
    """

    path: str
    file_bytes: int
    payload_bits: int
    accounted_bits: int
    n_weights: int
    fp_bytes: int
    header_bytes: int
    content_sha256: str
    sha256: str
    fp_matrix_weights: int = 0
    fp_matrix_bits: int = 0

    @property
    def payload_avg_bits(self) -> float:
        """Bits per quantised weight in the file."""
        return self.payload_bits / self.n_weights

    @property
    def all_avg_bits(self) -> float:
        """Bits per weight over every floating parameter with two or more dimensions: the
        quantised ones as stored, the others at their storage width."""
        return (self.payload_bits + self.fp_matrix_bits) / (self.n_weights + self.fp_matrix_weights)

    def as_dict(self) -> dict:
        return {**self.__dict__, "payload_avg_bits": self.payload_avg_bits, "all_avg_bits": self.all_avg_bits}


# ---- layer <-> tensors ----------------------------------------------------------------------------

def _group_fields(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(G,) real fields per group (weights, or VQ vectors) and (G,) bits per field."""
    dims = torch.ones(qw.blocks.n_groups, dtype=torch.int64)
    for b, book in qw.books.items():
        dims[qw.group_bits == b] = book.code_dim
    return (qw.blocks.group_sizes() + dims - 1) // dims, qw.group_bits * dims


def _stored(x: torch.Tensor, bits: int) -> torch.Tensor:
    return x.to(torch.float16 if bits == 16 else torch.float32).contiguous()


def layer_tensors(qw: QuantizedWeight, quant: QuantConfig) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors (names relative to the layer) and the JSON layout of one quantised weight."""
    lb = qw.blocks
    bit_set = list(quant.bits)
    sizes, field_bits = _group_fields(qw)
    gsel = torch.arange(lb.n_groups)
    t: dict[str, torch.Tensor] = {}
    t["codes"] = torch.from_numpy(pack_bits(real_codes(qw, sizes), field_bits.repeat_interleave(sizes)))
    unit_first = torch.arange(0, lb.n_groups, lb.unit_groups)
    unit_bits = qw.group_bits[unit_first]
    if bool((qw.group_bits != unit_bits.repeat_interleave(lb.unit_groups)[: lb.n_groups]).any()):
        raise ValueError(f"layer '{lb.name}': groups of one allocation unit have different bit-widths")
    missing = sorted(set(unit_bits.tolist()) - set(bit_set))
    if missing:
        raise ValueError(f"layer '{lb.name}' uses bit-widths {missing} outside quant.bits {bit_set}")
    hb = header_bits(len(bit_set))
    if hb:
        idx = torch.tensor([bit_set.index(int(b)) for b in unit_bits])
        t["header"] = torch.from_numpy(pack_bits(idx, hb))
    kinds, fields, entries = {}, {}, {}
    for b, book in sorted(qw.books.items()):
        if not isinstance(book, CodeBook):
            raise ValueError(f"cannot export a codebook of type {type(book).__name__}")
        kinds[b] = book.kind
        for f in book.export_fields(gsel[qw.group_bits == b], lb, quant):
            fields.setdefault(f.name, []).append(f)
        entries.update(book.layout_entries(quant))
    for key, fs in sorted(fields.items()):
        if key in t or key in ("codes", "header", "col_scale", "split"):
            raise ValueError(f"layer '{lb.name}': a '{fs[0].name}' field of its codebooks clashes with the "
                             f"format's own tensor '{key}'")
        t[key] = _merged(fs)
    if qw.col_scale is not None:
        t["col_scale"] = _stored(_channel_scales(qw), 16)
    if qw.split is not None:
        t["split"] = qw.split.to(split_index_dtype(qw.shape[1])).contiguous()
    layout = {"shape": list(lb.shape), "group_size": lb.group_size, "unit_groups": lb.unit_groups,
              "row_aligned": lb.row_aligned, "bit_set": bit_set, "kinds": {str(b): k for b, k in kinds.items()},
              "mu": None, "scale_bits": quant.scale_bits, "lut_bits": quant.lut_bits, **entries}
    return t, layout


def _merged(fields: list[Field]) -> torch.Tensor:
    """One layer tensor from the :class:`Field` entries of its books, in key order."""
    first = fields[0]
    if any((f.widths is None) != (first.widths is None) or f.bits != first.bits for f in fields):
        raise ValueError(f"codebooks write '{first.name}' in different formats")
    if first.shape is not None and len(fields) > 1:
        raise ValueError(f"two codebooks of one layer write the whole tensor '{first.name}'")
    key = torch.cat([f.key.repeat_interleave(f.values.reshape(f.key.numel(), -1).shape[1]) for f in fields])
    order = torch.sort(key, stable=True).indices  # an entry's values stay together and in order
    values = torch.cat([f.values.reshape(-1) for f in fields])[order]
    if first.widths is not None:
        return torch.from_numpy(pack_bits(values, torch.cat([f.widths for f in fields])[order]))
    out = _stored(values, first.bits)
    return out.reshape(first.shape) if first.shape is not None else out


def _channel_scales(qw: QuantizedWeight) -> torch.Tensor:
    """AWQ's (groups, channels) stored scales from the (groups, d_in) expanded ones."""
    kernel = math.prod(qw.blocks.shape[2:])
    s = qw.col_scale[:, ::kernel]
    if not torch.equal(s.repeat_interleave(kernel, 1), qw.col_scale):
        raise ValueError(f"layer '{qw.blocks.name}': column scales differ within one input channel")
    return s


def _need(t: Mapping[str, torch.Tensor], key: str, name: str, n: int | None = None) -> torch.Tensor:
    if key not in t:
        raise ExportError(f"layer '{name}' has no '{key}' tensor: the file is corrupted or was edited")
    x = t[key]
    if n is not None and x.numel() != n:
        raise ExportError(f"layer '{name}': '{key}' holds {x.numel()} values, its layout needs {n}: "
                          "the file is corrupted or was edited")
    return x


def _stream(t, key: str, name: str, widths: torch.Tensor) -> torch.Tensor:
    data = _need(t, key, name, (int(widths.sum()) + 7) // 8)
    return unpack_bits(data.numpy().tobytes(), offsets_of(widths), widths)


def layer_from_tensors(name: str, t: Mapping[str, torch.Tensor], layout: Mapping) -> QuantizedWeight:
    """Inverse of :func:`layer_tensors`: the :class:`QuantizedWeight` (codes of padding zero)."""
    lb = LayerBlocks(name, tuple(layout["shape"]), layout["group_size"], layout["unit_groups"],
                     layout["row_aligned"])
    bit_set, kinds = layout["bit_set"], {int(b): k for b, k in layout["kinds"].items()}
    hb = header_bits(len(bit_set))
    if hb:
        idx = _stream(t, "header", name, torch.full((lb.n_units,), hb))
        if int(idx.max()) >= len(bit_set):
            raise ExportError(f"layer '{name}': a unit header names bit-width #{int(idx.max())} of {bit_set}")
        unit_bits = torch.tensor(bit_set)[idx]
    else:
        unit_bits = torch.full((lb.n_units,), bit_set[0])
    group_bits = unit_bits[lb.group_unit()]  # (G,)
    if set(group_bits.unique().tolist()) - set(kinds):
        raise ExportError(f"layer '{name}': unit headers use bit-widths without a codebook kind")
    present = sorted(set(group_bits.tolist()))
    try:
        classes = {b: book_class(kinds[b]) for b in present}
    except KeyError as err:
        raise ExportError(f"layer '{name}': {err.args[0]}") from None

    def need(key: str, n: int | None = None) -> torch.Tensor:
        return _need(t, key, name, n)

    dims = torch.ones(lb.n_groups, dtype=torch.int64)
    for b in present:
        dims[group_bits == b] = classes[b].read_code_dim(layout, need)
    sizes = (lb.group_sizes() + dims - 1) // dims
    width = int(((lb.group_size + dims - 1) // dims).max())
    real = _stream(t, "codes", name, (group_bits * dims).repeat_interleave(sizes))
    codes = torch.zeros(lb.n_groups, width, dtype=torch.int64)
    codes[torch.arange(width)[None, :] < sizes[:, None]] = real
    gsel = torch.arange(lb.n_groups)
    sel = {b: gsel[group_bits == b] for b in present}
    slots = {b: classes[b].export_slots(b, sel[b], lb, layout) for b in present}
    fields = _slot_values(t, name, slots)
    books = {b: classes[b].from_export(b, sel[b], lb, layout, fields[b], need) for b in present}
    col = None
    if "col_scale" in t:
        col = t["col_scale"].double().repeat_interleave(math.prod(lb.shape[2:]), 1)
    split = None
    if "split" in t:
        split = t["split"].to(torch.int64).reshape(-1)
        c = lb.shape[1] - split.numel()
        if c < 1 or bool(((split < 0) | (split >= c)).any()):
            raise ExportError(f"layer '{name}': its split channels do not index its {lb.shape[1]} - "
                              f"{split.numel()} input channels: the file is corrupted or was edited")
    return QuantizedWeight(lb, group_bits, codes, books, col, split)


def _slot_values(t, name: str, slots: dict[int, list[Slot]]) -> dict[int, dict[str, torch.Tensor]]:
    """bits -> tensor name -> (m, length) entries of each book's :class:`Slot` (the inverse of
    :func:`_merged`): float64, or int64 read from a packed stream."""
    out: dict[int, dict[str, torch.Tensor]] = {b: {} for b in slots}
    names = sorted({s.name for ss in slots.values() for s in ss})
    for key in names:
        mine = [(b, s) for b, ss in sorted(slots.items()) for s in ss if s.name == key]
        elem = torch.cat([s.key.repeat_interleave(s.length) for _, s in mine])
        order = torch.sort(elem, stable=True).indices
        if mine[0][1].widths is not None:
            values = _stream(t, key, name, torch.cat([s.widths for _, s in mine])[order])
        else:
            values = _need(t, key, name, elem.numel()).double().reshape(-1)
        flat = torch.empty_like(values)
        flat[order] = values
        for (b, s), part in zip(mine, torch.split(flat, [s.key.numel() * s.length for _, s in mine])):
            out[b][key] = part.reshape(s.key.numel(), s.length)
    return out


# ---- files ----------------------------------------------------------------------------------------

def content_hash(tensors: Mapping[str, torch.Tensor], layers_json: str) -> str:
    """sha256 over every tensor (name, dtype, shape, bytes, in name order) and the layer layouts."""
    h = hashlib.sha256(layers_json.encode())
    for key in sorted(tensors):
        x = tensors[key].contiguous()
        h.update(f"{key}|{x.dtype}|{tuple(x.shape)}".encode())
        h.update(x.reshape(-1).view(torch.uint8).numpy().tobytes() if x.numel() else b"")
    return h.hexdigest()


def _tied_keys(model: nn.Module, layers: Iterable[str]) -> set[str]:
    """State-dict keys of the weights tied to one of the quantised ``layers`` (stored once, as
    that layer's codes; :func:`load` ties them again)."""
    return {f"{alias}.weight" for alias in tied_layers(model, {n: model.get_submodule(n) for n in layers})}


def save_export(
    path: str | Path, qmodel: nn.Module, weights: Mapping[str, QuantizedWeight], quant: QuantConfig,
    accounted_bits: int, *, architecture: str = "", metadata: Mapping[str, str] | None = None,
    skeleton: Mapping | None = None, preprocessor: Mapping | None = None,
) -> ExportInfo:
    """Write ``weights`` (the codes and codebooks) and the rest of ``qmodel``'s state to ``path``.

    Args:
        qmodel: the in-memory quantised model (its non-quantised tensors are stored as they are;
            distillation may have trained its biases).
        weights: layer name -> :class:`QuantizedWeight`.
        quant: the bit set (header width), codebook kind and stored precisions.
        accounted_bits: the allocation's ``total_bits`` (reported next to the file's payload).
        architecture: a zoo model name :func:`load` can rebuild the module from.
        metadata: extra strings stored in the header (lineage, method, budget, ...).
        skeleton: how to rebuild the architecture without the producer's code
            (:meth:`bayesq.harness.sources.ModelSource.skeleton`: a Hugging Face config and Auto
            class, a torchvision arch and class count, ...); :func:`load` reads it.
        preprocessor: how inputs are preprocessed (the tokenizer's or image processor's files,
            or torchvision's transforms: :meth:`bayesq.harness.sources.ModelSource.preprocessor`).

    The file is written to a temporary name and renamed, so a crash leaves no partial export, and
    byte-deterministically (:mod:`bayesq.tensorfile`): the same weights and metadata give the same file.
    """
    tensors, layouts, payload, streams = {}, {}, 0, 0
    for name, qw in weights.items():
        t, layouts[name] = layer_tensors(qw, quant)
        for k, v in t.items():
            tensors[f"{name}/{k}"] = v.contiguous()
            payload += v.numel() * v.element_size()
            streams += v.dtype == torch.uint8
    if not accounted_bits <= 8 * payload <= accounted_bits + 7 * streams:
        raise ValueError(f"the export holds {8 * payload} bits of codes and metadata but the allocation "
                         f"accounts {accounted_bits} (+ at most {7 * streams} bits of byte rounding): pass the "
                         "QuantConfig the weights were quantised with (bit set, scale and LUT precision)")
    fp_bytes, tied = 0, _tied_keys(qmodel, weights)
    for k, v in qmodel.state_dict().items():
        if (k.removesuffix(".weight") in weights and k.endswith(".weight")) or k in tied:
            continue
        tensors[f"fp/{k}"] = v.detach().cpu().clone().contiguous()
        fp_bytes += v.numel() * v.element_size()
    fp_matrix = kept_matrices(qmodel, weights)
    n = sum(qw.numel for qw in weights.values())
    layers_json = json.dumps(layouts, sort_keys=True)
    meta = {"format": FORMAT, "format_version": str(VERSION), "layers": layers_json,
            "architecture": architecture, "content_sha256": content_hash(tensors, layers_json),
            "accounted_bits": str(int(accounted_bits)), "user": json.dumps(dict(metadata or {}), sort_keys=True),
            "avg_bits": f"{accounted_bits / n:.6f}",
            "avg_bits_all": f"{(accounted_bits + fp_matrix[1]) / (n + fp_matrix[0]):.6f}"}
    if skeleton is not None:
        meta["skeleton"] = json.dumps(dict(skeleton), sort_keys=True)
    if preprocessor is not None:
        meta["preprocessor"] = json.dumps(dict(preprocessor), sort_keys=True)
    path = save_tensors(path, tensors, meta)
    size = path.stat().st_size
    return ExportInfo(str(path), size, 8 * payload, int(accounted_bits), n, fp_bytes, size - payload - fp_bytes,
                      meta["content_sha256"], file_sha256(path), *fp_matrix)


@dataclass(frozen=True)
class ExportContents:
    """What :func:`read_export` returns: the quantised layers, the other tensors, the metadata."""

    weights: dict[str, QuantizedWeight]
    fp_state: dict[str, torch.Tensor]
    metadata: dict[str, str]

    @property
    def architecture(self) -> str:
        return self.metadata.get("architecture", "")

    @property
    def user(self) -> dict:
        return json.loads(self.metadata.get("user", "{}"))

    @property
    def skeleton(self) -> dict | None:
        """How to rebuild the architecture (:func:`bayesq.harness.sources.build_skeleton`), or None."""
        return json.loads(self.metadata["skeleton"]) if "skeleton" in self.metadata else None

    @property
    def preprocessor(self) -> dict | None:
        """How inputs are preprocessed (:func:`bayesq.harness.data.files.featurizer`), or None."""
        return json.loads(self.metadata["preprocessor"]) if "preprocessor" in self.metadata else None


def read_export(path: str | Path) -> ExportContents:
    """Read and verify an export (format, version, content hash) without building a module.

    Raises:
        FileNotFoundError: no such file.
        ExportError: not a safetensors file or truncated, another format or format version,
            a content hash that does not match (corrupted), a layer whose tensors do not fit
            its layout.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no export at {path}: run `bayesq quantize` or the pipeline to write it")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise ExportError(f"{path} is not a readable safetensors file ({err}); it is truncated or corrupted: "
                          "export the model again") from None
    if meta.get("format") != FORMAT:
        raise ExportError(f"{path} is not a BayesQ export (format {meta.get('format')!r}, expected {FORMAT!r})")
    if meta.get("format_version") != str(VERSION):
        raise ExportError(f"{path} was written in format version {meta.get('format_version')}; this BayesQ "
                          f"reads version {VERSION}: export the model again with this version")
    layers_json = meta.get("layers", "")
    if content_hash(tensors, layers_json) != meta.get("content_sha256"):
        raise ExportError(f"{path}: content hash mismatch, the file is corrupted: export the model again")
    layouts = json.loads(layers_json)
    weights = {}
    for name, layout in layouts.items():
        sub = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + "/")}
        weights[name] = layer_from_tensors(name, sub, layout)
    fp_state = {k[3:]: v for k, v in tensors.items() if k.startswith("fp/")}
    return ExportContents(weights, fp_state, dict(meta))


def load(path: str | Path, skeleton: nn.Module | None = None,
         memory_format: torch.memory_format = torch.contiguous_format) -> nn.Module:
    """The exported model as an ``nn.Module`` whose quantised Linear/Conv2d layers are
    :class:`bayesq.qlayers.QuantLinear` / :class:`bayesq.qlayers.QuantConv2d` (packed codes, run
    by the kernels), in eval mode, on the CPU.

    ``skeleton``: a module of the same architecture (its weights are replaced); default: the
    architecture the file describes (its ``skeleton`` header: a Hugging Face config and Auto
    class, a torchvision arch, ...), else the zoo model named in its ``architecture``. ``memory_format``: of every 4-D weight,
    decoded ones included (``torch.channels_last``: convolutions run NHWC, faster on CPU for
    CNNs; same values up to the convolution's summation order).

    Raises:
        ExportError: see :func:`read_export`; also a skeleton that does not match the file.
    """
    contents = read_export(path)
    if skeleton is None and contents.skeleton is not None:
        skeleton = build_skeleton(contents.skeleton)
    elif skeleton is None:
        if not contents.architecture:
            raise ExportError(f"{path} names no architecture: pass skeleton= (a module of the same architecture)")
        skeleton = get_entry(contents.architecture).build(pretrained=False)
    model = make_canonical(skeleton)
    missing_layers = sorted(set(contents.weights) - {name for name, _ in model.named_modules()})
    if missing_layers:
        raise ExportError(f"{path} does not match the module: no layer {missing_layers[:3]}")
    tied = _tied_keys(model, contents.weights)
    expected = {k for k in model.state_dict()
                if not (k.endswith(".weight") and k[:-7] in contents.weights) and k not in tied}
    missing, extra = sorted(expected - set(contents.fp_state)), sorted(set(contents.fp_state) - expected)
    if missing or extra:
        raise ExportError(f"{path} does not match the module: missing {missing[:3]}, unexpected {extra[:3]}")
    model.load_state_dict(contents.fp_state, strict=False)
    replace_quantized(model, contents.weights, memory_format=memory_format)
    return model.to(memory_format=memory_format).eval()
