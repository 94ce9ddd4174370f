"""Bring your own model and data: one quantise-export-evaluate row for a model a user points at
(a Hugging Face directory, ``torchvision:<arch>`` plus a checkpoint, ``package.module:function``)
and data on disk (a ``save_to_disk`` folder, Parquet / CSV / JSON Lines, an image folder).

The CLI (``bayesq quantize --model ... --data ...``), the zoo flow (entries with ``model:`` and
``data:``) and the pipeline (``params.yaml``'s ``sources:``) all describe such a model with one
:class:`ByoModel` and run it with :func:`run_row`:

1. resolve the model (:func:`bayesq.harness.sources.resolve_model`) and read the data
   (:func:`bayesq.harness.data.files.load_rows`), checking columns, labels and sizes first, so a
   bad input fails before anything is written;
2. draw disjoint seeded calibration / selection / test examples
   (:func:`bayesq.harness.data.files.draw_examples`) and preprocess them with the model's own
   tokenizer or image processor (or torchvision's transforms);
3. quantise with the method (:func:`bayesq.methods.quantize_with`, params.yaml's settings);
4. write the export with the skeleton and preprocessing it needs to be rebuilt without this code,
   load it back with :func:`bayesq.export.load` (no skeleton given) and check its logits;
5. compare the loaded model with the FP one on the test examples (:mod:`bayesq.fidelity`: KL and
   agreement always, accuracy with labels, perplexity for a causal LM, each with its paired 95 %
   interval) and write ``<export>.report.json`` / ``.md`` next to the export.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from prefect import task
from prefect.cache_policies import INPUTS, TASK_SOURCE

from bayesq.comparison import paired_difference
from bayesq.evaluation import predict
from bayesq.export import ExportError, load, read_export
from bayesq.fidelity import ExampleScores, fidelity_report, score_examples
from bayesq.harness.data.calibration import sample_calibration_indices
from bayesq.harness.data.files import (
    DEFAULT_SIZES, DataSource, check_columns, draw_examples, featurizer, fit_draw_sizes, load_rows, make_batches,
    read_labels,
)
from bayesq.harness.sources import ModelSource, SourceKind, resolve_model, unpacked
from bayesq.methods import Inputs
from bayesq.onnx_export import ACCURACY_LEVEL, OnnxModel
from bayesq.stage_cache import MemoryCache
from bayesq.tensorfile import file_sha256, save_tensors
from flows import row as rows
from flows.common import digest, locked, write_json
from flows.configs import method_config
from flows.lineage import artifact_tags, row_metadata
from flows.methods import BYO_METHODS
from flows.params import ByoModel, byo_from_mapping
from flows.row import Subject, by_library, targeted
from flows.tracking import child_run_name, log_row_artifacts, mlflow_child, mlflow_parent, row_params, say

BATCH = 32  # examples per preprocessed batch
_STAGES = MemoryCache(max_items=2)  # BayesQ's curvature pass of a model, shared by its rows' budgets in a process


@dataclass
class Prepared:
    """A :class:`ByoModel` made ready: the FP model, its data draws as batches, the labels of
    the test draw and what the export records about them."""

    spec: ByoModel
    source: ModelSource
    fp: torch.nn.Module
    draws: Any
    calibration: list
    selection: list | None
    test: list
    labels: torch.Tensor | None
    preprocessor: dict
    data_digest: str
    sizes_note: str = ""  # why the draw sizes are not the defaults (fitted to a small data set), or ""


def _num_classes(src: ModelSource, fp: torch.nn.Module, batch) -> int:
    """The head's class count: the source's, else the width of the FP logits on one batch."""
    if src.num_classes:
        return src.num_classes
    return int(predict(fp, [batch], "probe").shape[-1])


def check(spec: ByoModel, seed: int):
    """Resolve the model and read the data, and check everything that can be checked without
    building the model: columns, their kinds, labels, draw sizes. Returns (source, rows, draws,
    :class:`~bayesq.harness.data.files.DrawSizes`).

    Raises:
        FileNotFoundError / ValueError: every bad input, named (see
        :mod:`bayesq.harness.sources`, :mod:`bayesq.harness.data.files`).
    """
    src = resolve_model(spec.model, spec.checkpoint, spec.num_classes, spec.tokenizer)
    if src.kind is SourceKind.EMBEDDED:
        raise ValueError(f"'{spec.model}' is an embedded model: it reads its own data (`bayesq quantize {spec.model}`); "
                         "--data is for a Hugging Face folder, torchvision:<arch> or package.module:function")
    ds = load_rows(spec.data)
    check_columns(ds, spec.data, src.modality.value)
    if src.causal_lm and spec.data.label_column:
        raise ValueError(f"{spec.model} is a causal language model: it has no class labels to score "
                         f"'{spec.data.label_column}' against; drop the label column (perplexity needs none)")
    if src.headless and spec.data.label_column:
        raise ValueError(f"{spec.model} is a base model without a head (its config names {src.auto_class}): it has no "
                         f"class labels to score '{spec.data.label_column}' against; drop the label column (the "
                         "feature error, cosine and neighbour measures need none), or save the model with its head")
    sizes = fit_draw_sizes(len(ds), spec.calibration, spec.selection, spec.test)
    draws = draw_examples(len(ds), sizes.calibration, sizes.selection, sizes.test, seed)
    if src.num_classes:  # a callable's class count is known once it runs (prepare checks it then)
        read_labels(ds, draws.test, spec.data, src.num_classes, _label2id(src))
    return src, ds, draws, sizes


def _label2id(src: ModelSource) -> dict | None:
    if src.kind is not SourceKind.HUGGINGFACE:
        return None
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(src.spec), "label2id", None)


def prepare(spec: ByoModel, seed: int, say=print) -> Prepared:
    """:func:`check`, then build the FP model and preprocess the three draws; nothing is written.

    Raises:
        FileNotFoundError / ValueError: as :func:`check`.
    """
    start = time.perf_counter()
    say(f"[byo] {spec.name}: reading {spec.model} and {spec.data.path} ...")
    src, ds, draws, sizes = check(spec, seed)
    if sizes.note:
        say(f"[byo] {spec.name}: {sizes.note}")
    say(f"[byo] {spec.name}: {src.kind.value} {src.auto_class or src.arch} ({src.modality.value}), "
        f"{len(ds)} examples in {spec.data.path}: {sizes.calibration} calibration, {sizes.selection} selection, "
        f"{sizes.test} test (seed {seed})")
    fp = src.build()
    pre = src.preprocessor(spec.data.image_size)
    with unpacked(pre.get("files", {})) as folder:
        feat = featurizer(pre, spec.data, folder)
        cal, sel, test = (make_batches(ds, getattr(draws, part), feat, BATCH, f"preprocess {part}")
                          for part in ("calibration", "selection", "test"))
    labels = read_labels(ds, draws.test, spec.data, _num_classes(src, fp, test[0]) if spec.data.label_column else 0,
                         _label2id(src))
    say(f"[byo] {spec.name}: model built and {sum(map(len, (draws.calibration, draws.selection, draws.test)))} "
        f"examples preprocessed ({time.perf_counter() - start:.1f} s)")
    return Prepared(spec, src, fp, draws, cal, sel or None, test, labels, pre, digest(Path(spec.data.path)), sizes.note)


def report_paths(export: Path) -> tuple[Path, Path]:
    """``<export stem>.report.json`` and ``.report.md`` next to the export."""
    stem = Path(export).with_suffix("")
    return stem.with_name(stem.name + ".report.json"), stem.with_name(stem.name + ".report.md")


def _where(spec: str) -> str:
    """A local path made absolute (an export names what another working directory can find); other specs as given."""
    return str(Path(spec).resolve()) if spec and Path(spec).exists() else spec


def lineage_metadata(prep: Prepared, method: str, budget: float, seed: int, shared: Mapping[str, str],
                     code: str) -> dict[str, str]:
    """The export header's lineage: model source, data with its digest, the three draws (the
    calibration indices in full, each draw's sha256), params and commit (``shared``)."""
    s, d = prep.spec, prep.draws
    src = {"model_source": _where(s.model), "checkpoint": _where(s.checkpoint or s.model), "dataset": _where(s.data.path),
           "dataset_digest": prep.data_digest, "data_split": s.data.split,
           "data_columns": json.dumps({"text": list(s.data.text_columns), "image": s.data.image_column,
                                       "label": s.data.label_column, "max_length": s.data.max_length,
                                       "image_size": s.data.image_size}),
           "calibration_indices": ",".join(map(str, d.calibration.tolist())),
           "draws": json.dumps({p: {"n": len(getattr(d, p)), "sha256": d.digest(p)}
                                for p in ("calibration", "selection", "test")}),
           "draw_seed": str(seed), "torch_threads": str(torch.get_num_threads())}
    if s.checkpoint:
        src["checkpoint_sha256"] = file_sha256(s.checkpoint)
    if Path(s.model).exists():
        src["model_digest"] = digest(Path(s.model))
    return row_metadata(s.name, method, budget, seed, code, dict(shared), src,
                        **({"exclude": ",".join(s.exclude)} if s.exclude else {}))


