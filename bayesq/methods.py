"""One entry for every quantisation method: ``quantize_with(model, config, budget, inputs)``.

Each method is a frozen config dataclass plus a handler registered for that class with
:func:`register` (the pattern of torchao's ``quantize_(model, config)``). Every handler has one
signature::

    handler(model: nn.Module, config, budget: float, inputs: Inputs) -> Outcome

``budget`` is the target average bits per quantised weight, every scale, codebook and header
counted. :class:`Inputs` carries what a method may read besides the model (calibration and
selection batches, and pieces a caller already has, such as layer-input statistics); a handler
computes what it needs and was not given, and says in :attr:`Outcome.read` which given pieces
it used. Handlers live next to their algorithm (``bayesq/baselines/<method>.py``,
``bayesq/quantize.py``) and register when that module is imported; importing :mod:`bayesq`
imports them all.

    from bayesq.baselines.gptq import GPTQConfig
    out = quantize_with(model, GPTQConfig(), 3.0, Inputs(calibration=batches))
    out.result.model, out.result.average_bits, out.details["variant"]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, TypeVar

from torch import nn

from bayesq.context import KnownOutputs
from bayesq.forward import Batch
from bayesq.result import QuantizationResult


@dataclass(frozen=True)
class Inputs:
    """What a method may read besides the model; None: not given (computed when needed).

    Attributes:
        calibration: unlabelled input batches (statistics, posteriors, traces, distillation).
        selection: batches held out of ``calibration`` that score a choice among candidates
            (GPTQ's / AWQ's variants, BayesQ's grids); None scores on ``calibration``.
        stats: layer name -> :class:`bayesq.baselines.activations.InputStats` of
            ``calibration`` (GPTQ, AWQ).
        known: the FP model's outputs the caller has (:class:`bayesq.context.KnownOutputs`):
            its log-probabilities on the scored batches (``selection``, else ``calibration``;
            per-token logits: an :class:`bayesq.evaluation.FPReference`, recomputed where read)
            and its logits on ``calibration`` (the output offset's fit reads them instead of a
            forward pass: BayesQ and the baselines offered the bias correction).
        traces: layer name -> Hessian trace (HAWQ).
        allocation: layer name -> unit bit-widths that GPTQ also tries as a variant.
        exclude: layer names or glob patterns left in floating point.
        cache: where BayesQ keeps its curvature pass for other budgets and targets on the same
            model and calibration inputs (:mod:`bayesq.stage_cache`); None: not kept.
    """

    calibration: Sequence[Batch] | None = None
    selection: Sequence[Batch] | None = None
    stats: Mapping[str, Any] | None = None
    known: KnownOutputs | None = None
    traces: Mapping[str, float] | None = None
    allocation: Mapping[str, Sequence[int]] | None = None
    exclude: Sequence[str] = ()
    cache: Any = None

    def need_calibration(self, method: str) -> list[Batch]:
        """``calibration`` as a list, or a ValueError naming ``method`` when there is none."""
        batches = list(self.calibration) if self.calibration is not None else []
        if not batches:
            raise ValueError(f"{method} reads calibration inputs: pass Inputs(calibration=[batch, ...]) "
                             "with at least one unlabelled input batch")
        return batches


@dataclass(frozen=True)
class Outcome:
    """What a handler returns.

    Attributes:
        result: the quantised model, its encoded layers and allocation.
        details: method-specific facts for reports (e.g. the variant a selection kept and
            every candidate's KL); JSON-friendly values.
        read: the names of the :class:`Inputs` fields given by the caller that the method used,
            the known outputs by their :class:`bayesq.context.KnownOutputs` field (e.g.
            ``{"stats", "log_probs"}``).
    """

    result: QuantizationResult
    details: Mapping[str, Any] = field(default_factory=dict)
    read: frozenset[str] = frozenset()


Handler = Callable[[nn.Module, Any, float, Inputs], Outcome]
_HANDLERS: dict[type, Handler] = {}
H = TypeVar("H", bound=Handler)


def register(config_type: type) -> Callable[[H], H]:
    """Decorator: ``handler`` quantises for configs of ``config_type`` (one handler per type)."""
    def deco(handler: H) -> H:
        if config_type in _HANDLERS and _HANDLERS[config_type] is not handler:
            raise ValueError(f"{config_type.__name__} already has a handler ({_HANDLERS[config_type].__name__})")
        _HANDLERS[config_type] = handler
        return handler
    return deco


def registered() -> dict[type, Handler]:
    """Config type -> handler, for every method imported so far (all of them after ``import bayesq``)."""
    return dict(_HANDLERS)


def quantize_with(model: nn.Module, config: Any, budget: float, inputs: Inputs = Inputs()) -> Outcome:
    """Quantise ``model`` to ``budget`` average bits with the method ``config`` selects.

    ``model`` is left as it was (the result holds a copy).

    Raises:
        TypeError: no handler is registered for ``type(config)`` (naming the ones that are).
        ValueError: as the method's own function (infeasible budget, missing inputs, ...).
    """
    handler = _HANDLERS.get(type(config))
    if handler is None:
        names = ", ".join(sorted(t.__name__ for t in _HANDLERS))
        raise TypeError(f"no quantisation method is registered for {type(config).__name__}: pass one of "
                        f"{names} (a new method registers its config with bayesq.methods.register)")
    return handler(model, config, budget, inputs)


def read(inputs: Inputs, *names: str) -> frozenset[str]:
    """The ``names`` of the fields of ``inputs`` (or of its ``known`` outputs: ``log_probs``,
    ``logits``) that were given (not None): what a handler that uses them reports in
    :attr:`Outcome.read`."""
    known = inputs.known or KnownOutputs()
    return frozenset(n for n in names if getattr(inputs, n, None) is not None or getattr(known, n, None) is not None)
