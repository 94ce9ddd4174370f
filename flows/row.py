"""One row: quantise -> write the file for its target -> load it back as a consumer would ->
evaluate -> the record. The pipeline (:func:`flows.quantize.quantize_eval_task`, also the zoo's
embedded models and the ablations), bring-your-own (:func:`flows.byo.run_row`, also the zoo's and
the pipeline's user models) and the CLI (``bayesq quantize``) all run a row through
:func:`run_row`.

What differs between them is in two values a caller hands over:

* a :class:`Subject`: the FP model, the batches a row reads, how its file is loaded back and how
  the loaded model is evaluated (an embedded model against its saved FP test logits, with the
  shift evaluation; a user's model against the FP model on its test draw, with a report);
* a ``quantise(keep)`` callable returning a :class:`Quantised` (most rows: :func:`by_library`,
  :func:`bayesq.methods.quantize_with` on a config; the pipeline's BayesQ rows: their cached
  posterior, tables and encoding). ``keep``: the modules the target holds in floating point
  (convolutions for ONNX Runtime), left out of the quantisation so no bits are spent on them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from bayesq.baselines.select import encoding_config
from bayesq.config import QuantConfig, Target
from bayesq.evaluation import each_batch
from bayesq.export import load, save_export
from bayesq.forward import Batch, call, output_logits
from bayesq.harness.models.zoo import _take
from bayesq.methods import Inputs, Outcome, quantize_with
from bayesq.onnx_export import ACCURACY_LEVEL, OnnxModel, convolutions, export_onnx
from bayesq.result import Allocation, QuantizedWeight, average_bits_all
from bayesq.settings import replace
from bayesq.targets import spec
from bayesq.tensorfile import file_sha256

TARGET_METHODS = ("bayesq", "gptq", "optq", "awq", "rtn-group")  # their encodings are what MatMulNBits stores
#: (AWQ: its per-input-channel scales as a Div on the layer's input)


@dataclass(frozen=True)
class Quantised:
    """What a row's quantisation made: the quantised model (dequantised weights in place), its
    encoded layers, the allocation, the QuantConfig its unit headers name, the floating-point
    matrices with their reasons, and the method's own record fields (the variant a selection kept,
    the grids, ...; JSON-friendly)."""

    model: nn.Module
    weights: Mapping[str, QuantizedWeight]
    allocation: Allocation
    quant: QuantConfig
    unquantized: Mapping[str, str] = field(default_factory=dict)
    fields: Mapping[str, Any] = field(default_factory=dict)

    @property
    def average_bits_all(self) -> float:
        """Bits per weight over every matrix: the quantised ones as accounted, the rest at their width."""
        return average_bits_all(self.model, self.weights, self.allocation)

    @classmethod
    def of(cls, done: Outcome, quant: QuantConfig | None, base: QuantConfig, fields: Mapping[str, Any] = ()):
        """A :class:`bayesq.methods.Outcome` as a row's: ``quant`` (a BayesQ row's) or, None, the
        variant's bit set on ``base`` (:func:`bayesq.baselines.select.encoding_config`); its
        ``details`` after ``fields``."""
        res = done.result
        return cls(res.model, res.weights, res.allocation, quant if quant is not None else encoding_config(res, base),
                   dict(res.unquantized), {**dict(fields), **correction_fields(res.correction),
                                           **offset_fields(res.output_offset), **done.details})


def correction_fields(correction) -> dict:
    """The record fields of a bias correction (:class:`bayesq.bias_correction.BiasCorrection`, or
    None: none ran): ``bias_corrected`` (layers) and ``bias_skipped`` (layer -> why not)."""
    if correction is None:
        return {}
    return {"bias_corrected": len(correction.targets), "bias_skipped": dict(correction.skipped)}


def offset_fields(offset) -> dict:
    """The record fields of an output offset (:class:`bayesq.output_offset.OutputOffset`, or None:
    none ran): ``output_offset_layer`` ("" when ``output_offset_skipped`` says why none),
    ``output_offset_kl`` (before, after) and ``output_offset_inputs``."""
    if offset is None:
        return {}
    return {"output_offset_layer": offset.layer or "", "output_offset_skipped": offset.skipped,
            "output_offset_kl": [offset.kl_before, offset.kl_after], "output_offset_inputs": offset.inputs}


def by_library(model: nn.Module, config, quant: QuantConfig | None, budget: float, inputs: Inputs,
               base: QuantConfig) -> Callable[[tuple[str, ...]], Quantised]:
    """The ``quantise`` of a row that runs :func:`bayesq.methods.quantize_with` on ``config``:
    ``inputs`` with ``keep`` added to its ``exclude``."""
    def quantise(keep: tuple[str, ...]) -> Quantised:
        done = quantize_with(model, config, budget, replace(inputs, exclude=tuple(inputs.exclude) + tuple(keep)))
        return Quantised.of(done, quant, base)
    return quantise


@dataclass(frozen=True)
class Subject:
    """The model a row quantises and how its file is checked.

    ``name``: in the file's header and the messages (``tag`` prefixes them); ``fp``: the FP model;
    ``example``: one batch as the model takes it (the ONNX export traces it); ``check``: batches the
    loaded file's outputs are compared with the in-memory model's on (the round trip);
    ``load(path)``: the written ``.safetensors`` file as a consumer loads it; ``evaluate(loaded,
    path)``: the loaded model scored, as record fields; ``export_args``: more
    :func:`bayesq.export.save_export` arguments (skeleton, preprocessor); ``features``: the model
    returns features, not logits (an ONNX file's output is read as such).
    """

    name: str
    fp: nn.Module
    example: Batch
    check: list
    load: Callable[[Path], nn.Module]
    evaluate: Callable[[nn.Module, Path], dict]
    tag: str = "[row]"
    export_args: Mapping[str, Any] = field(default_factory=dict)
    features: bool = False


def embedded_subject(entry, model, splits, data, evaluate, tag: str, example=None) -> Subject:
    """An embedded model as a row's :class:`flows.row.Subject`: its export loaded back as
    :func:`flows.finetune.load_model` loads the FP model, checked on the first 64 test examples;
    ``example``: the batch an ONNX export traces (default the first of those)."""
    check = list(entry.batches(_take(splits.test_inputs, torch.arange(min(64, len(splits.test_labels)))), 64, data))
    return Subject(entry.name, model, check[0] if example is None else example, check,
                   partial(load, memory_format=entry.memory_format), evaluate, tag=tag)


def targeted(configs: tuple, method: str, target: str, out: Path) -> tuple:
    """(library config, QuantConfig) of :func:`flows.configs.method_config` inside ``target``
    (:meth:`bayesq.config.QuantConfig.for_target`).

    Raises:
        ValueError: an unknown target; a method other than :data:`TARGET_METHODS` under a target
            other than BayesQ's format; an ``out`` without the target's suffix.
    """
    cfg, quant = configs
    t = spec(target)
    if t.name == Target.BAYESQ.value:
        return cfg, quant
    if method not in TARGET_METHODS:
        raise ValueError(f"--target {t.name} quantises with --method {', '.join(TARGET_METHODS)}; --method {method} "
                         "writes BayesQ's own format (.safetensors) (its encodings hold what MatMulNBits does not "
                         "store, e.g. OCS's split input channels)")
    if out.suffix != t.suffix:
        raise ValueError(f"--target {t.name} writes a {t.suffix} file: pass --out {out.with_suffix(t.suffix).name}")
    inside = cfg.quant.for_target(t.name)  # a BayesQ row's or a baseline's settings
    return replace(cfg, quant=inside), (inside if quant is not None else None)


def max_logit_diff(a: nn.Module, b: nn.Module, batches: list) -> float:
    """Largest |logit difference| of two models on ``batches`` (any logit shape)."""
    za, zb = (each_batch(m, batches, lambda m, x: output_logits(call(m, x)).float()) for m in (a, b))
    return max(float((p - q).abs().max()) for p, q in zip(za, zb))


def relabelled(unquantized: Mapping[str, str], held: Mapping[str, str]) -> dict[str, str]:
    """``unquantized`` (parameter -> reason) with the reason of the module in ``held`` (module ->
    reason: what a target keeps in floating point) for the parameters inside one."""
    def why(param: str, reason: str) -> str:
        module = next((m for m in held if param.startswith(m + ".")), None)
        return held[module] if module is not None else reason
    return {k: why(k, v) for k, v in unquantized.items()}


def write(made: Quantised, subject: Subject, out: Path, meta: Mapping[str, str], target: str,
          accuracy_level: int) -> dict:
    """Write ``made`` for ``target`` to ``out``: BayesQ's ``.safetensors`` (:func:`bayesq.export.save_export`)
    or an ONNX Runtime file of ``MatMulNBits`` nodes at ``accuracy_level`` (:func:`bayesq.onnx_export.export_onnx`).
    Returns what the record says of the file (``path``, ``file_bytes``, digests, ...)."""
    if target != Target.ONNXRUNTIME.value:
        return save_export(out, made.model, dict(made.weights), made.quant, made.allocation.total_bits,
                           architecture=subject.name, metadata=dict(meta), **subject.export_args).as_dict()
    ex = export_onnx(made.model, dict(made.weights), subject.example, out, metadata=dict(meta),
                     accuracy_level=accuracy_level)
    sha = file_sha256(out)  # the whole file is its content
    return {"path": str(out), "file_bytes": ex.file_bytes, "sha256": sha, "content_sha256": sha, "target": target,
            "accuracy_level": ex.accuracy_level, "file_avg_bits": ex.average_bits, "weights": ex.quantized_weights,
            "matmulnbits": {k: list(v) for k, v in ex.quantized.items()}, "kept": dict(ex.kept)}


def run_row(subject: Subject, quantise: Callable[[tuple[str, ...]], Quantised], method: str, budget: float,
            seed: int, out: Path, meta: Mapping[str, str], *, target: str = Target.BAYESQ.value,
            accuracy_level: int = ACCURACY_LEVEL, say: Callable[[str], None] = print) -> dict:
    """Quantise (``quantise(keep)``, ``keep``: the modules ``target`` holds in floating point),
    write the file with ``meta`` (its lineage) in its header, load it back as a consumer would
    (``subject.load``; an ONNX file: ONNX Runtime itself), check it against the in-memory model
    (``export.max_logit_diff``, an ONNX file at accuracy level 1: float32, the round trip), evaluate
    it (``subject.evaluate``) and return the row's record: ``model``, ``method``, ``budget``,
    ``seed``, ``target``, the bits (``avg_bits`` as accounted, ``avg_bits_all`` over every matrix:
    the file's for BayesQ's format; ``total_bits``, ``budget_bits``, ``n_weights``, ``layer_bits``),
    ``quantize_seconds`` (the quantisation alone), ``eval_seconds``, ``unquantized`` (every
    matrix kept in floating point, with its reason), ``export``, the method's fields and the
    evaluation's.

    Raises:
        ValueError: from the method (an infeasible budget, ...) or the export; a file that was
            written but could not be checked is removed (Ctrl-C included).
    """
    out = Path(out)
    onnx_file = target == Target.ONNXRUNTIME.value
    held = convolutions(subject.fp) if onnx_file else {}
    say(f"{subject.tag}: {method} at {budget} bits" + (f" for {target}" if onnx_file else "") + " ...")
    start = time.perf_counter()
    made = quantise(tuple(held))
    seconds = time.perf_counter() - start
    info = write(made, subject, out, meta, target, accuracy_level)
    try:
        loaded = OnnxModel(out, features=subject.features) if onnx_file else subject.load(out)
        exact = OnnxModel(out, features=subject.features, accuracy_level=1) if onnx_file else loaded
        info["max_logit_diff"] = max_logit_diff(made.model, exact, subject.check)
        say(f"{subject.tag}: {method} b{budget} s{seed}: {made.allocation.average_bits:.4f} bits/weight, "
            f"{info['file_bytes'] / 1e6:.2f} MB, quantised in {seconds:.1f} s; evaluating ...")
        begin = time.perf_counter()
        evaluation = subject.evaluate(loaded, out)
        eval_seconds = time.perf_counter() - begin
    except BaseException:  # an export that cannot be checked is not left behind
        out.unlink(missing_ok=True)
        raise
    say(f"{subject.tag}: {method} b{budget} s{seed}: evaluated in {eval_seconds:.1f} s")
    a = made.allocation
    return {"model": subject.name, "method": method, "budget": budget, "seed": seed, "target": target,
            "avg_bits": a.average_bits, "avg_bits_all": info.get("all_avg_bits", made.average_bits_all),
            "total_bits": a.total_bits, "budget_bits": a.budget_bits, "n_weights": a.n_weights,
            "layer_bits": {layer: sum(bits) / len(bits) for layer, bits in a.unit_bits.items()},
            "quantize_seconds": seconds, "eval_seconds": eval_seconds,
            "unquantized": relabelled(made.unquantized, held), "export": info, **made.fields, **evaluation}


__all__ = ["Quantised", "Subject", "TARGET_METHODS", "by_library", "max_logit_diff", "relabelled", "run_row",
           "targeted", "write", "embedded_subject"]
