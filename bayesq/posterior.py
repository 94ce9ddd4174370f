"""Diagonal Laplace posterior N(mu, diag(sigma^2)) over the quantised weights.

    precision_i = scale * F_sum_i + damping,   scale = n_data / n_cal  (1 when n_data = 0)
    sigma_i^2   = clip(1 / precision_i, var_min, var_max),   mu = trained weights.

The cost of a weight error d is the expected increase of the task loss,
``0.5 * sum_i d_i^2 / sigma_i^2`` (DESIGN.md section 2): whitened coordinates are
``z_i = (w_i - mu_i) / sigma_i``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bayesq.config import PosteriorConfig


@dataclass(frozen=True)
class DiagonalPosterior:
    """Per-layer posterior means and variances (float64, shaped like each weight)."""

    mean: dict[str, torch.Tensor]
    variance: dict[str, torch.Tensor]
    n_examples: int

    def std(self, name: str) -> torch.Tensor:
        return self.variance[name].sqrt()

    def precision(self, name: str) -> torch.Tensor:
        return 1.0 / self.variance[name]

    def sample(self, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """One draw ``mu + sigma * eps`` per layer."""
        return {
            n: m + self.variance[n].sqrt() * torch.randn(m.shape, generator=generator, dtype=m.dtype)
            for n, m in self.mean.items()
        }


def fit_diagonal_posterior(
    fisher_sum: dict[str, torch.Tensor],
    n_examples: int,
    weights: dict[str, torch.Tensor],
    cfg: PosteriorConfig,
) -> DiagonalPosterior:
    """Damped, clipped diagonal Laplace posterior from a summed Fisher diagonal.

    Raises:
        ValueError: no calibration examples, or a Fisher entry that is negative or not finite.
    """
    if n_examples < 1:
        raise ValueError("empty calibration set: fit the posterior on at least one input")
    scale = cfg.n_data / n_examples if cfg.n_data else 1.0
    var: dict[str, torch.Tensor] = {}
    for name, f in fisher_sum.items():
        if not torch.isfinite(f).all() or (f < 0).any():
            raise ValueError(
                f"Fisher diagonal of layer '{name}' has negative or non-finite entries; "
                "check the model's logits on the calibration data for NaN/Inf"
            )
        precision = scale * f.double() + cfg.damping
        var[name] = (1.0 / precision).clamp(cfg.var_min, cfg.var_max)
    mean = {n: weights[n].detach().double().clone() for n in fisher_sum}
    return DiagonalPosterior(mean=mean, variance=var, n_examples=n_examples)
