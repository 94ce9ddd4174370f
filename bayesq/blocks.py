"""Which layers are quantised, and how each weight is cut into scale groups and allocation units.

Layout (shared by BayesQ, the baselines and the storage accounting): a Linear/Conv2d weight of
shape (out, in[, kh, kw]) is flattened row-major, output channel first, to ``numel`` values;
consecutive runs of ``group_size`` values share one scale and zero-point (the last group may be
shorter); ``unit_groups`` consecutive groups form one allocation unit with one bit-width.
Per-tensor and per-channel grids are the same layout with ``group_size = numel`` or ``= row``.
"""

from __future__ import annotations

import math
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
    """

    name: str
    shape: tuple[int, ...]
    group_size: int
    unit_groups: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row(self) -> int:
        """Weights per output channel."""
        return self.numel // self.shape[0]

    @property
    def n_groups(self) -> int:
        return math.ceil(self.numel / self.group_size)

    @property
    def n_units(self) -> int:
        return math.ceil(self.n_groups / self.unit_groups)

    def unit_group_ranges(self) -> list[tuple[int, int]]:
        """[start, stop) group indices of each unit."""
        u = self.unit_groups
        return [(s, min(s + u, self.n_groups)) for s in range(0, self.n_groups, u)]

    def unit_sizes(self) -> list[tuple[int, int]]:
        """(n_weights, n_groups) of each unit."""
        out = []
        for s, e in self.unit_group_ranges():
            n = min(e * self.group_size, self.numel) - s * self.group_size
            out.append((n, e - s))
        return out

    def group_unit(self) -> torch.Tensor:
        """(n_groups,) int64: the unit each group belongs to."""
        return torch.arange(self.n_groups) // self.unit_groups

    def to_groups(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cut a (numel,) tensor into (n_groups, group_size) rows plus a 0/1 mask.

        Padding of the last group repeats its last real value, so min/max are unchanged.
        """
        pad = self.n_groups * self.group_size - self.numel
        mask = torch.ones(self.n_groups * self.group_size, dtype=flat.dtype)
        if pad:
            flat = torch.cat([flat, flat[-1:].expand(pad)])
            mask[-pad:] = 0
        g = self.group_size
        return flat.reshape(-1, g), mask.reshape(-1, g)  # (G, g)

    def from_groups(self, groups: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_groups`: (n_groups, group_size) -> weight of ``shape``."""
        return groups.reshape(-1)[: self.numel].reshape(self.shape)

    def with_granularity(self, group_size: int, unit_weights: int) -> "LayerBlocks":
        """Same weight with another group size; units hold about ``unit_weights`` weights."""
        return LayerBlocks(self.name, self.shape, group_size, max(1, unit_weights // group_size))


def quantizable_layers(model: nn.Module, exclude: tuple[str, ...] = ()) -> dict[str, nn.Module]:
    """Linear and Conv2d modules by name, in network order.

    Raises:
        ValueError: a weight-bearing layer type BayesQ cannot quantise (Conv1d, ConvTranspose,
            ...) that is not listed in ``exclude``, or no Linear/Conv2d layer at all.
    """
    layers: dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        if name in exclude:
            continue
        if isinstance(mod, _UNSUPPORTED):
            raise ValueError(
                f"unsupported layer '{name}' ({type(mod).__name__}): BayesQ quantises Linear and "
                "Conv2d weights; pass its name in `exclude` to keep it in floating point"
            )
        if isinstance(mod, SUPPORTED):
            layers[name] = mod
    if not layers:
        raise ValueError("the model has no Linear or Conv2d layer to quantise")
    return layers


def layer_blocks(layers: dict[str, nn.Module], group_size: int, unit_groups: int) -> list[LayerBlocks]:
    """Layouts of all quantised layers with the given group size and unit size."""
    return [LayerBlocks(n, tuple(m.weight.shape), group_size, unit_groups) for n, m in layers.items()]


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