def subject(prep: Prepared, evaluate) -> Subject:
    """``prep`` as a row's :class:`flows.row.Subject`: its file loaded back without a skeleton or
    producer code (:func:`bayesq.export.load`), checked on the first test batch, scored by ``evaluate``."""
    return Subject(prep.spec.name, prep.fp, prep.calibration[0], prep.test[:1], load, evaluate,
                   tag=f"[byo] {prep.spec.name}", features=prep.source.headless,
                   export_args={"skeleton": prep.source.skeleton(), "preprocessor": prep.preprocessor})


def run_row(prep: Prepared, method: str, budget: float, params, seed: int, out: Path, shared: Mapping[str, str],
            code: str, say=print, examples_dir: Path | None = None, target: str = "bayesq",
            accuracy_level: int = ACCURACY_LEVEL, cache=None) -> dict:
    """One row of a user's model (:func:`flows.row.run_row`): quantise with ``method``'s config
    (:func:`flows.configs.method_config`), export with skeleton and preprocessing, load back
    without a skeleton, compare with FP on the test draw (KL, agreement; accuracy with labels;
    perplexity for a causal LM; each with its paired 95 % interval), save the per-example scores
    and write the report next to the export. Returns the row's record. ``target="onnxruntime"``:
    quantised inside what ONNX Runtime's MatMulNBits runs, written as an ``.onnx`` file
    (:mod:`bayesq.onnx_export`) whose MatMulNBits nodes compute at ``accuracy_level`` (1: float32,
    4: int8 activations), and compared with FP as ONNX Runtime runs it. ``cache``: BayesQ's curvature
    pass kept for the model's other budgets (:mod:`bayesq.stage_cache`).

    Raises:
        ValueError: from the method (an infeasible budget, ...); nothing is written then.
    """
    out = Path(out)
    cfg, quant = targeted(method_config(method, params, budget, seed), method, target, out)
    meta = lineage_metadata(prep, method, budget, seed, shared, code)
    reports = []

    def evaluate(loaded, path: Path) -> dict:
        say(f"[byo] {prep.spec.name}: comparing with FP on {len(prep.draws.test)} test examples")
        return {"model_source": prep.spec.model, "dataset": prep.spec.data.path, "dataset_digest": prep.data_digest,
                "draws": json.loads(meta["draws"]), "draw_sizes_note": prep.sizes_note,
                **compared(prep.fp, loaded, prep.test, prep.labels, path, reports, examples_dir, prep.source.causal_lm)}

    inputs = Inputs(calibration=prep.calibration, selection=prep.selection, exclude=tuple(prep.spec.exclude),
                    cache=cache)
    record = rows.run_row(subject(prep, evaluate), by_library(prep.fp, cfg, quant, budget, inputs, params.quant),
                          method, budget, seed, out, meta, target=target, accuracy_level=accuracy_level, say=say)
    write_report(out, record, reports[-1].lines())
    return record


