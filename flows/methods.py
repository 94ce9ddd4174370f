"""The methods the pipeline knows (``params.yaml``'s names) and the groups of rows they form."""

from __future__ import annotations

from enum import Enum


class Method(str, Enum):
    """Quantization methods the pipeline knows."""

    BAYESQ = "bayesq"
    BAYESQ_EF = "bayesq-ef"  # K-FAC posterior (error feedback in its input factor)
    BAYESQ_DISTILL = "bayesq-distill"  # BayesQ + posterior-predictive distillation (budget <= distill.max_budget)
    BAYESQ_PAPER = "bayesq-paper"  # the paper-literal configuration: fixed prior, draws objective, nearest rounding
    BAYESQ_BRECQ = "bayesq-brecq"  # BayesQ's encoding rounded again by BRECQ's block reconstruction, no bias correction
    RTN_TENSOR = "rtn-tensor"
    RTN_CHANNEL = "rtn-channel"
    RTN_GROUP = "rtn-group"
    GPTQ = "gptq"
    AWQ = "awq"
    HAWQ = "hawq"
    ZEROQ = "zeroq"  # ZeroQ: per-layer widths from the KL on data distilled from BatchNorm statistics (data-free)
    ACIQ = "aciq"
    ADAROUND = "adaround"  # AdaRound's learned up/down rounding on GPTQ's grids and variants
    BRECQ = "brecq"  # BRECQ: AdaRound's rounding learned per residual block / transformer layer on GPTQ's grids
    LSQ = "lsq"  # LSQ's learned step sizes on GPTQ's grids and variants, nearest rounding
    LSQ_PLUS = "lsq-plus"  # LSQ+: learned step sizes and offsets (zero-points)
    PACT = "pact"  # PACT's learned clipping level (the clipped ends' gradient only) on GPTQ's grids and variants
    DOREFA = "dorefa"  # DoReFa's straight-through fine-tuning of the latent weights on GPTQ's grids and variants
    BIT_SPLIT = "bit-split"  # Bit-Split: symmetric grids, ternary bit planes fitted in turn, on GPTQ's layouts and variants
    OCS = "ocs"  # OCS: the largest-|w| input channels split in two, then GPTQ on the expanded layers
    OPTQ = "optq"  # GPTQ as first published (OPTQ): columns in their natural order, no act-order
    SMOOTHQUANT = "smoothquant"  # SmoothQuant's activation-to-weight migration, weight-only (on AWQ's code)
    ANNEAL = "anneal"  # one width per layer searched by simulated annealing on the calibration KL (GPTQ rounding)
    CLIP_BLOCK = "clip-block"  # per-block uniform grids with MSE-optimal clipping (data-free)
    LLOYD_BLOCK = "lloyd-block"  # per-block non-uniform Lloyd (k-means) tables (data-free)


#: Rows that run BayesQ's posterior, tables and encoding; those in SHARED_PREP start from the
#: ``bayesq`` row's (its saved encoding: the same prep, so one fit serves them).
BAYESQ_ROWS = (Method.BAYESQ, Method.BAYESQ_EF, Method.BAYESQ_DISTILL, Method.BAYESQ_PAPER, Method.BAYESQ_BRECQ)


SHARED_PREP = (Method.BAYESQ_DISTILL, Method.BAYESQ_BRECQ)


#: Baselines on GPTQ's grids and variants: BayesQ's allocation is one more of their variants.
GRID_METHODS = (Method.GPTQ, Method.OPTQ, Method.ADAROUND, Method.BRECQ, Method.LSQ, Method.LSQ_PLUS, Method.PACT,
                Method.DOREFA, Method.BIT_SPLIT)


#: Baselines that read calibration inputs (and params.yaml's calibration and baselines sections).
CALIBRATED_METHODS = (*GRID_METHODS, Method.OCS, Method.AWQ, Method.SMOOTHQUANT, Method.ANNEAL,
                      Method.ZEROQ)  # ZeroQ: the shape of one calibration batch, never its values


#: Methods ``--method`` / ``methods:`` accept (params.yaml's names).
BYO_METHODS = tuple(m.value for m in Method)


SHIFT_METHODS = (Method.BAYESQ, Method.GPTQ, Method.OPTQ, Method.AWQ)  # BayesQ and the strongest rivals with corrections


DEPLOY_METHODS = (Method.BAYESQ, Method.GPTQ, Method.AWQ)  # methods whose encodings MatMulNBits stores: BayesQ, its rivals
