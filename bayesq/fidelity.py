"""A quantised model against its full-precision original on the same test examples, streamed
batch by batch (no logits are kept, so a language model's (N, T, V) outputs never sit in memory),
with 95 % paired bootstrap intervals.

Per example ``i`` (:func:`score_examples`):

* ``kl_i = KL(p_FP(.|x_i) || p_Q(.|x_i))`` in nats (per-token outputs: the mean over the
  example's real tokens, :func:`bayesq.comparison.kl_per_example`);
* ``agree_i``: top-1 agreement (per-token: the share of real tokens that agree);
* with labels, ``correct_i`` of each model (``argmax_c z_ic == y_i``);
* for a causal language model, each model's summed next-token negative log-likelihood over the
  example's real tokens, ``nll_i = - sum_{t: m_i,t = m_i,t+1 = 1} log p(x_{i,t+1} | x_{i,<=t})``,
  and the count ``n_i`` of those predicted tokens.

A model without a head returns features (:class:`bayesq.forward.Likelihood` ``gaussian``), and is
scored by what such models are used for instead of KL and agreement
(:mod:`bayesq.comparison`): the relative error of its final hidden states over the example's
real tokens, ``||F_Q - F_FP|| / ||F_FP||``; the cosine similarity of the two models' mean-pooled
embeddings; and whether the example's nearest neighbour within the test draw is the same for
both models (each among its own embeddings).

Summaries (:func:`fidelity_report`), each with the percentile interval of the paired bootstrap
over examples (:func:`bayesq.comparison.bootstrap_means`: the same resampled examples for both
models, as ``reports/paired.json``): mean KL, agreement, accuracy of each model and their
difference ``Q - FP`` (points), and perplexity per token ``exp(sum_i nll_i / sum_i n_i)`` of each
model with the ratio ``PPL_Q / PPL_FP`` (resampled as a ratio of sums).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bayesq.comparison import (
    RESAMPLES, SEED, agreement_per_example, bootstrap_means, cosine_per_example, feature_error_per_example,
    kl_per_example, neighbour_agreement, percentile, pooled_embeddings,
)
from bayesq.evaluation import each_batch
from bayesq.forward import Batch, Likelihood, predicted

LEVEL = 0.95


@dataclass(frozen=True)
class ExampleScores:
    """Per-example comparison of a quantised model with FP on N test examples (float64 (N,) each;
    ``kl`` / ``agree`` for a model with logits, ``feature_error`` / ``cosine`` / ``neighbour`` for
    one without a head; ``correct_*`` only with labels, ``nll_*`` / ``tokens`` only for a causal
    language model)."""

    kl: Tensor | None = None
    agree: Tensor | None = None
    correct_fp: Tensor | None = None
    correct_q: Tensor | None = None
    nll_fp: Tensor | None = None
    nll_q: Tensor | None = None
    tokens: Tensor | None = None
    feature_error: Tensor | None = None
    cosine: Tensor | None = None
    neighbour: Tensor | None = None

    @property
    def features(self) -> bool:
        """Whether these are the feature measures of a model without a head."""
        return self.feature_error is not None

    @property
    def primary(self) -> Tensor:
        """The (N,) per-example loss methods are compared by: KL, or a headless model's feature error."""
        return self.feature_error if self.features else self.kl

    @property
    def n(self) -> int:
        return int(self.primary.numel())


