"""Which layers are quantised, and how each weight is cut into scale groups and allocation units.

Layout (shared by BayesQ, the baselines and the storage accounting): a Linear/Conv2d weight of
shape (out, in[, kh, kw]) is flattened row-major, output channel first, to ``numel`` values;
consecutive runs of ``group_size`` values share one scale and zero-point (the last group may be
shorter); ``unit_groups`` consecutive groups form one allocation unit with one bit-width.
Per-tensor and per-channel grids are the same layout with ``group_size = numel`` or ``= row``.
With ``row_aligned`` every output channel (row) is cut into groups on its own, so no group
straddles two rows (the last group of each row may be shorter); per-channel allocation units
are then ``unit_groups = groups_per_row``.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED = (nn.Linear, nn.Conv2d)
_UNSUPPORTED = (nn.Conv1d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
                nn.Bilinear)


@dataclass(frozen=True)
class LayerBlocks:
    """Group and unit layout of one quantised weight.

    Attributes:
        name: module name in ``model.named_modules()``.
        shape: weight shape.
        group_size: weights per scale group.
        unit_groups: groups per allocation unit.
        row_aligned: groups restart at every output channel (see the module docstring).
    """

    name: str
    shape: tuple[int, ...]
    group_size: int
    unit_groups: int
    row_aligned: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row(self) -> int:
        """Weights per output channel."""
        return self.numel // self.shape[0]

    @property
    def groups_per_row(self) -> int:
        """Groups per output channel when ``row_aligned`` (else the fractional layout has none)."""
        return math.ceil(self.row / self.group_size)

    @property
    def n_groups(self) -> int:
        if self.row_aligned:
            return self.shape[0] * self.groups_per_row
        return math.ceil(self.numel / self.group_size)

    def group_sizes(self) -> torch.Tensor:
        """(n_groups,) int64: real (unpadded) weights in each group."""
        g = self.group_size
        if self.row_aligned:
            first = torch.arange(self.groups_per_row) * g  # offset of each group within its row
            per_row = (self.row - first).clamp(max=g)
            return per_row.repeat(self.shape[0])
        sizes = torch.full((self.n_groups,), g, dtype=torch.int64)
        sizes[-1] = self.numel - (self.n_groups - 1) * g
        return sizes

    @property
    def n_units(self) -> int:
        return math.ceil(self.n_groups / self.unit_groups)

    def unit_group_ranges(self) -> list[tuple[int, int]]:
        """[start, stop) group indices of each unit."""
        u = self.unit_groups
        return [(s, min(s + u, self.n_groups)) for s in range(0, self.n_groups, u)]

    @property
    def unit_rows(self) -> int:
        """Output rows one unit spans when its groups are row-aligned and it holds whole rows
        (a whole-layer unit of a row-blocked format), else 1."""
        if self.row_aligned and self.unit_groups >= self.groups_per_row:
            return self.unit_groups // self.groups_per_row
        return 1

    def unit_sizes(self) -> list[tuple[int, int]]:
        """(n_weights, n_groups) of each unit."""
        sizes = self.group_sizes().tolist()
        return [(sum(sizes[s:e]), e - s) for s, e in self.unit_group_ranges()]

    def group_unit(self, device: torch.device | str | None = None) -> torch.Tensor:
        """(n_groups,) int64 on ``device`` (default the CPU): the unit each group belongs to."""
        return torch.arange(self.n_groups, device=device) // self.unit_groups

    @property
    def padded(self) -> bool:
        """Whether :meth:`to_groups` pads: the groups hold more slots than the layer has weights."""
        return self.n_groups * self.group_size != self.numel

    def to_groups(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cut a (numel,) tensor into (n_groups, group_size) rows plus a 0/1 mask.

        Padding of the last group (of each row, when ``row_aligned``) repeats its last real
        value, so min/max are unchanged. Without padding the rows are a view of ``flat`` and the
        mask a read-only broadcast of one 1 (no full-size copy of a large layer).
        """
        g = self.group_size
        if not self.padded:
            return flat.reshape(-1, g), flat.new_ones(()).expand(self.n_groups, g)
        if self.row_aligned:
            width = self.groups_per_row * g
            rows = flat.reshape(self.shape[0], self.row)  # (out, row)
            mask = torch.ones(self.shape[0], width, dtype=flat.dtype, device=flat.device)
            rows = torch.cat([rows, rows[:, -1:].expand(-1, width - self.row)], 1)  # (out, width)
            mask[:, self.row:] = 0
            return rows.reshape(-1, g), mask.reshape(-1, g)
        pad = self.n_groups * g - self.numel
        mask = torch.ones(self.n_groups * g, dtype=flat.dtype, device=flat.device)
        flat = torch.cat([flat, flat[-1:].expand(pad)])
        mask[-pad:] = 0
        return flat.reshape(-1, g), mask.reshape(-1, g)  # (G, g)

    def element_groups(self, rows: slice, device: torch.device | str | None = None) -> torch.Tensor:
        """(r, row) int64: the group of every weight of output rows ``rows`` (step 1), the index
        :meth:`from_groups` would put there (rows of a large layer, without a full-size map)."""
        r = torch.arange(rows.start or 0, rows.stop, device=device)[:, None]
        j = torch.arange(self.row, device=device)[None, :]
        if self.row_aligned:
            return r * self.groups_per_row + j // self.group_size
        return (r * self.row + j) // self.group_size

    def from_groups(self, groups: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_groups`: (n_groups, group_size) -> weight of ``shape``."""
        if self.row_aligned:
            rows = groups.reshape(self.shape[0], -1)[:, : self.row]  # (out, row)
            return rows.reshape(self.shape)
        return groups.reshape(-1)[: self.numel].reshape(self.shape)

    def with_granularity(self, group_size: int, unit_weights: int) -> "LayerBlocks":
        """Same weight with another group size; units hold about ``unit_weights`` weights."""
        return LayerBlocks(self.name, self.shape, group_size, max(1, unit_weights // group_size))

    def with_unit(self, unit: str, group_size: int, unit_groups: int, aligned: bool = False) -> "LayerBlocks":
        """Layout for an allocation unit: ``block`` (``unit_groups`` groups), ``group``, ``channel``
        (one output row, groups aligned to rows) or ``tensor`` (the whole weight; its groups
        aligned to rows too when ``aligned``, as a runtime's row-blocked format stores them)."""
        if unit == "block":
            return LayerBlocks(self.name, self.shape, group_size, unit_groups)
        if unit == "group":
            return LayerBlocks(self.name, self.shape, group_size, 1)
        if unit == "channel":
            aligned = LayerBlocks(self.name, self.shape, group_size, 1, row_aligned=True)
            return LayerBlocks(self.name, self.shape, group_size, aligned.groups_per_row, True)
        if unit == "tensor" and aligned:
            rows = LayerBlocks(self.name, self.shape, group_size, 1, row_aligned=True)
            return LayerBlocks(self.name, self.shape, group_size, rows.n_groups, True)
        if unit == "tensor":
            return LayerBlocks(self.name, self.shape, group_size, math.ceil(self.numel / group_size))
        raise ValueError(f"unknown allocation unit {unit!r}: choose block, group, channel or tensor")


def excluded(name: str, exclude: tuple[str, ...]) -> bool:
    """Whether module ``name`` or a module it sits in matches one of the names or glob patterns in
    ``exclude`` (``fnmatch``: ``*`` also crosses dots, e.g. ``"encoder.layer.0.*"``,
    ``"*classifier"``; ``"attn"`` also excludes ``attn.q_proj``)."""
    parts = name.split(".")
    names = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return any(fnmatch.fnmatchcase(n, pattern) for n in names for pattern in exclude)


def _inside_attention(model: nn.Module) -> dict[str, str]:
    """Names of the modules inside an ``nn.MultiheadAttention`` left as it is (its projections run
    functionally, unseen by hooks), mapped to that attention's name."""
    return {f"{name}.{sub}": name for name, mod in model.named_modules()
            if isinstance(mod, nn.MultiheadAttention) for sub, _ in mod.named_modules() if sub}


def quantizable_layers(model: nn.Module, exclude: tuple[str, ...] = ()) -> dict[str, nn.Module]:
    """Linear and Conv2d modules by name, in network order, but those matching ``exclude``
    (names or glob patterns, :func:`excluded`), those inside an ``nn.MultiheadAttention`` that
    :mod:`bayesq.canonical` left as it is, and a module whose weight is another's (tied: the
    first name encodes it, :func:`tied_layers`).

    Raises:
        ValueError: a weight-bearing layer type BayesQ cannot quantise (Conv3d, ConvTranspose,
            ...) that ``exclude`` does not match, or no Linear/Conv2d layer at all.
    """
    layers: dict[str, nn.Module] = {}
    inside, weights = _inside_attention(model), set()
    for name, mod in model.named_modules():
        if excluded(name, exclude) or name in inside:
            continue
        if isinstance(mod, _UNSUPPORTED):
            raise ValueError(
                f"unsupported layer '{name}' ({type(mod).__name__}): BayesQ quantises Linear, Conv2d and "
                "plain Conv1d weights; pass its name in `exclude` to keep it in floating point"
            )
        if isinstance(mod, SUPPORTED) and id(mod.weight) not in weights:
            layers[name] = mod
            weights.add(id(mod.weight))
    if not layers:
        raise ValueError("the model has no Linear or Conv2d layer to quantise")
    return layers


def tied_layers(model: nn.Module, layers: Mapping[str, nn.Module]) -> dict[str, str]:
    """Modules of ``model`` (by name) that are not in ``layers`` but hold the weight of one of them
    (tied, e.g. an embedding sharing a language model's output matrix), mapped to that layer's name."""
    owner, modules = {id(m.weight): n for n, m in layers.items()}, {id(m) for m in layers.values()}
    held = ((name, mod._parameters.get("weight")) for name, mod in model.named_modules() if id(mod) not in modules)
    return {name: owner[id(w)] for name, w in held if w is not None and id(w) in owner}


def unquantized_weights(model: nn.Module, layers: dict[str, nn.Module], exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """Every floating parameter of ``model`` with two or more dimensions that is not the weight
    of one of ``layers``, by name, with the reason it stays in floating point. A parameter shared
    by several modules is listed once (``named_parameters`` order), and not at all when one of
    them is quantised."""
    quantized = {id(m.weight) for m in layers.values()}
    owners: dict[int, tuple[str, nn.Module, str]] = {}
    for module_name, mod in model.named_modules():
        for param_name, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), (module_name, mod, param_name))
    inside = _inside_attention(model)
    out = {}
    for name, p in model.named_parameters():
        if p.dim() < 2 or not p.is_floating_point() or id(p) in quantized:
            continue
        module_name, mod, param_name = owners[id(p)]
        attention = inside.get(module_name, module_name if isinstance(mod, nn.MultiheadAttention) else None)
        if excluded(module_name, exclude):
            out[name] = f"excluded ({type(mod).__name__} '{module_name}' matches exclude)"
        elif isinstance(mod, nn.Embedding):
            out[name] = "embedding: a table look-up, kept in floating point"
        elif attention is not None:
            out[name] = (f"MultiheadAttention '{attention}' with add_bias_kv, add_zero_attn or its own forward "
                         "runs its projections functionally: kept in floating point")
        else:
            out[name] = (f"{type(mod).__name__}.{param_name} is not a Linear/Conv2d weight: kept in floating point")
    return out


def kept_matrices(model: nn.Module, quantized: Iterable[str]) -> tuple[int, int]:
    """(elements, bits as stored) of the floating parameters of ``model`` with two or more
    dimensions that are not the weight of one of the ``quantized`` modules (names); a parameter
    shared by several modules counts once, and not at all when one of them is quantised: the
    parameters :func:`unquantized_weights` lists."""
    modules, params = dict(model.named_modules()), dict(model.named_parameters())
    kept = [params[name] for name in unquantized_weights(model, {q: modules[q] for q in quantized})]
    return sum(p.numel() for p in kept), sum(8 * p.numel() * p.element_size() for p in kept)


def layer_blocks(
    layers: dict[str, nn.Module], group_size: int, unit_groups: int, unit: str = "block", aligned: bool = False
) -> list[LayerBlocks]:
    """Layouts of all quantised layers with the given group size and allocation unit
    (``aligned``: whole-layer units in row-aligned groups, :meth:`LayerBlocks.with_unit`)."""
    return [
        LayerBlocks(n, tuple(m.weight.shape), group_size, unit_groups).with_unit(unit, group_size, unit_groups,
                                                                                aligned)
        for n, m in layers.items()
    ]


def check_finite(layers: dict[str, nn.Module]) -> None:
    """Raise ``ValueError`` naming the first layer whose weight holds NaN or Inf."""
    for name, mod in layers.items():
        w = mod.weight.detach()
        if not torch.isfinite(w).all():
            bad = int((~torch.isfinite(w)).sum())
            raise ValueError(
                f"layer '{name}' has {bad} non-finite weight(s) (NaN/Inf): fix or reload the "
                "checkpoint before quantising"
            )


def check_model_finite(model: nn.Module) -> None:
    """Raise ``ValueError`` naming the first floating parameter or buffer of ``model`` (quantised
    or not: a BatchNorm weight or running variance poisons every output too) that holds NaN or Inf."""
    named = [*model.named_parameters(), *model.named_buffers()]
    for name, t in named:
        if t.is_floating_point() and not bool(torch.isfinite(t.detach()).all()):
            bad = int((~torch.isfinite(t.detach())).sum())
            raise ValueError(f"'{name}' has {bad} non-finite value(s) (NaN/Inf): fix or reload the checkpoint "
                             "before quantising")


def checked_layers(
    model: nn.Module, per_layer: Mapping[str, object] | None = None, what: str = "", fix: str = "",
    exclude: Sequence[str] = (),
) -> dict[str, nn.Module]:
    """:func:`quantizable_layers` (those ``exclude`` does not match) after :func:`check_finite`;
    with ``per_layer`` (a baseline's statistics by layer name) also a ``ValueError`` naming the
    layers it lacks: ``"no <what> for layers [...]: <fix>"``."""
    layers = quantizable_layers(model, tuple(exclude))
    check_finite(layers)
    missing = [n for n in layers if per_layer is not None and n not in per_layer]
    if missing:
        raise ValueError(f"no {what} for layers {missing[:3]}: {fix}")
    return layers
