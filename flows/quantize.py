"""DVC stage `quantize`: posterior, loss tables, BayesQ and the baselines at every budget, evaluation.

    python -m flows quantize --params params.yaml --raw data/raw --models models --out results

Per (model, seed): a cached posterior task (calibration inputs drawn from the training split
with the seed, labels never used) and a cached loss-table task (also written as Parquet), a
second pair with the K-FAC posterior for ``bayesq-ef``, the HAWQ Hessian traces, and the
layer-input statistics (one pass, saved to ``<out>/stats/``, read by GPTQ, AWQ and BayesQ's
error-feedback metric and bias correction) and the FP log-probabilities on the selection draw (one
pass, ``<out>/reference/``, read by every row that selects among candidates); per (method,
budget): a cached quantise-and-evaluate task. Every record carries ``preprocess_seconds``: the method's whole one-time cost at that
budget (BayesQ: posterior + table + the statistics and selection-draw passes when it read them +
allocation and encoding; GPTQ / AWQ: statistics and selection-draw passes + solve; HAWQ: traces + knapsack).  One MLflow parent run per invocation,
one child run per (model, method, seed, budget), logged from the flow body so cache hits are
logged too.  Every quantised model is written in the export format (``bayesq.export``) to
``<out>/exports/`` and evaluated after loading it back from there.  Writes
``<out>/results.json``, ``<out>/posterior/``, ``<out>/tables/``, ``<out>/stats/``, ``<out>/reference/``,
``<out>/encodings/`` (the ``bayesq`` rows' encodings, where ``bayesq-distill`` starts from) and ``<out>/exports/``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.cache_policies import INPUTS, TASK_SOURCE

from bayesq.assignment import allocate
from bayesq.baselines.brecq import brecq_encoding
from bayesq.blocks import unquantized_weights
from bayesq.context import FPOutputs, KnownOutputs
from bayesq.harness.models.zoo import get_entry
from bayesq.methods import Inputs, Outcome, quantize_with
from bayesq.quantize import assemble
from bayesq.rounding import needs_input_stats
from bayesq.selection import encode_best
from bayesq.tensorfile import file_sha256
from flows.common import code_version, digest, locked, parser, read_params, write_json
from flows.configs import method_settings
from flows.finetune import load_model, raw_path
from flows.lineage import artifact_tags, export_lineage, input_lineage, row_metadata
from flows.methods import (
    BAYESQ_ROWS, CALIBRATED_METHODS, DATA_FREE_METHODS, GRID_METHODS, METHOD_SOURCES, SHARED_PREP, Method,
)
from flows.params import RobustnessConfig
from flows.prepare import (
    calibration_batches, calibration_indices, checked_exclude, load_posterior, load_reference, load_stats, prep_code,
    prepare, reference_task, selection_batches, shared_cost,
)
from flows.robustness import evaluate_model, fp_eval_task, mean_corruption_error, tracked_metrics
from flows.row import Quantised, Subject, correction_fields, embedded_subject, offset_fields, run_row
from flows.timings import TaskClock
from flows.tracking import (
    child_run_name, flow_run_namer, log_files, log_row_artifacts, mlflow_child, mlflow_parent, row_params, say,
    write_run_file,
)

# Code no row runs (reports, CLI, zoo, ablations, the shift stage) is left out of every row's key;
# each method's own sources (flows.methods.METHOD_SOURCES) are left out of the other methods' keys.
NOT_IN_ROWS = ("flows/ablate.py", "flows/shift.py", "flows/report", "flows/robustness_report.py", "flows/labels.py", "flows/cli.py",
               "flows/zoo.py", "flows/settings.py", "flows/__main__.py")


def row_excluded(method: Method) -> tuple[str, ...]:
    """Sources (relative to the repository root) left out of ``method``'s row cache key."""
    own = set(METHOD_SOURCES.get(Method(method), ()))
    others = sorted({f for m, files in METHOD_SOURCES.items() if m != Method(method) for f in files} - own)
    return NOT_IN_ROWS + tuple(others)


def row_code(method: Method) -> str:
    """Code version of ``method``'s rows: every source under ``bayesq/`` and ``flows/`` but
    :func:`row_excluded`."""
    return code_version(exclude=row_excluded(method))