def compared(fp: torch.nn.Module, loaded: torch.nn.Module, batches: list, labels: torch.Tensor | None, export: Path,
             reports: list, folder: Path | None = None, causal_lm: bool = False) -> dict:
    """The loaded file against the FP model on ``batches`` (:func:`bayesq.fidelity.score_examples`,
    a progress bar): its per-example scores saved (:func:`save_examples`), its
    :class:`bayesq.fidelity.FidelityReport` appended to ``reports``; the record's ``fidelity`` and
    ``examples_file``."""
    scores = score_examples(fp, loaded, batches, labels, causal_lm)
    reports.append(fidelity_report(scores))
    return {"fidelity": reports[-1].as_dict(), "examples_file": str(save_examples(export, scores, folder))}


def examples_path(export: Path, folder: Path | None = None) -> Path:
    """``<export stem>.examples.safetensors`` in ``folder`` (default: next to the export): a row's
    per-example scores."""
    stem = Path(export).with_suffix("")
    return (Path(folder) if folder is not None else stem.parent) / f"{stem.name}.examples.safetensors"


def save_examples(export: Path, scores: ExampleScores, folder: Path | None = None) -> Path:
    """Write a row's per-example scores (float64 (N,) each; absent ones left out) for paired comparisons."""
    tensors = {k: v.contiguous() for k, v in asdict(scores).items() if v is not None}
    return save_tensors(examples_path(export, folder), tensors)


