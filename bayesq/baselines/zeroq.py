"""ZeroQ (Cai et al. 2020, "ZeroQ: A Novel Zero Shot Quantization Framework"): data-free mixed
precision from distilled inputs.

1. **Distilled data.** ``n`` inputs drawn from N(0, 1) in the shape of the model's inputs, then
   optimised so that each input's own statistics at every BatchNorm layer's input match the
   layer's running statistics (ZeroQ's "Batch Normalisation statistics" loss), and the input's
   per-channel statistics match those of normalised data (mean 0, standard deviation 1):

       min_x  sum_{l in BN} ||mu_l(x) - mu_l||^2 / n + ||sigma_l(x) - sigma_l||^2 / n
              + ||mu_0(x)||^2 / n + ||sigma_0(x) - 1||^2 / n

   ``mu_l(x), sigma_l(x)`` (n, C_l) the mean and standard deviation over positions of each input
   and channel, ``mu_l, sigma_l = sqrt(running_var + eps)`` (C_l,) the layer's running
   statistics; Adam (step ``lr``, ZeroQ's 0.5) for ``iters`` (ZeroQ's 500) steps.
2. **Sensitivity.** ``Omega_l(b) = mean_x KL(p_FP(x) || p_l,b(x))``: the KL on the distilled
   inputs with layer ``l`` alone quantised to ``b`` bits (min/max grids per group of
   ``group_size``, nearest rounding), every candidate width of every layer.
3. **Bit-widths.** ``min sum_l Omega_l(b_l)`` under the budget: the greedy knapsack and the exact
   storage accounting every method here shares, one unit per layer as for HAWQ-style (ZeroQ's
   Pareto frontier is solved by dynamic programming; the greedy on the convex hull is within one
   layer of it). The weights are then the min/max grids at those widths.

A model without BatchNorm layers (a transformer: LayerNorm keeps no running statistics) gives
the distillation nothing to match; so does an input of token ids, which has no gradient. Then the
inputs are ZeroQ's own data-free baseline: Gaussian inputs (floating inputs) or uniform random
token ids with every position attended (the last one the model's end-of-sequence token, where its
config names one) (the outcome's ``details["data"]`` says which). Of the
calibration inputs only the first batch's shape, dtype and keys are read, never its values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from bayesq.assignment import allocate
from bayesq.blocks import LayerBlocks, quantizable_layers
from bayesq.canonical import on_canonical
from bayesq.config import QuantConfig
from bayesq.evaluation import kl_per_input, reference_log_probs
from bayesq.expected_loss import LossTable, rtn_table
from bayesq.forward import Batch, call, kept_state
from bayesq.methods import Inputs, Outcome, register
from bayesq.result import QuantizationResult, baseline_result
from bayesq.rounding import encode
from bayesq.settings import validate

EPS = 1e-5  # added to a variance before its square root (BatchNorm's default eps for the input's own)


def batchnorms(model: nn.Module) -> dict[str, nn.modules.batchnorm._BatchNorm]:
    """The model's BatchNorm layers that keep running statistics, by name."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
            and m.running_mean is not None}