def _baseline(method: Method, model, entry, splits, data, calibration, quant, baselines, budget: float,
              seed: int, traces: dict | None, allocation: dict | None = None, stats_file: str | None = None,
              reference_file: str | None = None, exclude: tuple[str, ...] = ()) -> Outcome:
    """Quantise with a baseline through :func:`bayesq.methods.quantize_with` (its config from
    ``baselines.config``), giving it the row's cached inputs and ``exclude`` (the modules
    every method of the model keeps in floating point).

    HAWQ reads ``traces``; RTN and ACIQ nothing. GPTQ / AWQ read the calibration batches and
    their layer-input statistics (``stats_file``, computed by the handler when None); with
    their config's ``select`` they keep the variant with the least KL on the selection inputs
    (:func:`flows.prepare.selection_batches`; the calibration batches when
    ``calibration.selection: calibration``) against the FP log-probabilities ``reference_file``
    (:func:`flows.prepare.reference_task`; computed when None; the output offset's fit reads its
    logits on the calibration batches), and ``allocation`` (layer -> unit
    bit-widths) adds GPTQ on it as a variant. The outcome's ``details`` are ``variant`` (its
    name), ``variant_kl``, ``variant_bits`` and ``variant_inputs`` (candidate -> KL / true average
    bits / inputs the KL is a mean over: fewer for a candidate dropped after the first look);
    without ``select`` they name the ``mixed`` rule; other baselines add none.
    """
    config = baselines.config(method, quant, seed)
    if method not in CALIBRATED_METHODS:
        return quantize_with(model, config, budget, Inputs(traces=traces, exclude=exclude))
    batches = list(calibration_batches(entry, splits, data, calibration, seed)[1])
    selection = selection_batches(entry, splits, data, calibration, seed) if getattr(config, "select", True) else None
    given = reference_file and selection is not None
    logits = load_reference(Path(reference_file), "calibration") if reference_file else None
    inputs = Inputs(calibration=batches, selection=selection, allocation=allocation,
                    stats=load_stats(Path(stats_file)) if stats_file else None,
                    known=KnownOutputs(load_reference(Path(reference_file)) if given else None, logits or None),
                    exclude=exclude)
    return quantize_with(model, config, budget, inputs)


def _bayesq(model, table, budget: float, allocation_cfg, quant, posterior_file: str | None, seed: int,
            batches=None, stats_file: str | None = None, selection=None, known=None,
            tables: dict | None = None):
    """BayesQ's allocation and encoding from a cached table (:func:`bayesq.selection.encode_best`,
    the library's own step): (Encoding, posterior).

    ``batches``: calibration batches (the grid selection scores on ``selection``, else on them; error-feedback rounding
    under a diagonal posterior and the bias correction read the layers' input statistics: from
    ``stats_file`` when given, else computed from the batches; ``known``: the FP outputs the
    reference task saved (:func:`flows.prepare.load_reference`: the log-probabilities on
    ``selection``, computed here when None); ``tables``: the other grid candidates' tables, built
    here when None)."""

    post = load_posterior(model, Path(posterior_file)) if posterior_file else None
    stats = load_stats(Path(stats_file)) if stats_file and needs_input_stats(post, quant) else None
    return encode_best(model, post, table, quant, budget, allocation_cfg, seed=seed, calibration=batches,
                       stats=stats, selection=selection, known=known, tables=tables), post, stats is not None


def save_encoding(path: Path, enc, read: dict) -> dict:
    """Write a BayesQ row's :class:`bayesq.selection.Encoding` and what it read (``stats_read``,
    ``reference_read``, ``seconds``) to ``path`` (torch pickle); ``{"encoding_file", "encoding_sha256"}``."""
    import torch


    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"encoding": enc, "read": read}, path)
    return {"encoding_file": str(path), "encoding_sha256": file_sha256(path)}


def load_encoding(path: Path) -> tuple:
    """(Encoding, what it read) saved by :func:`save_encoding` (a file this pipeline wrote)."""
    import torch

    saved = torch.load(path, weights_only=False)
    return saved["encoding"], saved["read"]


def posterior_record(name: str, seed: int, method: str, post: dict) -> dict:
    """What ``posteriors.json`` keeps of one posterior task: the fitted prior per layer and the
    prior-dominated share (see :func:`flows.prepare.posterior_summary`)."""
    keys = ("n_examples", "prior_precision", "prior_dominated", "prior_dominated_share", "curvature", "prior")
    return {"model": name, "seed": seed, "method": method, **{k: post[k] for k in keys if k in post}}