def load_examples(path: Path) -> ExampleScores:
    """The :class:`bayesq.fidelity.ExampleScores` :func:`save_examples` wrote."""
    from safetensors.torch import load_file

    return ExampleScores(**load_file(str(path)))


def paired_rows(records: list[dict], reference: str = "bayesq") -> list[dict]:
    """BayesQ (``reference``) minus every other method, per model, budget and seed, on the same
    test examples (rows whose test draws hash alike): the paired bootstrap of the mean per-example
    difference of KL (nats) and, with labels, of correct (points) (:func:`bayesq.comparison.paired_difference`);
    for a model without a head, of feature error and neighbour agreement (points) and cosine
    similarity instead of KL."""
    out = []
    key = lambda r: (r["model"], r["budget"], r["seed"], r["draws"]["test"]["sha256"])  # noqa: E731
    refs = {key(r): r for r in records if r["method"] == reference and r.get("examples_file")}
    for r in records:
        ref = refs.get(key(r))
        if r["method"] == reference or ref is None or not r.get("examples_file"):
            continue
        a, b = load_examples(Path(ref["examples_file"])), load_examples(Path(r["examples_file"]))
        row = {"model": r["model"], "budget": r["budget"], "seed": r["seed"], "method": reference,
               "baseline": r["method"], "n": a.n}
        if a.features and b.features:  # a model without a head: its feature measures (points where a share)
            row |= {"feature_error": paired_difference(a.feature_error, b.feature_error, scale=100.0).as_dict(),
                    "cosine": paired_difference(a.cosine, b.cosine).as_dict(),
                    "neighbour": paired_difference(a.neighbour, b.neighbour, scale=100.0).as_dict()}
        else:
            row["kl"] = paired_difference(a.kl, b.kl).as_dict()
        if a.correct_q is not None and b.correct_q is not None:
            row["accuracy"] = paired_difference(a.correct_q, b.correct_q, scale=100.0).as_dict()
        out.append(row)
    return out


def _small_test_line(record: dict) -> list[str]:
    """A report line saying how much wider the intervals are for a test draw smaller than the
    default (they narrow as ``1 / sqrt(n)``), with the KL's here; none for a full-size draw."""
    n, full = record["draws"]["test"]["n"], DEFAULT_SIZES["test"]
    if n >= full:
        return []
    f = record["fidelity"]
    key, what = ("kl", "KL") if "kl" in f else ("feature_error", "feature error")
    half = (f[f"{key}_ci_high"] - f[f"{key}_ci_low"]) / 2
    return [f"- a small test draw: {n} examples, so every interval below is about {math.sqrt(full / n):.1f} times as "
            f"wide as with the default {full} (the {what}'s half-width here {half:.2g}, "
            f"{100 * half / max(f[key], 1e-30):.0f} % of its value); more test examples narrow it as 1 / sqrt(n)"]


