"""The library config each pipeline row runs with, from params.yaml (no Prefect, no MLflow: the
benchmarks and a GPU machine without the pipeline's packages read it too).

* :func:`method_settings`: (posterior, quant) of a BayesQ row.
* :meth:`flows.methods.BaselineSettings.config`: the config of each baseline row (its registry
  entry's class with params.yaml's ``baselines.<method>`` section).
* :func:`method_config`: either, for any row name.
"""

from __future__ import annotations

from bayesq.baselines.brecq import BayesQBRECQConfig
from bayesq.config import BayesQConfig, Curvature, Objective, Prior, Rounding
from bayesq.settings import replace
from flows.methods import BAYESQ_ROWS, Method


def method_settings(params, method) -> tuple:
    """(posterior, quant) settings a BayesQ row runs with: params.yaml's, except ``bayesq-ef``
    (K-FAC posterior, error-feedback rounding) and ``bayesq-paper`` (the paper-literal
    configuration: the Fisher from every calibration input, prior precision fixed at
    ``posterior.damping``, the ``draws`` objective, nearest rounding, no bias correction and no output offset)."""
    if Method(method) == Method.BAYESQ_EF:
        return (replace(params.posterior, curvature=Curvature.KFAC),
                replace(params.quant, rounding=Rounding.ERROR_FEEDBACK))
    if Method(method) == Method.BAYESQ_PAPER:
        return (replace(params.posterior, prior=Prior.FIXED, curvature_share=1.0),
                replace(params.quant, objective=Objective.DRAWS, rounding=Rounding.NEAREST, bias_correction=False,
                                        output_offset=False))
    return params.posterior, params.quant


def method_config(method: str, params, budget: float, seed: int):
    """(library config, QuantConfig of a BayesQ row or None) for ``method`` with params.yaml's
    settings: BayesQ rows through :func:`method_settings` (distillation only for
    ``bayesq-distill``; ``bayesq-brecq``: BayesQ's, then the ``brecq`` row's reconstruction
    schedule), baselines through :meth:`flows.methods.BaselineSettings.config`."""
    m = Method(method)
    if m is Method.BAYESQ_BRECQ:
        bayesq, quant = method_config(Method.BAYESQ, params, budget, seed)
        return BayesQBRECQConfig(bayesq, params.baselines.config(Method.BRECQ, params.quant, seed)), quant
    if m in BAYESQ_ROWS:  # bayesq-brecq returned above
        posterior, quant = method_settings(params, m)
        distill = params.distill if m is Method.BAYESQ_DISTILL else replace(params.distill, max_budget=0.0)
        return BayesQConfig(budget=budget, posterior=posterior, quant=quant, allocation=params.allocation,
                            distill=distill, seed=seed), quant
    return params.baselines.config(m, params.quant, seed), None