def bayesq_unit_bits(prep: dict, params, budget: float, seed: int) -> dict | None:
    """BayesQ's allocation (layer -> unit bit-widths) at ``budget`` from the ``bayesq`` row's
    cached table, or None when that row is not run; GPTQ's selection tries it as a variant.
    Used when GPTQ runs before the ``bayesq`` row (``methods`` order); otherwise GPTQ gets the
    allocation the row kept (its grid selection may keep the min/max grids' allocation)."""

    if Method.BAYESQ not in prep:
        return None
    table = prep[Method.BAYESQ][1]["table"]
    return {k: list(v) for k, v in allocate(table, budget, params.allocation, seed).unit_bits.items()}


@dataclass(frozen=True)
class Source:
    """The model a row quantises and the raw data its inputs come from: paths and their digests
    (the digests key the cache; the paths are where to read)."""

    name: str
    model_file: str
    model_digest: str
    raw: str
    raw_digest: str


@dataclass(frozen=True)
class Row:
    """One quantise-and-evaluate row of :func:`quantize_eval_task`: everything its cache key holds.

    ``source``: the model and data; ``method``, ``budget``, ``seed``; ``code``: the row's code
    version (:func:`row_code`); the settings ``data``, ``quant``, ``allocation_cfg`` and, read
    only by the methods that need them, ``calibration``, ``baselines``, ``distill``,
    ``robustness``; ``ood``: also the shifted-data evaluation. Cached inputs by path and digest:
    ``table_key`` (the BayesQ table's), ``posterior_file``, ``traces`` (HAWQ), ``allocation``
    (GPTQ's extra variant), ``stats_file`` / ``stats_sha256``, ``reference_file`` /
    ``reference_sha256``, ``encoding_file`` / ``encoding_sha256``; where outputs go:
    ``export_dir``, ``examples_dir``, ``fp_logits``, ``encodings_dir``. ``exclude``: the module
    names or glob patterns the model keeps in floating point (``params.yaml``'s ``exclude``):
    the baselines are given them; a BayesQ row's posterior already leaves those layers out.
    """

    source: Source
    method: str
    budget: float
    seed: int
    code: str
    data: Any
    quant: Any
    allocation_cfg: Any
    export_dir: str
    calibration: Any = None
    baselines: Any = None
    distill: Any = None
    robustness: Any = None
    ood: bool = False
    table_key: str = ""
    posterior_file: str | None = None
    traces: dict | None = None
    allocation: dict | None = None
    examples_dir: str | None = None
    fp_logits: str | None = None
    stats_file: str | None = None
    stats_sha256: str = ""
    reference_file: str | None = None
    reference_sha256: str = ""
    encodings_dir: str | None = None
    encoding_file: str | None = None
    encoding_sha256: str = ""
    exclude: tuple[str, ...] = ()


@task(cache_policy=locked((INPUTS - "table" - "tables" - "lineage") + TASK_SOURCE), persist_result=True,
      task_run_name="{row.method} {row.source.name} b{row.budget} s{row.seed}")