def _target_lines(record: dict) -> list[str]:
    """How the file was checked, and for an ONNX Runtime file what it holds."""
    e = record["export"]
    diff = e["max_logit_diff"]
    if record.get("target", "bayesq") == "bayesq":
        return [f"- loaded back without a skeleton: largest output difference (logits, or features) to the in-memory "
                f"model {diff:.2e}"]
    widths = sorted({b for w in e["matmulnbits"].values() for b in w})
    split = sum(len(w) > 1 for w in e["matmulnbits"].values())
    kept = ", ".join(f"{k} ({v})" for k, v in e["kept"].items()) or "none"
    return [f"- target {record['target']}: {len(e['matmulnbits'])} layers as MatMulNBits (widths {widths}; {split} "
            f"split by row into one node per width), {e['file_avg_bits']:.4f} bits per weight stored for them"
            + (f" (the allocation counted {record['avg_bits']:.4f}: a row-order index for every row)"
               if len(widths) > 1 else "") + f"; quantised layers kept in floating point: {kept}",
            f"- run by ONNX Runtime (CPU): largest output difference to BayesQ's in-memory model {diff:.2e} at "
            f"MatMulNBits accuracy level 1 (float32 compute); the comparison below is ONNX Runtime's output at the "
            f"file's level {e['accuracy_level']}" + (" (int8 activations)" if e["accuracy_level"] == 4 else "")]


def write_report(export: Path, record: dict, lines: list[str]) -> tuple[Path, Path]:
    """The row's ``.report.json`` (the record) and ``.report.md`` (a table a person reads)."""
    js, md = report_paths(export)
    write_json(js, record)
    r = record
    body = [f"# {r['model']}: {r['method']} at {r['budget']} bits", "",
            f"- model: `{r['model_source']}`; data: `{r['dataset']}` (sha256 {r['dataset_digest'][:12]}...)",
            f"- export: `{r['export']['path']}`, {r['export']['file_bytes'] / 1e6:.2f} MB; "
            f"{r['avg_bits']:.4f} bits per quantised weight, {r['avg_bits_all']:.4f} over all weight matrices",
            *_target_lines(r),
            f"- draws (seed {r['seed']}): " + ", ".join(f"{k} {v['n']}" for k, v in r["draws"].items())
            + (f" ({r['draw_sizes_note']})" if r.get("draw_sizes_note") else ""),
            *_small_test_line(r),
            f"- kept in floating point: {', '.join(f'{k} ({v})' for k, v in r['unquantized'].items()) or 'nothing'}",
            "", "Quantised vs full precision on the test draw (value [95 % paired bootstrap interval]):", "",
            "```", *lines, "```", ""]
    md.write_text("\n".join(body))
    return js, md


@task(cache_policy=locked((INPUTS - "lineage") + TASK_SOURCE), persist_result=True,
      task_run_name="{method} {spec.name} b{budget} s{seed}")
def byo_task(spec: ByoModel, model_digest: str, data_digest: str, method: str, budget: float, seed: int, params,
             out: str, code: str, lineage: dict, threads: int | None) -> dict:
    """One user model at one method, budget and seed (:func:`run_row`), cached on the spec, the
    model's and data's digests, the settings, the seed and the code version; the export (and its
    report) goes to ``<out>/exports/<name>_<method>_b<budget>_s<seed>.safetensors``, its
    per-example scores to ``<out>/examples/``."""
    if threads is not None:
        torch.set_num_threads(threads)
    prep = prepare(spec, seed, say=say)
    path = Path(out) / "exports" / f"{spec.name}_{method}_b{budget}_s{seed}.safetensors"
    return run_row(prep, method, budget, params, seed, path, lineage, code, say=say,
                   examples_dir=Path(out) / "examples", cache=_STAGES)


def submit_rows(m: ByoModel, params, out: str, code: str, lineage: dict, seeds, threads: int | None = None) -> list:
    """Submit :func:`byo_task` for every method, budget and seed of ``m`` to the running flow's task
    runner; raises at once when its model or data is missing or does not fit (:func:`check`,
    before anything runs)."""
    check(m, seeds[0])  # every bad input fails here, not in a worker
    mdig = digest(Path(m.model)) if Path(m.model).exists() else m.model
    mdig += ":" + digest(Path(m.checkpoint)) if m.checkpoint else ""
    ddig = digest(Path(m.data.path))
    return [byo_task.submit(m, mdig, ddig, method, budget, seed, params, out, code, lineage, threads)
            for seed in seeds for method in m.methods for budget in m.budgets]


