"""The full-precision model's outputs a quantisation run reads more than once, each computed once.

A method scores candidates (BayesQ's grids, a baseline's variants) by their KL to the FP model on
the scored inputs (held-out selection inputs, else the calibration inputs), and fits the output
offset against the FP model's logits on the calibration inputs. :class:`FPOutputs` holds both
for one run: given by a caller that saved them (:class:`KnownOutputs`, e.g. a pipeline's cache
shared by every row of a model), made by a pass that already ran the FP model on those inputs
(the curvature or statistics pass), or computed on first read and kept. The stages read it
instead of taking the tensors as arguments of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from torch import Tensor, nn

from bayesq.evaluation import reference_log_probs
from bayesq.forward import Batch


@dataclass(frozen=True)
class KnownOutputs:
    """FP outputs a caller already has, one tensor per batch in batch order (None: not known).

    Attributes:
        log_probs: the FP model's log-probabilities on the scored inputs (the selection inputs
            when there are some, else the calibration inputs):
            :func:`bayesq.evaluation.reference_log_probs` of those batches.
        logits: the FP model's (B, C) logits on the calibration inputs
            (:func:`bayesq.evaluation.predict` per batch, float32).
    """

    log_probs: Sequence[Tensor] | None = None
    logits: Sequence[Tensor] | None = None


class FPOutputs:
    """The FP model's outputs on one run's scored and calibration inputs, computed at most once.

    Args:
        model: the full-precision model (eval mode; it must not change while this is read).
        scored: the batches candidates are scored on.
        calibration: the calibration batches (the output offset's fit), None where not fitted.
        held_out: ``scored`` are inputs held out of ``calibration`` (a selection draw), not the
            calibration batches themselves.
        known: outputs the caller already has (checked against the batch counts).
    """

    def __init__(self, model: nn.Module, scored: Sequence[Batch] | None, calibration: Sequence[Batch] | None = None,
                 *, held_out: bool = False, known: KnownOutputs | None = None) -> None:
        known = known or KnownOutputs()
        self.model, self.held_out = model, held_out
        self.scored = list(scored) if scored is not None else None
        self.calibration = list(calibration) if calibration is not None else None
        if known.log_probs is not None and self.scored is not None and len(known.log_probs) != len(self.scored):
            raise ValueError(f"reference has {len(known.log_probs)} batches of log-probabilities for "
                             f"{len(self.scored)} input batches: pass reference_log_probs of the same batches, "
                             "in the same order")
        self._log_probs = known.log_probs
        self._parts: dict[tuple[int | None, int | None], Sequence[Tensor]] = {}
        self.logits = known.logits

    def log_probs(self, part: slice | None = None, desc: str | None = None) -> Sequence[Tensor]:
        """The FP log-probabilities of the scored batches ``part`` (all of them: None), computed
        on first read (``desc``: a progress bar over those batches) and kept."""
        if self._log_probs is not None:
            return self._log_probs if part is None else self._log_probs[part]
        if part is None:
            self._log_probs = reference_log_probs(self.model, self.scored, desc)
            return self._log_probs
        key = (part.start, part.stop)
        if key not in self._parts:
            self._parts[key] = reference_log_probs(self.model, self.scored[part], desc)
        return self._parts[key]

    def known_log_probs(self) -> Sequence[Tensor] | None:
        """The log-probabilities of every scored batch when they were given or computed, else None
        (nothing is computed)."""
        return self._log_probs

    def offer_log_probs(self, log_probs: Sequence[Tensor]) -> None:
        """The scored batches' FP log-probabilities a pass has made: kept unless some are known."""
        if self._log_probs is None:
            self._log_probs = log_probs

    def offer_logits(self, logits: Sequence[Tensor] | None) -> None:
        """The FP logits on the calibration batches a pass has made: kept unless some were given."""
        if self.logits is None:
            self.logits = logits