def quantize_eval_task(row: Row, table=None, tables: dict | None = None, lineage: dict | None = None) -> dict:
    """Quantise with one method at one budget, write the export, load it back and evaluate the
    loaded model on the test split (and under shift).

    ``table`` / ``posterior_file`` (BayesQ rows), ``calibration`` (GPTQ, AWQ: their input
    statistics; distillation: its inputs), ``baselines`` (their settings), ``traces`` (HAWQ) and
    ``distill`` (``bayesq-distill``) are read only by the methods that need them; ``allocation``
    (GPTQ with its config's ``select``: BayesQ's unit bit-widths at this budget) adds GPTQ on it as
    a candidate variant; ``exclude`` (the model's modules kept in floating point) is given to the
    baselines and listed in the export header and the record (``exclude``) when not empty;
    ``quantize_seconds`` times everything done here but evaluation. ``robustness`` sets the
    calibration metrics; ``ood`` adds the corrupted / other-domain evaluation. The export is
    ``<export_dir>/<model>_<method>_b<budget>_s<seed>.safetensors`` and its per-example comparison
    with FP goes to the same name under ``examples_dir`` (default ``<export_dir>/../examples``),
    scored against ``fp_logits`` (default: the FP logits file there); the record carries its sizes,
    digests and the largest logit difference between the loaded and the in-memory model on one
    batch. ``stats_file`` (:func:`flows.prepare.stats_task`'s file, keyed by ``stats_sha256``): the
    layer-input statistics of the calibration inputs, read instead of computed (GPTQ, AWQ, BayesQ's
    error-feedback metric and bias correction); the record's ``stats_read`` says whether they were.
    ``reference_file`` (:func:`flows.prepare.reference_task`'s file, keyed by ``reference_sha256``):
    the FP log-probabilities on the selection draw, read instead of computed by every selecting row.
    ``tables`` (BayesQ rows): the other grid candidates' tables, derived from the same posterior
    and configuration as ``table`` (so, like it, keyed by ``table_key``), built here when None.
    ``encodings_dir`` (BayesQ rows): the encoding is also saved there (:func:`save_encoding`; the
    record names it, ``encoding_file`` / ``encoding_sha256``); ``encoding_file`` (keyed by
    ``encoding_sha256``): such a saved encoding of the same posterior, table and settings, used
    instead of encoding again (``bayesq-distill`` and ``bayesq-brecq`` start from the ``bayesq``
    row's; their record's ``encoding_seconds`` is that encoding's time). ``bayesq-brecq`` rounds
    the encoding again by BRECQ (the ``brecq`` row's schedule: ``baselines.brecq``'s ``iters`` steps
    per unit and ``lam``) and drops its bias correction (:func:`bayesq.baselines.brecq.bayesq_brecq`).
    Its header holds the row's lineage: ``lineage`` (the invocation's params and commit,
    :func:`flows.lineage.export_lineage`; not part of the cache key, so a cache hit keeps the
    file and the lineage of the run that wrote it) and the inputs (:func:`flows.lineage.input_lineage`).
    ``table`` and ``tables`` are keyed by ``row.table_key`` and ``lineage`` is not keyed, so the
    three are arguments of their own, left out of the cache key.
    """
    entry = get_entry(row.source.name)
    model = load_model(entry, Path(row.source.model_file))
    splits = entry.load_splits(row.data, Path(row.source.raw))
    if Method(row.method) in BAYESQ_ROWS:
        made = partial(_bayesq_row, row, model, entry, splits, table, tables)
    else:
        made = partial(_baseline_row, row, model, entry, splits)
    return run_row(_subject(row, entry, model, splits), _in_bayesq_format(made), row.method, row.budget, row.seed,
                   _export_path(row), _header(row, entry, splits, lineage), say=say)


def _in_bayesq_format(made):
    """A pipeline row's ``quantise``: its rows are written in BayesQ's format, which holds every layer."""
    def quantise(keep: tuple[str, ...]) -> Quantised:
        if keep:
            raise ValueError(f"the pipeline's rows write BayesQ's format, which keeps nothing out: {keep}")
        return made()
    return quantise


def _baseline_row(row: Row, model, entry, splits) -> Quantised:
    """A baseline row's quantisation (:func:`_baseline`) with the record fields of what it read."""
    out = _baseline(Method(row.method), model, entry, splits, row.data, row.calibration, row.quant, row.baselines,
                    row.budget, row.seed, row.traces, row.allocation, row.stats_file, row.reference_file, row.exclude)
    return Quantised.of(out, None, row.quant, {"stats_read": "stats" in out.read,
                                               "reference_read": "log_probs" in out.read})


def _subject(row: Row, entry, model, splits) -> Subject:
    """An embedded model as a pipeline row's :class:`flows.row.Subject` (:func:`embedded_subject`),
    evaluated on the test split (and under shift with ``row.ood``) against the FP model's saved
    test logits (``row.fp_logits``, default the FP logits file next to the examples)."""
    examples = Path(row.examples_dir) if row.examples_dir else Path(row.export_dir).parent / "examples"

    def evaluate(loaded, path: Path) -> dict:
        ev = evaluate_model(entry, loaded, splits, row.data, Path(row.source.raw), row.robustness or RobustnessConfig(),
                            row.ood, row.seed, examples=examples / path.name,
                            fp_file=row.fp_logits and Path(row.fp_logits))
        return {"accuracy": ev["calibration"]["accuracy"], **ev,
                **({"exclude": list(row.exclude)} if row.exclude else {})}

    return embedded_subject(entry, model, splits, row.data, evaluate, tag="[quantize] " + row.source.name)


def _export_path(row: Row) -> Path:
    return Path(row.export_dir) / f"{row.source.name}_{row.method}_b{row.budget}_s{row.seed}.safetensors"