def input_statistics(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, C) mean and standard deviation over positions of each input and channel of
    (n, C, ...) ``x`` (the biased variance plus :data:`EPS` under the root)."""
    flat = x.reshape(x.shape[0], x.shape[1], -1)
    return flat.mean(-1), torch.sqrt(flat.var(-1, unbiased=False) + EPS)


def bn_loss(model: nn.Module, x: torch.Tensor, norms: Mapping[str, nn.modules.batchnorm._BatchNorm]) -> torch.Tensor:
    """ZeroQ's loss of the module docstring for the inputs ``x`` (n, C, ...): one forward pass
    with a pre-hook on each of ``norms`` reading its input."""
    n = x.shape[0]
    terms = []

    def hook(module, args):
        mu, sigma = input_statistics(args[0])
        ref_sigma = torch.sqrt(module.running_var + module.eps)
        terms.append(((mu - module.running_mean) ** 2).sum() / n + ((sigma - ref_sigma) ** 2).sum() / n)

    handles = [m.register_forward_pre_hook(hook) for m in norms.values()]
    try:
        call(model, x)
    finally:
        for h in handles:
            h.remove()
    mu0, sigma0 = input_statistics(x)
    return torch.stack(terms).sum() + (mu0 ** 2).sum() / n + ((sigma0 - 1) ** 2).sum() / n


def _vocabulary(model: nn.Module) -> int:
    """The number of token ids the model embeds (its input embedding, else its first nn.Embedding)."""
    getter = getattr(model, "get_input_embeddings", None)
    emb = getter() if callable(getter) else None
    if not isinstance(emb, nn.Embedding):
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise ValueError("ZeroQ draws random token ids for a model with integer inputs, but this model has no "
                         "nn.Embedding to read the vocabulary size from")
    return emb.num_embeddings


def random_batch(model: nn.Module, like: Batch, n: int, gen: torch.Generator) -> tuple[Batch, str]:
    """(``n`` inputs shaped like ``like``, their kind): Gaussian for a floating tensor; for a
    mapping, uniform random ids in ``input_ids`` (ending in the model config's ``eos_token_id``
    where it has one, as its tokenizer's inputs do: T5 requires it), ones in every ``*mask``
    entry and zeros elsewhere."""
    if torch.is_tensor(like):
        if not like.is_floating_point():
            raise ValueError(f"ZeroQ distils floating inputs; the model takes a {like.dtype} tensor: pass a mapping "
                             "with input_ids for token inputs")
        x = torch.randn((n, *like.shape[1:]), generator=gen, dtype=torch.float64)
        return x.to(device=like.device, dtype=like.dtype), "gaussian"
    if "input_ids" not in like:
        raise ValueError(f"ZeroQ needs a floating input tensor or a mapping with input_ids; the batch has keys "
                         f"{sorted(like)}")
    shape = (n, *like["input_ids"].shape[1:])
    ids = torch.randint(0, _vocabulary(model), shape, generator=gen)
    eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    if isinstance(eos, int):
        ids[:, -1] = eos
    out = {}
    for key, value in like.items():
        if key == "input_ids":
            out[key] = ids.to(value.device)
        elif torch.is_tensor(value):
            fill = torch.ones if key.endswith("mask") else torch.zeros
            out[key] = fill((n, *value.shape[1:]), dtype=value.dtype, device=value.device)
        else:
            out[key] = value
    return out, "random tokens"


@on_canonical
def distilled_data(model: nn.Module, like: Batch, *, n: int = 32, iters: int = 500, lr: float = 0.5, seed: int = 0,
                   progress: bool = False) -> tuple[Batch, str]:
    """(ZeroQ's distilled batch of ``n`` inputs, how it was made: "batchnorm", "gaussian" or
    "random tokens"); ``like``: a batch whose shape, dtype and keys are copied (values unread).
    The model comes back as it was (:func:`bayesq.forward.kept_state`)."""
    gen = torch.Generator().manual_seed(seed)
    x, kind = random_batch(model, like, n, gen)
    norms = batchnorms(model)
    if kind != "gaussian" or not norms:
        return x, kind
    with kept_state(model):
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        x = x.clone().requires_grad_(True)
        opt = torch.optim.Adam([x], lr=lr)
        for _ in tqdm(range(iters), desc="ZeroQ distilled data", disable=not progress, leave=False,
                      mininterval=1.0):
            opt.zero_grad()
            bn_loss(model, x, norms).backward()
            opt.step()
    return x.detach(), "batchnorm"


def _layer_units(layers: Mapping[str, nn.Module], cfg: QuantConfig) -> list[LayerBlocks]:
    """One allocation unit per layer (every group of the layer in it)."""
    return [LayerBlocks(n, tuple(m.weight.shape), cfg.group_size,
                        math.ceil(m.weight.numel() / cfg.group_size)) for n, m in layers.items()]


@torch.no_grad()
def sensitivity_table(model: nn.Module, layers: Mapping[str, nn.Module], table: LossTable, batch: Batch,
                      progress: bool = False) -> LossTable:
    """``table`` with each layer's loss replaced by ZeroQ's ``Omega_l(b)``: the mean KL on
    ``batch`` with that layer alone at each candidate's grid (the table's min/max books)."""
    reference = reference_log_probs(model, [batch])
    out = []
    for t in tqdm(table.layers, desc="ZeroQ sensitivity", disable=not progress, leave=False):
        weight = layers[t.blocks.name].weight
        kept = weight.detach().clone()
        w, _ = t.blocks.to_groups(kept.double().reshape(-1))
        omega = []
        try:
            for book in t.books:
                weight.copy_(t.blocks.from_groups(book.dequantize(book.quantize(w))).to(weight.dtype))
                omega.append(float(kl_per_input(reference, model, [batch]).mean()))
        finally:
            weight.copy_(kept)
        loss = torch.tensor([omega], dtype=torch.float64)
        out.append(replace(t, unit_loss=loss, unit_se=torch.zeros_like(loss)))
    return LossTable(tuple(out))


@on_canonical
def zeroq_quantize(model: nn.Module, batch: Batch, budget: float, cfg: QuantConfig = QuantConfig(), *,
                   exclude: Sequence[str] = (), progress: bool = False) -> QuantizationResult:
    """ZeroQ's per-layer bit-widths at ``budget`` average bits (all metadata counted) from the
    sensitivities on ``batch`` (:func:`distilled_data`); min/max grids, nearest rounding.
    ``exclude``: module names or glob patterns kept in floating point.

    Raises:
        ValueError: an infeasible budget, non-finite weights.
    """
    layers = quantizable_layers(model, tuple(exclude))
    weights = {n: m.weight for n, m in layers.items()}
    table = rtn_table(weights, _layer_units(layers, cfg), cfg)
    with kept_state(model):
        model.eval()
        table = sensitivity_table(model, layers, table, batch, progress)
    allocation = allocate(table, budget)
    return baseline_result(model, layers, encode(table, allocation, weights), allocation, table, exclude)


@dataclass(frozen=True)
class ZeroQConfig:
    """ZeroQ (:func:`distilled_data`, :func:`zeroq_quantize`): ``inputs`` distilled inputs,
    ``iters`` Adam steps of step ``lr`` (ZeroQ's 32, 500, 0.5), ``seed`` of the Gaussian start."""

    quant: QuantConfig = field(default_factory=QuantConfig)
    inputs: int = 32
    iters: int = 500
    lr: float = 0.5
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        validate(self, "ZeroQConfig")
        if self.inputs < 1 or self.iters < 0:
            raise ValueError(f"zeroq needs inputs >= 1 and iters >= 0, got inputs={self.inputs}, iters={self.iters}")
        if not self.lr > 0:
            raise ValueError(f"zeroq.lr must be > 0, got {self.lr}")


@register(ZeroQConfig)
def zeroq_method(model: nn.Module, config: ZeroQConfig, budget: float, inputs: Inputs) -> Outcome:
    """ZeroQ: distilled inputs shaped like the first calibration batch (its values unread), then
    :func:`zeroq_quantize`."""
    like = inputs.need_calibration("ZeroQ (the shape of one input batch)")[0]
    batch, kind = distilled_data(model, like, n=config.inputs, iters=config.iters, lr=config.lr, seed=config.seed,
                                 progress=config.progress)
    result = zeroq_quantize(model, batch, budget, config.quant, exclude=tuple(inputs.exclude),
                            progress=config.progress)
    return Outcome(result, {"data": kind})
