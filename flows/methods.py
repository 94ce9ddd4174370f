"""The pipeline's method registry: one :class:`MethodEntry` per row name, everything else derived.

An entry holds a method's ``params.yaml`` / ``--method`` name, its report label, the library
config its rows run with (built from ``params.yaml``'s ``quant`` and ``baselines`` sections and
the row's seed; the handler is the one :func:`bayesq.methods.register` gave that config class),
the sources only its rows run (their cache key leaves out the others') and the groups of rows it
belongs to. :class:`Method`, the labels, the config factories, the sources and the groups are
all read off :data:`METHODS`, so adding a baseline is two places: its module under
``bayesq/baselines/`` (config class and registered handler) and its entry here (docs/usage.md,
"Adding a method").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

from bayesq.baselines.aciq import ACIQConfig
from bayesq.baselines.adaround import AdaRoundConfig
from bayesq.baselines.anneal import AnnealConfig
from bayesq.baselines.awq import AWQConfig
from bayesq.baselines.bitsplit import BitSplitConfig
from bayesq.baselines.blockwise import BlockwiseConfig
from bayesq.baselines.brecq import BRECQConfig
from bayesq.baselines.dorefa import DoReFaConfig
from bayesq.baselines.gptq import GPTQConfig
from bayesq.baselines.hawq import HAWQConfig
from bayesq.baselines.lsq import LSQConfig, StepGradient
from bayesq.baselines.ocs import OCSConfig
from bayesq.baselines.rtn import RTNConfig
from bayesq.baselines.smoothquant import SmoothQuantConfig
from bayesq.baselines.zeroq import ZeroQConfig
from bayesq.config import Codebook, Granularity

# (quant, baselines, seed) -> the library config of a baseline row: params.yaml's ``quant`` section
# (bayesq.config.QuantConfig), its ``baselines`` section (flows.params.BaselinesConfig), the row's seed
Factory = Callable[[Any, Any, int], Any]

#: The groups an entry may belong to, and what membership means.
GROUPS = {
    "bayesq": "runs BayesQ's posterior, tables and encoding (flows.configs.method_config builds its config)",
    "shared-prep": "a BayesQ row that starts from the bayesq row's saved encoding (the same preparation)",
    "grid": "a baseline on GPTQ's grids and variants: BayesQ's allocation is one more of its variants",
    "calibrated": "a baseline that reads calibration inputs (and the calibration / baselines sections)",
    "data-free": "reads no calibration input at all",
    "shift": "run by the shift stage: BayesQ and the strongest rivals with corrections",
    "deploy": "its encodings are what ONNX Runtime's MatMulNBits stores: run by the deploy stage",
}


@dataclass(frozen=True)
class MethodEntry:
    """One pipeline method (a row name).

    Attributes:
        name: its ``params.yaml`` / ``--method`` name (``"optq"``).
        label: its name in the reports (``"OPTQ (best variant, natural order)"``).
        config: the library config a baseline row runs with (:data:`Factory`); None for the BayesQ
            rows, whose config :func:`flows.configs.method_config` builds from the method sections.
        sources: files (from the repository root) that only this method's rows run among the
            methods: each row's cache key leaves out the other methods' (tests/test_flows.py
            profiles every row to check that none calls into a source its key leaves out).
        groups: the row groups it belongs to (:data:`GROUPS`).
    """

    name: str
    label: str
    config: Factory | None = None
    sources: tuple[str, ...] = ()
    groups: frozenset[str] = frozenset()


def _entry(name: str, label: str, config: Factory | None = None, sources: tuple[str, ...] = (),
           *groups: str) -> MethodEntry:
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise ValueError(f"method {name!r}: unknown groups {sorted(unknown)}; choose from {list(GROUPS)}")
    return MethodEntry(name, label, config, sources, frozenset(groups))


def _selecting(b) -> dict:
    """The settings every baseline with a variant selection reads from the ``baselines`` section."""
    return dict(select=b.select, group_sizes=tuple(b.group_sizes), bias_correction=b.bias_correction)


_GPTQ = "bayesq/baselines/gptq.py"
_LEARNED = ("calibrated", "grid")

#: Every method, BayesQ's rows first, then the baselines in the reports' order (GPTQ's family,
#: learned rounding, AWQ's family, per-layer mixed precision, data-free rules).
METHODS: tuple[MethodEntry, ...] = (
    _entry("bayesq", "BayesQ", None, (), "bayesq", "shift", "deploy"),
    _entry("bayesq-ef", "BayesQ (K-FAC)", None, (), "bayesq"),  # K-FAC posterior (error feedback in its input factor)
    _entry("bayesq-distill", "BayesQ + distillation", None, ("bayesq/distill.py",), "bayesq", "shared-prep"),
    _entry("bayesq-paper", "BayesQ (paper-literal)", None, (), "bayesq"),  # fixed prior, draws, nearest rounding
    _entry("bayesq-brecq", "BayesQ + BRECQ rounding (no bias correction)", None,
           ("bayesq/baselines/brecq.py", "bayesq/baselines/adaround.py"), "bayesq", "shared-prep"),
    _entry("gptq", "GPTQ (best variant, act-order)",
           lambda q, b, seed: GPTQConfig(q, act_order=b.gptq_act_order, damp=b.gptq_damp, **_selecting(b)),
           (_GPTQ,), *_LEARNED, "shift", "deploy"),
    _entry("optq", "OPTQ (best variant, natural order)",  # GPTQ as first published: natural column order
           lambda q, b, seed: GPTQConfig(q, act_order=False, damp=b.gptq_damp, **_selecting(b)),
           (_GPTQ,), *_LEARNED, "shift"),
    _entry("anneal", "Mixed precision by annealing (per layer, GPTQ)",  # one width per layer, annealed on the KL
           lambda q, b, seed: AnnealConfig(q, steps=b.anneal_steps, search_inputs=b.anneal_inputs, seed=seed,
                                           bias_correction=b.bias_correction),
           ("bayesq/baselines/anneal.py", _GPTQ, "bayesq/baselines/brecq.py"), "calibrated"),
    _entry("adaround", "AdaRound (best variant)",
           lambda q, b, seed: AdaRoundConfig(q, iters=b.adaround_iters, lam=b.adaround_lambda, **_selecting(b)),
           ("bayesq/baselines/adaround.py", _GPTQ), *_LEARNED),
    _entry("brecq", "BRECQ (best variant)",  # AdaRound's rounding learned per residual block / transformer layer
           lambda q, b, seed: BRECQConfig(q, iters=b.brecq_iters, lam=b.adaround_lambda, seed=seed,
                                          **_selecting(b)),
           ("bayesq/baselines/brecq.py", "bayesq/baselines/adaround.py", "bayesq/baselines/lsq.py", _GPTQ),
           *_LEARNED),
    _entry("lsq", "LSQ (best variant)",
           lambda q, b, seed: LSQConfig(q, iters=b.lsq_iters, lr=b.lsq_lr, **_selecting(b)),
           ("bayesq/baselines/lsq.py", _GPTQ), *_LEARNED),
    _entry("lsq-plus", "LSQ+ (best variant)",  # learned step sizes and offsets (zero-points)
           lambda q, b, seed: LSQConfig(q, offset=True, iters=b.lsq_iters, lr=b.lsq_lr, **_selecting(b)),
           ("bayesq/baselines/lsq.py", _GPTQ), *_LEARNED),
    _entry("pact", "PACT (best variant)",  # LSQ's fit with PACT's gradient (the clipped ends' only)
           lambda q, b, seed: LSQConfig(q, gradient=StepGradient.PACT, iters=b.pact_iters, lr=b.pact_lr,
                                        **_selecting(b)),
           ("bayesq/baselines/lsq.py", _GPTQ), *_LEARNED),
    _entry("dorefa", "DoReFa (best variant)",
           lambda q, b, seed: DoReFaConfig(q, iters=b.dorefa_iters, lr=b.dorefa_lr, **_selecting(b)),
           ("bayesq/baselines/dorefa.py", _GPTQ), *_LEARNED),
    _entry("bit-split", "Bit-Split (best variant)",
           lambda q, b, seed: BitSplitConfig(q, epochs=b.bitsplit_epochs, **_selecting(b)),
           ("bayesq/baselines/bitsplit.py", _GPTQ), *_LEARNED),
    _entry("ocs", "OCS + GPTQ (best ratio and variant)",  # channels split, then GPTQ on the expanded layers
           lambda q, b, seed: OCSConfig(q, expand_ratios=tuple(b.ocs_expand_ratios), act_order=b.gptq_act_order,
                                        damp=b.gptq_damp, **_selecting(b)),
           ("bayesq/baselines/ocs.py", _GPTQ), "calibrated"),
    _entry("awq", "AWQ (g64)",
           lambda q, b, seed: AWQConfig(q, grid=b.awq_grid, **_selecting(b)),
           ("bayesq/baselines/awq.py",), "calibrated", "shift", "deploy"),
    _entry("smoothquant", "SmoothQuant weight-only (best variant)",  # on AWQ's code
           lambda q, b, seed: SmoothQuantConfig(q, alpha=b.smoothquant_alpha, **_selecting(b)),
           ("bayesq/baselines/smoothquant.py", "bayesq/baselines/awq.py"), "calibrated"),
    _entry("hawq", "HAWQ-style (per layer)",
           lambda q, b, seed: HAWQConfig(quant=q, probes=b.hawq_probes, seed=seed),
           ("bayesq/baselines/hawq.py",)),
    _entry("zeroq", "ZeroQ (per layer, distilled data)",  # reads the shape of one calibration batch, not its values
           lambda q, b, seed: ZeroQConfig(quant=q, seed=seed), ("bayesq/baselines/zeroq.py",), "calibrated"),
    _entry("aciq", "ACIQ (per channel)", lambda q, b, seed: ACIQConfig(quant=q), ("bayesq/baselines/aciq.py",),
           "data-free"),
    _entry("lloyd-block", "Per-block Lloyd (LUT per 1024)",
           lambda q, b, seed: BlockwiseConfig(Codebook.LLOYD, q), ("bayesq/baselines/blockwise.py",), "data-free"),
    _entry("clip-block", "Per-block uniform + clipping (g64)",
           lambda q, b, seed: BlockwiseConfig(Codebook.UNIFORM, q), ("bayesq/baselines/blockwise.py",), "data-free"),
    _entry("rtn-group", "RTN per-group (g64)", lambda q, b, seed: RTNConfig(Granularity.GROUP, q), (), "data-free"),
    _entry("rtn-channel", "RTN per-channel", lambda q, b, seed: RTNConfig(Granularity.CHANNEL, q), (), "data-free"),
    _entry("rtn-tensor", "RTN per-tensor", lambda q, b, seed: RTNConfig(Granularity.TENSOR, q), (), "data-free"),
)

#: The methods the pipeline knows, by ``params.yaml`` name (``Method.LSQ_PLUS == "lsq-plus"``).
Method = Enum("Method", [(e.name.upper().replace("-", "_"), e.name) for e in METHODS], type=str)
Method.__doc__ = "Quantization methods the pipeline knows (flows.methods.METHODS)."
Method.__module__ = __name__
ENTRY: dict[Method, MethodEntry] = {Method(e.name): e for e in METHODS}


def group(name: str) -> tuple[Method, ...]:
    """The methods of group ``name`` (:data:`GROUPS`), in :data:`METHODS` order."""
    if name not in GROUPS:
        raise ValueError(f"unknown method group {name!r}: choose from {list(GROUPS)}")
    return tuple(m for m, e in ENTRY.items() if name in e.groups)


BAYESQ_ROWS = group("bayesq")
SHARED_PREP = group("shared-prep")
GRID_METHODS = group("grid")
CALIBRATED_METHODS = group("calibrated")
DATA_FREE_METHODS = group("data-free")
SHIFT_METHODS = group("shift")
DEPLOY_METHODS = group("deploy")
BASELINES = tuple(m for m in Method if m not in BAYESQ_ROWS)  # every other row, in the reports' order

#: Methods ``--method`` / ``methods:`` accept (params.yaml's names).
BYO_METHODS = tuple(m.value for m in Method)
METHOD_LABEL = {e.name: e.label for e in METHODS}
BASELINE_CONFIGS = {m: e.config for m, e in ENTRY.items() if e.config is not None}
METHOD_SOURCES = {m: e.sources for m, e in ENTRY.items() if e.sources}