def _header(row: Row, entry, splits, lineage: dict | None) -> dict:
    """A pipeline row's export header: the invocation's lineage and the row's inputs."""
    used = (None if Method(row.method) in DATA_FREE_METHODS or row.calibration is None
            else calibration_indices(entry, splits, row.calibration, row.seed))
    return row_metadata(row.source.name, row.method, row.budget, row.seed, row.code, lineage or {},
                        input_lineage(row.source.model_file, row.source.raw, row.source.raw_digest, row.posterior_file,
                                      used), **({"exclude": ",".join(row.exclude)} if row.exclude else {}))


def _bayesq_row(row: Row, model, entry, splits, table, tables) -> Quantised:
    """A BayesQ row's quantisation: its encoding (:func:`_bayesq`, or the ``bayesq`` row's saved
    one), BRECQ's rounding for ``bayesq-brecq``, then :func:`bayesq.quantize.assemble`
    (distillation for ``bayesq-distill``); the record fields say what it read and chose."""
    name, method, budget, seed = row.source.name, row.method, row.budget, row.seed
    start = time.perf_counter()
    extra = {}
    batches = (list(calibration_batches(entry, splits, row.data, row.calibration, seed)[1]) if row.calibration
               else None)
    selection = selection_batches(entry, splits, row.data, row.calibration, seed) if row.calibration else None
    known = KnownOutputs(  # the reference task's: FP log-probabilities on the selection, logits on the calibration
        load_reference(Path(row.reference_file)) if row.reference_file and selection is not None else None,
        (load_reference(Path(row.reference_file), "calibration") or None) if row.reference_file else None)
    if row.encoding_file:  # the bayesq row's encoding: same posterior, table and settings
        enc, read = load_encoding(Path(row.encoding_file))
        post = load_posterior(model, Path(row.posterior_file)) if row.posterior_file else None
        stats_read, reference_read = read["stats_read"], read["reference_read"]
        extra["encoding_seconds"] = read["seconds"]
    else:
        enc, post, stats_read = _bayesq(model, table, budget, row.allocation_cfg, row.quant, row.posterior_file, seed,
                                        batches, row.stats_file, selection, known, tables)
        reference_read = bool(row.reference_file) and selection is not None and bool(enc.selection_kl)
        if row.encodings_dir:
            path = Path(row.encodings_dir) / f"{name}_{method}_b{budget}_s{seed}.pt"
            extra |= save_encoding(path, enc, {"stats_read": stats_read, "reference_read": reference_read,
                                               "seconds": time.perf_counter() - start})
    allocation, quant = enc.allocation, enc.quant  # the encoding's (BRECQ's rounding keeps its bits)
    extra |= {"stats_read": stats_read, "reference_read": reference_read, "encoding": enc.name,
              "encoding_kl": dict(enc.selection_kl),
              "encoding_margin": {k: list(v) for k, v in enc.selection_margin.items()},
              "encoding_inputs": dict(enc.selection_inputs),
              "unit_bits": {k: list(v) for k, v in allocation.unit_bits.items()}}
    if Method(method) == Method.BAYESQ_BRECQ:  # the brecq row's schedule (baselines.brecq)
        enc = brecq_encoding(model, enc, batches, row.baselines.config(Method.BRECQ, quant, seed))
    extra |= correction_fields(enc.correction)
    qmodel, qweights, res, offset = assemble(
        model, enc, post, batches, row.distill if Method(method) == Method.BAYESQ_DISTILL else None, budget, seed,
        selection=selection, fp=FPOutputs(model, selection if selection is not None else batches, batches,
                                          held_out=selection is not None, known=known))
    layers = dict(model.named_modules())
    return Quantised(qmodel, qweights, allocation, quant,
                     unquantized_weights(model, {k: layers[k] for k in qweights}, row.exclude),
                     extra | _assembled_fields(offset, res))


def _assembled_fields(offset, res) -> dict:
    """The record fields of a BayesQ row's output offset and distillation (when they ran)."""
    extra = offset_fields(offset)
    if res is not None:
        extra |= {"distill_seconds": res.seconds, "distill_sample_scale": res.sample_scale,
                  "distill_teacher_agreement": res.teacher_agreement,
                  "distill_loss_first": res.loss_first, "distill_loss_last": res.loss_last,
                  "distill_accepted": res.accepted, "distill_kl_before": res.kl_before,
                  "distill_kl_after": res.kl_after}
    return extra


