"""The library config each pipeline row runs with, from params.yaml (no Prefect, no MLflow: the
benchmarks and a GPU machine without the pipeline's packages read it too).

* :func:`method_settings`: (posterior, quant) of a BayesQ row.
* :data:`BASELINE_CONFIGS`: the config of each baseline row.
* :func:`method_config`: either, for any row name.
"""

from __future__ import annotations

from bayesq.baselines.aciq import ACIQConfig
from bayesq.baselines.adaround import AdaRoundConfig
from bayesq.baselines.anneal import AnnealConfig
from bayesq.baselines.awq import AWQConfig
from bayesq.baselines.bitsplit import BitSplitConfig
from bayesq.baselines.blockwise import BlockwiseConfig
from bayesq.baselines.brecq import BayesQBRECQConfig, BRECQConfig
from bayesq.baselines.dorefa import DoReFaConfig
from bayesq.baselines.gptq import GPTQConfig
from bayesq.baselines.hawq import HAWQConfig
from bayesq.baselines.lsq import LSQConfig, StepGradient
from bayesq.baselines.ocs import OCSConfig
from bayesq.baselines.rtn import RTNConfig
from bayesq.baselines.smoothquant import SmoothQuantConfig
from bayesq.baselines.zeroq import ZeroQConfig
from bayesq.config import BayesQConfig, Codebook, Curvature, Granularity, Objective, Prior, Rounding
from bayesq.settings import replace
from flows.methods import BAYESQ_ROWS, Method

# the library config of each baseline row (bayesq.methods): params.yaml's quant and baselines settings
# (quant, baselines, seed) -> config
BASELINE_CONFIGS = {
    Method.RTN_TENSOR: lambda q, b, seed: RTNConfig(Granularity.TENSOR, q),
    Method.RTN_CHANNEL: lambda q, b, seed: RTNConfig(Granularity.CHANNEL, q),
    Method.RTN_GROUP: lambda q, b, seed: RTNConfig(Granularity.GROUP, q),
    Method.ACIQ: lambda q, b, seed: ACIQConfig(quant=q),
    Method.CLIP_BLOCK: lambda q, b, seed: BlockwiseConfig(Codebook.UNIFORM, q),
    Method.LLOYD_BLOCK: lambda q, b, seed: BlockwiseConfig(Codebook.LLOYD, q),
    Method.HAWQ: lambda q, b, seed: HAWQConfig(quant=q, probes=b.hawq_probes, seed=seed),
    Method.ZEROQ: lambda q, b, seed: ZeroQConfig(quant=q, seed=seed),
    Method.GPTQ: lambda q, b, seed: GPTQConfig(q, select=b.select, group_sizes=tuple(b.group_sizes),
                                         act_order=b.gptq_act_order, damp=b.gptq_damp,
                                         bias_correction=b.bias_correction),
    Method.OPTQ: lambda q, b, seed: GPTQConfig(q, select=b.select, group_sizes=tuple(b.group_sizes),
                                         act_order=False, damp=b.gptq_damp, bias_correction=b.bias_correction),
    Method.AWQ: lambda q, b, seed: AWQConfig(q, select=b.select, group_sizes=tuple(b.group_sizes), grid=b.awq_grid,
                                       bias_correction=b.bias_correction),
    Method.SMOOTHQUANT: lambda q, b, seed: SmoothQuantConfig(q, select=b.select, group_sizes=tuple(b.group_sizes),
                                                       alpha=b.smoothquant_alpha, bias_correction=b.bias_correction),
    Method.ANNEAL: lambda q, b, seed: AnnealConfig(q, steps=b.anneal_steps, search_inputs=b.anneal_inputs, seed=seed,
                                             bias_correction=b.bias_correction),
    Method.ADAROUND: lambda q, b, seed: AdaRoundConfig(q, select=b.select, group_sizes=tuple(b.group_sizes),
                                                 bias_correction=b.bias_correction, iters=b.adaround_iters,
                                                 lam=b.adaround_lambda),
    Method.BRECQ: lambda q, b, seed: BRECQConfig(q, select=b.select, group_sizes=tuple(b.group_sizes),
                                           bias_correction=b.bias_correction, iters=b.brecq_iters,
                                           lam=b.adaround_lambda, seed=seed),
    Method.LSQ: lambda q, b, seed: LSQConfig(q, select=b.select, group_sizes=tuple(b.group_sizes),
                                       bias_correction=b.bias_correction, iters=b.lsq_iters, lr=b.lsq_lr),
    Method.LSQ_PLUS: lambda q, b, seed: LSQConfig(q, select=b.select, group_sizes=tuple(b.group_sizes),
                                            bias_correction=b.bias_correction, offset=True, iters=b.lsq_iters,
                                            lr=b.lsq_lr),
    Method.PACT: lambda q, b, seed: LSQConfig(q, select=b.select, group_sizes=tuple(b.group_sizes),
                                        bias_correction=b.bias_correction, gradient=StepGradient.PACT,
                                        iters=b.pact_iters, lr=b.pact_lr),
    Method.DOREFA: lambda q, b, seed: DoReFaConfig(q, select=b.select, group_sizes=tuple(b.group_sizes),
                                             bias_correction=b.bias_correction, iters=b.dorefa_iters,
                                             lr=b.dorefa_lr),
    Method.BIT_SPLIT: lambda q, b, seed: BitSplitConfig(q, select=b.select, group_sizes=tuple(b.group_sizes),
                                                  bias_correction=b.bias_correction, epochs=b.bitsplit_epochs),
    Method.OCS: lambda q, b, seed: OCSConfig(q, select=b.select, group_sizes=tuple(b.group_sizes),
                                       expand_ratios=tuple(b.ocs_expand_ratios), act_order=b.gptq_act_order,
                                       damp=b.gptq_damp, bias_correction=b.bias_correction),
}


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
    schedule), baselines through :data:`BASELINE_CONFIGS`."""
    m = Method(method)
    if m is Method.BAYESQ_BRECQ:
        bayesq, quant = method_config(Method.BAYESQ, params, budget, seed)
        return BayesQBRECQConfig(bayesq, BASELINE_CONFIGS[Method.BRECQ](params.quant, params.baselines, seed)), quant
    if m in BAYESQ_ROWS:  # bayesq-brecq returned above
        posterior, quant = method_settings(params, m)
        distill = params.distill if m is Method.BAYESQ_DISTILL else replace(params.distill, max_budget=0.0)
        return BayesQConfig(budget=budget, posterior=posterior, quant=quant, allocation=params.allocation,
                            distill=distill, seed=seed), quant
    return BASELINE_CONFIGS[m](params.quant, params.baselines, seed), None