def next_token_nll(z: Tensor, input_ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per example, the summed next-token NLL and the number of predicted tokens.

    Args:
        z: (B, T, V) logits; position ``t`` predicts token ``t + 1``.
        input_ids: (B, T) int64.
        mask: (B, T) bool real tokens; a prediction counts when both its position and the
            predicted token are real.

    Returns:
        ((B,) float64 sum of ``-log softmax(z_t)[x_{t+1}]``, (B,) float64 counts).
    """
    keep = (mask[:, :-1] & mask[:, 1:]).to(z.device)
    logp = F.log_softmax(z[:, :-1][keep].double(), dim=-1)
    target = input_ids[:, 1:].to(z.device)[keep]
    nll = -logp.gather(1, target[:, None])[:, 0]
    rows = keep.nonzero(as_tuple=True)[0]
    total = torch.zeros(z.shape[0], dtype=torch.float64, device=z.device).index_add_(0, rows, nll)
    return total, keep.sum(1).double()


def score_examples(fp: nn.Module, quantized: nn.Module, batches: Sequence[Batch], labels: Tensor | None = None,
                   causal_lm: bool = False, desc: str | None = "compare with FP") -> ExampleScores:
    """Both models on every batch, in order (eval mode, no gradients; ``desc``: a progress bar).

    Args:
        fp, quantized: the full-precision model and its quantised copy (same outputs' shapes).
        batches: the test inputs (tensors or dicts of tensors; ``input_ids`` / ``attention_mask``
            for a language model).
        labels: (N,) int64 class of each example, or None (no accuracy). Only for (B, C) logits.
        causal_lm: also the next-token NLL of each model (needs ``input_ids`` in every batch).

    Raises:
        ValueError: labels given for per-token outputs or of another count than the examples.
    """
    parts: dict[str, list[Tensor]] = {k: [] for k in ("kl", "agree", "correct_fp", "correct_q", "nll_fp", "nll_q",
                                                      "tokens", "feature_error", "cosine")}
    emb: dict[str, list[Tensor]] = {"fp": [], "q": []}  # a headless model's pooled embeddings, for neighbours
    offset = 0

    def one(_m: nn.Module, batch: Batch) -> Tensor:
        nonlocal offset
        z_p, mask, likelihood = predicted(fp, batch)
        z_q, _ = predicted(quantized, batch)[:2]
        b = z_p.shape[0]
        if likelihood is Likelihood.GAUSSIAN:
            if labels is not None:
                raise ValueError("labels were given but the model has no head (it returns features): accuracy needs "
                                 "class logits; drop the label column (the feature measures need none)")
            parts["feature_error"].append(feature_error_per_example(z_p, z_q, mask).cpu())
            e_p, e_q = pooled_embeddings(z_p, mask).cpu(), pooled_embeddings(z_q, mask).cpu()
            parts["cosine"].append(cosine_per_example(e_p, e_q))
            emb["fp"].append(e_p)
            emb["q"].append(e_q)
            offset += b
            return z_p.new_zeros(())
        parts["kl"].append(kl_per_example(z_p, z_q, mask).cpu())
        parts["agree"].append(agreement_per_example(z_p, z_q, mask).double().cpu())
        if labels is not None:
            if mask is not None:
                raise ValueError("labels were given but the model has per-token outputs: accuracy is for "
                                 "classifiers; drop the label column (KL, agreement and perplexity need none)")
            y = labels[offset:offset + b].to(z_p.device)
            if len(y) != b:
                raise ValueError(f"{len(labels)} labels for at least {offset + b} examples: pass one label per example")
            parts["correct_fp"].append((z_p.argmax(-1) == y).double().cpu())
            parts["correct_q"].append((z_q.argmax(-1) == y).double().cpu())
        if causal_lm:
            m = mask if mask is not None else torch.ones(z_p.shape[:2], dtype=torch.bool)
            nll_p, count = next_token_nll(z_p, batch["input_ids"], m)
            parts["nll_fp"].append(nll_p.cpu())
            parts["nll_q"].append(next_token_nll(z_q, batch["input_ids"], m)[0].cpu())
            parts["tokens"].append(count.cpu())
        offset += b
        return z_p.new_zeros(())

    with torch.no_grad():
        fp_training = fp.training
        fp.eval()
        try:
            each_batch(quantized, list(batches), one, desc, terminal_only=False)
        finally:
            fp.train(fp_training)
    if labels is not None and offset != len(labels):
        raise ValueError(f"{len(labels)} labels for {offset} examples: pass one label per example")
    if not offset:
        raise ValueError("no test batches to compare: pass at least one input batch")
    out = {k: torch.cat(v) if v else None for k, v in parts.items()}
    if emb["fp"]:
        if offset < 2:
            raise ValueError("one test example: nearest-neighbour agreement needs at least two; pass more test inputs")
        out["neighbour"] = neighbour_agreement(torch.cat(emb["fp"]), torch.cat(emb["q"])).double()
    return ExampleScores(**out)


@dataclass(frozen=True)
class Estimate:
    """A value with its ``LEVEL`` bootstrap interval."""

    value: float
    low: float
    high: float

    def fmt(self, digits: int = 4, scale: float = 1.0) -> str:
        v, lo, hi = (scale * x for x in (self.value, self.low, self.high))
        return f"{v:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _interval(resampled: Tensor, value: float, level: float = LEVEL) -> Estimate:
    s = resampled.sort().values
    return Estimate(float(value), float(percentile(s, (1 - level) / 2)), float(percentile(s, (1 + level) / 2)))


@dataclass(frozen=True)
class FidelityReport:
    """What :func:`fidelity_report` returns (None: not measurable without labels / not a causal LM).

    ``accuracy_diff`` is ``acc_Q - acc_FP`` in points (x100); ``perplexity_ratio`` is ``PPL_Q / PPL_FP``.
    """

    n: int
    kl: Estimate | None = None
    agreement: Estimate | None = None
    accuracy_fp: Estimate | None = None
    accuracy_q: Estimate | None = None
    accuracy_diff: Estimate | None = None
    perplexity_fp: Estimate | None = None
    perplexity_q: Estimate | None = None
    perplexity_ratio: Estimate | None = None
    tokens: int = 0
    resamples: int = RESAMPLES
    seed: int = SEED
    feature_error: Estimate | None = None
    cosine: Estimate | None = None
    neighbour: Estimate | None = None

    def as_dict(self) -> dict[str, Any]:
        """Flat JSON-able record: ``<metric>``, ``<metric>_ci_low``, ``<metric>_ci_high`` for each
        measured metric, plus ``n``, ``tokens``, ``resamples``, ``seed``."""
        out: dict[str, Any] = {"n": self.n, "tokens": self.tokens, "resamples": self.resamples, "seed": self.seed}
        for key, val in asdict(self).items():
            if isinstance(val, dict):
                out |= {key: val["value"], f"{key}_ci_low": val["low"], f"{key}_ci_high": val["high"]}
        return out

    def lines(self) -> list[str]:
        """Human-readable lines (value [95 % interval])."""
        out = [f"test examples          {self.n}"]
        if self.kl is not None:
            out += [f"KL(FP || Q), nats      {self.kl.fmt(5)}",
                    f"top-1 agreement, %     {self.agreement.fmt(2, 100)}"]
        if self.feature_error is not None:
            out += [f"feature error, %       {self.feature_error.fmt(3, 100)}  (||F_Q - F_FP|| / ||F_FP||, "
                    "final hidden states)",
                    f"embedding cosine       {self.cosine.fmt(5)}  (mean-pooled)",
                    f"neighbour agreement, % {self.neighbour.fmt(2, 100)}  (nearest other test example)"]
        if self.accuracy_diff is not None:
            out += [f"accuracy FP, %         {self.accuracy_fp.fmt(2, 100)}",
                    f"accuracy Q, %          {self.accuracy_q.fmt(2, 100)}",
                    f"accuracy Q - FP, pts   {self.accuracy_diff.fmt(2)}"]
        if self.perplexity_ratio is not None:
            out += [f"perplexity FP          {self.perplexity_fp.fmt(3)}  ({self.tokens} tokens)",
                    f"perplexity Q           {self.perplexity_q.fmt(3)}",
                    f"perplexity Q / FP      {self.perplexity_ratio.fmt(4)}"]
        return out


def fidelity_report(scores: ExampleScores, resamples: int = RESAMPLES, seed: int = SEED) -> FidelityReport:
    """Means and paired bootstrap intervals of :class:`ExampleScores` (one set of resamples for
    every metric: :func:`bayesq.comparison.bootstrap_means`)."""
    simple = (("feature_error", scores.feature_error), ("cosine", scores.cosine), ("neighbour", scores.neighbour)) \
        if scores.features else (("kl", scores.kl), ("agreement", scores.agree))
    cols = [c for _, c in simple]
    labelled = scores.correct_fp is not None
    causal = scores.nll_fp is not None
    if labelled:
        cols += [scores.correct_fp, scores.correct_q, 100 * (scores.correct_q - scores.correct_fp)]
    if causal:
        cols += [scores.nll_fp, scores.nll_q, scores.tokens]
    x = torch.stack([c.double() for c in cols], 1)  # (N, K)
    boot = bootstrap_means(x, resamples, seed)  # (resamples, K)
    mean = x.mean(0)
    out: dict[str, Any] = {name: _interval(boot[:, k], mean[k]) for k, (name, _) in enumerate(simple)}
    k = len(simple)
    if labelled:
        out |= {"accuracy_fp": _interval(boot[:, k], mean[k]), "accuracy_q": _interval(boot[:, k + 1], mean[k + 1]),
                "accuracy_diff": _interval(boot[:, k + 2], mean[k + 2])}
        k += 3
    if causal:
        tok = boot[:, k + 2].clamp_min(1e-12)
        ppl_fp, ppl_q = (boot[:, k] / tok).exp(), (boot[:, k + 1] / tok).exp()
        total = float(scores.tokens.sum())
        if total < 1:
            raise ValueError("no predicted tokens: every test input has fewer than two real tokens")
        v_fp, v_q = math.exp(float(scores.nll_fp.sum()) / total), math.exp(float(scores.nll_q.sum()) / total)
        out |= {"perplexity_fp": _interval(ppl_fp, v_fp), "perplexity_q": _interval(ppl_q, v_q),
                "perplexity_ratio": _interval(ppl_q / ppl_fp, v_q / v_fp)}
    return FidelityReport(scores.n, **out, tokens=int(scores.tokens.sum()) if causal else 0, resamples=resamples,
                          seed=seed)