@flow(name="bayesq-quantize", flow_run_name=flow_run_namer("quantize"))
def quantize_flow(params_path: Path, raw: Path, models: Path, out: Path) -> list[dict]:

    params = read_params(params_path)
    code = code_version()
    lineage = export_lineage(params)
    records, posteriors, clock = [], [], TaskClock()
    codes = {m: row_code(m) for m in params.methods}
    with mlflow_parent("bayesq", "quantize", params.profile, {}, params_path) as parent:
        write_run_file(Path(out), parent)
        for name in params.models:
            source, exclude, fp = _model_source(params, name, models, raw, out, clock)
            records.append(fp)
            for seed in params.seeds:
                post, tab, prep, hawq, stats = prepare(params, name, Path(source.model_file), source.model_digest,
                                                       Path(source.raw), source.raw_digest, seed, out, clock)
                ref = clock(f"FP on the selection draw {name} s{seed}", reference_task, name, source.model_file,
                            source.model_digest, source.raw, source.raw_digest, params.data, params.calibration, seed,
                            str(Path(out) / "reference"), prep_code())
                posteriors += [posterior_record(name, seed, m.value, p[0])
                               for m, p in prep.items() if m not in SHARED_PREP]
                say(f"[quantize] {name} seed {seed}: posterior {post['seconds']:.1f}s, table {tab['seconds']:.1f}s")
                log_files(parent.info.run_id, sorted(Path(out, "tables").glob(f"{name}_s{seed}*.parquet")), "tables")
                kept = {}  # budget -> the unit bit-widths the bayesq row kept
                shared_encoding = {}  # budget -> the bayesq row's saved encoding
                for budget in params.budgets:
                    for method in params.methods:
                        p_post, p_tab, p_key, p_quant = prep.get(method, (None, None, "", params.quant))
                        given = ((kept.get(budget) or bayesq_unit_bits(prep, params, budget, seed))
                                 if method in GRID_METHODS and params.baselines.config(method).select else None)
                        row = Row(source, method.value, budget, seed, codes[method], params.data, p_quant,
                                  params.allocation, str(Path(out) / "exports"), calibration=params.calibration,
                                  baselines=params.baselines, distill=params.distill, robustness=params.robustness,
                                  ood=method in params.robustness.methods and budget in params.robustness.budgets,
                                  table_key=p_key, posterior_file=p_post and p_post["path"],
                                  traces=hawq["traces"] if method == Method.HAWQ else None, allocation=given,
                                  stats_file=stats["path"], stats_sha256=stats["sha256"],
                                  reference_file=ref.get("path"), reference_sha256=ref.get("sha256", ""),
                                  encodings_dir=str(Path(out) / "encodings") if method == Method.BAYESQ else None,
                                  exclude=exclude,
                                  **(shared_encoding.get(budget, {}) if method in SHARED_PREP else {}))
                        r = clock(f"{method.value} {name} b{budget} s{seed}", quantize_eval_task, row,
                                  p_tab and p_tab["table"], p_tab and p_tab.get("tables"), lineage)
                        unit_bits = r.get("unit_bits")
                        r = {k: v for k, v in r.items() if k != "unit_bits"}
                        if method == Method.BAYESQ:  # the allocation BayesQ kept: GPTQ's allocation variant
                            kept[budget] = unit_bits
                            if r.get("encoding_file") and Path(r["encoding_file"]).exists():  # distillation's start
                                shared_encoding[budget] = {k: r[k] for k in ("encoding_file", "encoding_sha256")}
                        r = _with_costs(r, method, prep, hawq, stats, ref, fp)
                        say(f"[quantize] {name} {method.value:12s} budget {budget}: "
                            f"acc {r['accuracy']:.4f} at {r['avg_bits']:.4f} bits")
                        _track_row(parent, params, row, r, code, p_post)
                        records.append(r)
    write_json(Path(out) / "results.json", records)
    write_json(Path(out) / "posteriors.json", posteriors)
    write_json(Path(out) / "timings.json", clock.records)
    return records