def track_child(parent_id: str, r: dict, params) -> str:
    """Say and log one user-model row under ``parent_id``: a child run with its settings, the
    fidelity metrics (and their interval bounds), the export and its report as artifacts.
    Returns the child's run id."""
    f = r["fidelity"]
    acc = f" acc {100 * f['accuracy_q']:.2f} % ({f['accuracy_diff']:+.2f} pts)" if "accuracy_q" in f else ""
    ppl = f" ppl x{f['perplexity_ratio']:.4f}" if "perplexity_ratio" in f else ""
    said = (f"KL {f['kl']:.5f}, agreement {100 * f['agreement']:.2f} %" if "kl" in f else
            f"feature error {100 * f['feature_error']:.3f} %, cosine {f['cosine']:.5f}, neighbour agreement "
            f"{100 * f['neighbour']:.2f} %")
    say(f"[byo] {r['model']} {r['method']} budget {r['budget']}: {said}{acc}{ppl} at {r['avg_bits']:.4f} bits, "
        f"{r['export']['file_bytes'] / 1e6:.2f} MB")
    metrics = {k: v for k, v in f.items() if isinstance(v, (int, float))}
    metrics |= {k: r[k] for k in ("avg_bits", "avg_bits_all", "total_bits", "quantize_seconds")}

    def artifacts(client, run_id: str) -> None:
        log_row_artifacts(client, run_id, {**r, "layer_bits": {}})
        for path in report_paths(Path(r["export"]["path"])):
            client.log_artifact(run_id, str(path), "report")

    params_ = {"model": r["model"], "model_source": r["model_source"], "method": r["method"], "budget": r["budget"],
               "seed": r["seed"], "dataset": r["dataset"], **row_params(params, r["method"])}
    tags = {"dataset_digest": r["dataset_digest"], **artifact_tags(r["export"])}
    return mlflow_child(parent_id, child_run_name(r["model"], r["method"], r["budget"], r["seed"]), params_, metrics,
                        tags, seconds=r["quantize_seconds"], artifacts=artifacts)


def track_row(record: dict, params, experiment: str = "bayesq-byo", params_path: Path | None = None) -> str:
    """One MLflow parent run with the row as its child (:func:`track_child`); returns the child's run id."""
    with mlflow_parent(experiment, "quantize", "byo", {"model_source": record["model_source"]}, params_path) as parent:
        return track_child(parent.info.run_id, record, params)


def _recorded_test(ds, meta: Mapping[str, str], data_digest: str) -> torch.Tensor | None:
    """The export's own test draw when ``ds`` is the data it was made from (same digest, and the
    redrawn test indices hash to the recorded sha256), else None."""
    if meta.get("dataset_digest") != data_digest or "draws" not in meta:
        return None
    d = json.loads(meta["draws"])
    draws = draw_examples(len(ds), d["calibration"]["n"], d["selection"]["n"], d["test"]["n"], int(meta["draw_seed"]))
    return draws.test if draws.digest("test") == d["test"]["sha256"] else None


def recorded_data(meta: Mapping[str, str], path: str, split: str = "", text_columns: tuple[str, ...] = (),
                  image_column: str = "", label_column: str | None = None) -> DataSource:
    """The data an export was made with, read at ``path``: its split and columns (the export's
    ``data_columns`` header) unless given (``label_column=""``: none)."""
    cols = json.loads(meta.get("data_columns", "{}"))
    return DataSource(path, split or meta.get("data_split", "train"), text_columns or tuple(cols.get("text", ())),
                      image_column or cols.get("image", ""), cols.get("label", "") if label_column is None
                      else label_column, int(cols.get("max_length", 128)), int(cols.get("image_size", 224)))


def onnx_metadata(path: Path) -> dict[str, str]:
    """The ``metadata_props`` of an ONNX file (what ``--target onnxruntime`` records of its lineage).

    Raises:
        ExportError: not an ONNX file that can be read.
    """
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as err:  # onnx raises DecodeError and others on a corrupt file
        raise ExportError(f"{path}: not a readable ONNX file ({type(err).__name__}: {err})") from err
    return {p.key: p.value for p in model.metadata_props}


