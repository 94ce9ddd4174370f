"""Bias correction: move each quantised layer's mean output back to the full-precision one.

A weight error ``D = W - Q`` (out x d_in; Conv2d: d_in = in/groups*kh*kw unfolded patches)
shifts a layer's output on input ``a`` by ``D a``. Its mean over the calibration inputs and
positions is

    s = D abar,     abar = mean_{n,t} a_{n,t}                         (out,) float64

(per convolution group g: rows of group g against ``abar[g]``). Adding ``s`` back to the output
is the least-squares optimum over a free output offset: ``min_b E ||D a - b||^2`` is reached at
``b = s``, leaving only the zero-mean part of the error, so the layer-output error that error
feedback minimises (``tr(D H D^T)`` with ``H = E[a a^T]``) drops by ``||s||^2`` per position.

Where the offset goes, with no new stored parameter:

* the layer's own bias (``bias += s``), when it has one;
* else the BatchNorm that reads exactly the layer's output, in eval mode with running
  statistics (``running_mean -= s``: ``BN(y + s)`` with the mean lowered by ``s`` is ``BN(y)``
  computed from the corrected output);
* else nowhere: the layer is listed in :attr:`BiasCorrection.skipped` with the reason.

Targets are found in one forward pass over one calibration batch (module hooks, tensor
identity); a layer whose output tensor more than one module reads is skipped, since only one
of its readers would be corrected. Statistics are those of the full-precision model
(:func:`bayesq.baselines.activations.input_stats`, the inputs GPTQ's statistics are taken on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch
from torch import nn

from bayesq.forward import Batch, hooked_call


def output_shift(w: torch.Tensor, q: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Mean output shift ``s = (W - Q) abar`` of one layer.

    Args:
        w, q: full-precision and dequantised weights, same shape (out, ...) (read as out x d_in).
        mean: (groups, d_in) mean input ``abar`` per convolution group (Linear: one group).

    Returns:
        (out,) float64; rows of group g use ``mean[g]``.
    """
    groups, d_in = mean.shape
    d = (w.double() - q.double()).reshape(groups, -1, d_in)
    return torch.einsum("gpi,gi->gp", d, mean.double()).reshape(-1)


def _readers(model: nn.Module, batch: Batch, layers: Mapping[str, nn.Module]) -> dict[str, list[str]]:
    """Layer name -> names of the modules that read its output tensor, in one forward pass."""
    outputs: dict[int, tuple[str, torch.Tensor]] = {}  # id -> (layer, tensor kept alive)
    readers: dict[str, list[str]] = {name: [] for name in layers}
    names = {id(m): n for n, m in layers.items()}

    def pre(mod, inputs):
        for x in inputs:
            hit = outputs.get(id(x)) if isinstance(x, torch.Tensor) else None
            if hit is not None and hit[1] is x:
                readers[hit[0]].append(module_names[id(mod)])

    def post(mod, inputs, output):
        outputs[id(output)] = (names[id(mod)], output)

    module_names = {id(m): n for n, m in model.named_modules()}
    leaves = [m for m in model.modules() if not list(m.children())]
    hooked_call(model, batch, post=[(m, post) for m in layers.values()], pre=[(m, pre) for m in leaves])
    return readers


def _is_running_norm(mod: nn.Module) -> bool:
    return isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.running_mean is not None


@dataclass(frozen=True)
class BiasCorrection:
    """Where and from what each layer's mean output shift is corrected.

    Attributes:
        means: layer -> (groups, d_in) float64 mean input ``abar`` on the calibration inputs.
        targets: layer -> state-dict key that absorbs the shift (``<layer>.bias``, added, or
            ``<batchnorm>.running_mean``, subtracted).
        skipped: layer -> why it has no target.
    """

    means: Mapping[str, torch.Tensor]
    targets: Mapping[str, str]
    skipped: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def fit(cls, model: nn.Module, means: Mapping[str, torch.Tensor], calibration: Iterable[Batch]) -> BiasCorrection:
        """Targets of the layers in ``means`` (names of ``model``'s Linear/Conv2d modules), found
        on the first calibration batch.

        Raises:
            ValueError: empty calibration set.
        """
        batch = next(iter(calibration), None)
        if batch is None:
            raise ValueError("empty calibration set: bias correction needs a calibration batch to find where each "
                             "layer's output goes (or set quant.bias_correction: false)")
        layers = {name: model.get_submodule(name) for name in means}
        no_bias = {n: m for n, m in layers.items() if m.bias is None}
        readers = _readers(model, batch, no_bias) if no_bias else {}
        targets, skipped = {}, {}
        for name, mod in layers.items():
            if mod.bias is not None:
                targets[name] = _key(name, "bias")
                continue
            found = readers[name]
            if len(found) == 1 and _is_running_norm(model.get_submodule(found[0])):
                targets[name] = _key(found[0], "running_mean")
            elif len(found) > 1:
                skipped[name] = f"its output is read by {len(found)} modules ({', '.join(found[:3])})"
            else:
                skipped[name] = "no bias, and no BatchNorm with running statistics reads its output"
        return cls(dict(means), targets, skipped)

    def apply(self, qmodel: nn.Module, model: nn.Module) -> None:
        """Correct ``qmodel`` in place: each target absorbs ``output_shift(W, Q, abar)``, with W
        the weight of ``model`` (full precision) and Q the one ``qmodel`` holds (dequantised)."""
        state = dict(qmodel.named_parameters()) | dict(qmodel.named_buffers())
        with torch.no_grad():
            for name, key in self.targets.items():
                q = qmodel.get_submodule(name).weight
                shift = output_shift(model.get_submodule(name).weight, q, self.means[name])
                t = state[key]
                t.add_(shift.to(t.dtype), alpha=-1.0 if key.endswith("running_mean") else 1.0)


def _key(module: str, leaf: str) -> str:
    """The state-dict key of ``module``'s ``leaf`` tensor (the root module's has no prefix)."""
    return f"{module}.{leaf}" if module else leaf