def main() -> None:
    p = parser("Quantise the fine-tuned models with BayesQ and the baselines")
    p.add_argument("--raw", type=Path, required=True)
    p.add_argument("--models", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    quantize_flow(a.params, a.raw, a.models, a.out)


if __name__ == "__main__":
    main()


def _model_source(params, name: str, models: Path, raw: Path, out: Path, clock: TaskClock) -> tuple:
    """(:class:`Source`, the modules it keeps in floating point, its FP evaluation record) of one
    embedded model; each ``exclude`` pattern is checked against its layers before any task runs."""
    entry = get_entry(name)
    model_file = Path(models) / name / "model.safetensors"
    mdig, src = digest(model_file), raw_path(entry, raw)
    sdig = digest(src)
    source = Source(name, str(model_file), mdig, str(src), sdig)
    exclude = params.excluded(name)
    if exclude:  # each pattern must match a layer: checked before any task runs
        checked_exclude(name, load_model(entry, model_file), exclude)
    fp_args = (name, str(model_file), mdig, str(src), sdig, params.data, params.robustness, params.seeds[0],
               prep_code())
    # also writes the FP test logits the rows compare with
    fp = clock(f"FP evaluation {name}", fp_eval_task, *fp_args, out=str(out))
    if not Path(fp["logits_file"]).exists():  # cache hit but file gone
        fp = clock(f"FP evaluation {name} (file gone)", fp_eval_task.with_options(refresh_cache=True),
                   *fp_args, out=str(out))
    say(f"[quantize] {name} FP: acc {fp['accuracy']:.4f}, ECE {fp['calibration']['ece']:.4f}")
    return source, exclude, fp


def _with_costs(r: dict, method: Method, prep: dict, hawq: dict, stats: dict, ref: dict, fp: dict) -> dict:
    """A row's record with its share of the cached preparation's seconds (``preprocess_seconds``:
    its own quantisation, the bayesq row's encoding it started from, the statistics, reference,
    posterior, table or traces it read) and its mean corruption error."""
    shared = shared_cost(r, stats, ref)
    own = r["quantize_seconds"] + r.get("encoding_seconds", 0.0)  # + the bayesq row's encoding
    r = {**r, **shared, "preprocess_seconds": own + sum(shared.values())}
    corruption = mean_corruption_error(r["ood"], fp["ood"])
    if corruption:
        r = {**r, "corruption": corruption}
    if method in prep:
        p_post, p_tab = prep[method][0], prep[method][1]
        r = {**r, "posterior_seconds": p_post["seconds"], "table_seconds": p_tab["seconds"],
             "preprocess_seconds": p_post["seconds"] + p_tab["seconds"] + r["preprocess_seconds"]}
    elif method == Method.HAWQ:
        r = {**r, "traces_seconds": hawq["seconds"], "preprocess_seconds": hawq["seconds"] + r["preprocess_seconds"]}
    return r


def _track_row(parent, params, row: Row, r: dict, code: str, p_post: dict | None) -> None:
    """Log one row to MLflow: a child run of the stage's with its params, metrics, tags and files."""
    name, method, budget, seed = row.source.name, Method(row.method), row.budget, row.seed
    metrics = {k: r[k] for k in ("accuracy", "avg_bits", "total_bits", "quantize_seconds", "eval_seconds",
                                 "posterior_seconds", "table_seconds", "traces_seconds",
                                 "stats_seconds", "reference_seconds",
                                 "preprocess_seconds", "distill_seconds",
                                 "distill_sample_scale", "distill_kl_before", "distill_kl_after",
                                 "kl_mean", "kl_se", "agreement") if k in r}
    if "distill_accepted" in r:
        metrics["distill_accepted"] = float(r["distill_accepted"])
    metrics.update(tracked_metrics(r))
    metrics.update({f"export_{k}": r["export"][k] for k in
                    ("file_bytes", "payload_avg_bits", "fp_bytes", "max_logit_diff")})
    chosen = {k: r[k] for k in ("variant", "encoding") if k in r}  # what a selection kept
    mlflow_child(parent.info.run_id, child_run_name(name, method.value, budget, seed),
                 {"model": name, "method": method.value, "seed": seed, "budget": budget,
                  **chosen, **row_params(params, method, *method_settings(params, method)),
                  **({"exclude": ",".join(row.exclude)} if row.exclude else {})},
                 metrics, {"profile": params.profile, "code_version": code,
                           **artifact_tags(r["export"], model_digest=row.source.model_digest,
                                           posterior_sha256=(p_post or {}).get("sha256", ""))},
                 seconds=r["preprocess_seconds"] + r.get("eval_seconds", 0.0),
                 artifacts=lambda c, rid, r=r: log_row_artifacts(c, rid, r))