def evaluate_export(path: Path, data_path: str, split: str = "", text_columns: tuple[str, ...] = (),
                    image_column: str = "", label_column: str | None = None, reference: str = "",
                    checkpoint: str = "", test: int = 512, seed: int = 0, say=print) -> tuple[dict, list[str]]:
    """An export against its FP model on a user's data, with no producer code: the export's own
    skeleton and preprocessing (:func:`bayesq.export.load`, its ``preprocessor`` header); an
    ``.onnx`` file (``--target onnxruntime``) run by ONNX Runtime (:class:`bayesq.onnx_export.OnnxModel`),
    its inputs preprocessed as the FP model's source does.

    The split and columns are the export's unless given (:func:`recorded_data`); ``reference``:
    the FP model's source (default: the one the export names, if it is here). The examples are
    the export's own test draw when the data is the one it was made from, else a seeded draw of
    ``test`` examples (all when fewer).

    Returns:
        (record, report lines).
    Raises:
        ValueError / FileNotFoundError: an export without a skeleton, a reference that is not
        here, bad columns (as :func:`prepare`).
    """
    onnx_file = Path(path).suffix == ".onnx"
    if onnx_file:  # the file's own metadata; the inputs' preprocessing is the FP model's (below)
        meta, pre, skel = onnx_metadata(path), {}, {}
    else:
        contents = read_export(path)
        meta, pre, skel = contents.user, contents.preprocessor, contents.skeleton
    if not onnx_file and (pre is None or skel is None or pre.get("kind") == "embedded"):
        raise ExportError(f"{path} does not describe its model's inputs (written before self-describing exports, or "
                          "an embedded model): evaluate it with the pipeline, or re-export it")
    data = recorded_data(meta, data_path, split, text_columns, image_column, label_column)
    reference = reference or meta.get("model_source", "")
    checkpoint = checkpoint or (meta.get("checkpoint", "") if meta.get("checkpoint") != reference else "")
    if not reference or not (Path(reference).exists() or reference.startswith("torchvision:") or ":" in reference):
        raise FileNotFoundError(f"KL to the FP model needs the FP model: the export names {reference or 'none'}, "
                                "which is not here; pass --reference (a Hugging Face folder, torchvision:<arch> "
                                "with --checkpoint, or package.module:function)")
    src = resolve_model(reference, checkpoint, int(skel.get("num_classes") or 0))
    if onnx_file:
        pre = src.preprocessor(data.image_size)
    ds = load_rows(data)
    check_columns(ds, data, src.modality.value)
    ddig = digest(Path(data.path))
    idx = _recorded_test(ds, meta, ddig)
    same = idx is not None
    if idx is None:
        idx = sample_calibration_indices(len(ds), min(test, len(ds)), seed)  # the first of a seeded permutation
    drawn = "the export's own test draw" if same else "a seeded draw"
    say(f"[eval] {path}: {len(idx)} examples of {data.path} ({drawn}); FP reference {reference}")
    fp = src.build()
    quantized = OnnxModel(path, features=src.headless) if onnx_file else load(path)
    with unpacked(pre.get("files", {})) as folder:
        batches = make_batches(ds, idx, featurizer(pre, data, folder), BATCH, "preprocess test")
    labels = read_labels(ds, idx, data, _num_classes(src, fp, batches[0]) if data.label_column else 0,
                         getattr(getattr(fp, "config", None), "label2id", None))
    report = fidelity_report(score_examples(fp, quantized, batches, labels, src.causal_lm))
    record = {"export": str(path), "reference": reference, "dataset": data.path, "dataset_digest": ddig,
              "examples": "export test draw" if same else f"seeded draw (seed {seed})", "fidelity": report.as_dict(),
              "model": meta.get("model", ""), "method": meta.get("method", ""), "budget": meta.get("budget", "")}
    return record, report.lines()


__all__ = ["BYO_METHODS", "ByoModel", "byo_from_mapping", "check", "prepare", "run_row", "track_row",
           "evaluate_export", "recorded_data", "byo_task", "submit_rows", "track_child", "paired_rows", "load_examples"]
