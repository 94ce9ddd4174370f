"""The ``bayesq`` command line (Typer): the pipeline, one model without DVC, reports, the UIs,
and what an export says about where it came from.

    bayesq run [--profile quick|full]
    bayesq quantize MODEL --budget 3.0 --out FILE
    bayesq report
    bayesq ui
    bayesq lineage FILE
    bayesq zoo run --zoo zoo.yaml [--dask local]
    bayesq zoo serve --zoo zoo.yaml --cron "0 3 * * 0"
"""

from __future__ import annotations

import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Optional

import typer

from flows import ROOT
from flows.settings import apply_defaults

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="BayesQ: posterior-guided post-training quantisation (pipeline, models, reports).")


@app.callback()
def _environment() -> None:
    # before any command imports Prefect or MLflow (their imports below are lazy)
    apply_defaults()


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(1)


@app.command()
def run(profile: str = typer.Option("quick", help="params.yaml profile: quick (one seed) or full (three)")) -> None:
    """Run the whole pipeline (fetch data, then `dvc repro`: finetune -> quantize -> report, and deploy)."""
    if profile not in ("quick", "full"):
        _fail(f"--profile must be quick or full, got {profile!r}")
    steps = [[sys.executable, "-m", "flows", "fetch", "--out", "data/raw"],
             ["dvc", "repro", "report", "deploy"] if profile == "quick" else
             ["dvc", "exp", "run", "-S", f"profile={profile}", "report", "deploy"]]
    for cmd in steps:
        typer.echo("$ " + " ".join(cmd))
        code = subprocess.call(cmd, cwd=ROOT)
        if code:
            raise typer.Exit(code)


@app.command()
def quantize(
    model: Optional[str] = typer.Argument(None, help="embedded model name, e.g. lite0-fmnist (or use --model)"),
    budget: float = typer.Option(3.0, help="average bits per quantised weight, all metadata counted"),
    out: Path = typer.Option(..., help="export file to write (.safetensors; .onnx for --target onnxruntime); the "
                                       "report goes next to it"),
    params: Path = typer.Option(ROOT / "params.yaml", help="settings (posterior, quant, allocation, distill)"),
    models: Path = typer.Option(ROOT / "models", help="folder of fine-tuned models (<name>/model.safetensors)"),
    raw: Path = typer.Option(ROOT / "data" / "raw", help="raw data folder (calibration inputs)"),
    seed: Optional[int] = typer.Option(None, help="calibration seed (default: the first of params.yaml)"),
    distill: bool = typer.Option(False, help="distil scales at budgets up to distill.max_budget, kept only if the "
                                             "held-out KL drops (off by default, like the pipeline's bayesq row; "
                                             "the bayesq-distill row has it: accepted on both embedded models at 3.0 "
                                             "bits, test KL 1-10 % lower for 2-10x the one-time cost)"),
    method: str = typer.Option("bayesq", help="bayesq, bayesq-ef, bayesq-paper, bayesq-brecq (BayesQ's encoding "
                                              "rounded again by BRECQ), or a baseline: gptq, optq, awq, "
                                              "smoothquant, hawq, zeroq, anneal, aciq, clip-block, lloyd-block, "
                                              "rtn-tensor, rtn-channel, rtn-group, adaround, brecq, lsq, lsq-plus, "
                                              "pact, dorefa, bit-split, ocs (settings from params.yaml)"),
    source: Optional[str] = typer.Option(None, "--model", help="your model: a Hugging Face folder, "
                                                                "torchvision:<arch> (with --checkpoint) or "
                                                                "package.module:function"),
    data: Optional[Path] = typer.Option(None, help="your data: a save_to_disk folder, .parquet / .csv / .jsonl "
                                                    "file or image folder"),
    split: str = typer.Option("train", help="split of a dataset folder"),
    text_column: list[str] = typer.Option([], help="text column (give it twice for sentence pairs)"),
    image_column: str = typer.Option("", help="image column (default 'image')"),
    label_column: str = typer.Option("", help="label column (optional: accuracy is reported with one)"),
    max_length: int = typer.Option(128, help="tokens per text input"),
    image_size: int = typer.Option(224, help="image side for torchvision transforms"),
    checkpoint: str = typer.Option("", help="state dict for torchvision:<arch> / package.module:function"),
    num_classes: int = typer.Option(0, help="torchvision: class count (default: read from the checkpoint)"),
    tokenizer: str = typer.Option("", help="package.module:function reading text: a tokenizer folder"),
    calibration: Optional[int] = typer.Option(None, help="calibration examples drawn from --data (default 512, "
                                                         "measured: benchmarks/byo_sizes.py; with fewer rows the "
                                                         "defaults shrink together to fit, and the run says so)"),
    selection: Optional[int] = typer.Option(None, help="held-out selection examples (choose among grids / variants; "
                                                       "default 256, shrunk likewise)"),
    test: Optional[int] = typer.Option(None, help="test examples the report compares Q with FP on (default 512, "
                                                  "shrunk likewise)"),
    name: str = typer.Option("", help="the model's name in the report and MLflow (default: the folder's)"),
    track: bool = typer.Option(True, help="log the row to MLflow (MLFLOW_TRACKING_URI; default mlflow.db)"),
    target: str = typer.Option("bayesq", help="where it runs: bayesq (BayesQ's .safetensors) or onnxruntime (an "
                                              ".onnx file of MatMulNBits nodes: widths 2/4/8, one per layer, blocks "
                                              "of 128; --method bayesq, gptq, optq or rtn-group)"),
    accuracy_level: int = typer.Option(4, help="--target onnxruntime: MatMulNBits' accuracy level, 4 (int8 "
                                               "activations: 2-5x faster at batch 1 than 1, for about 5 % more "
                                               "KL, measured in docs/findings.md) or 1 (float32 compute)"),
) -> None:
    """Quantise one model with BayesQ (or a baseline) and write its export, without DVC or Prefect.

    Your own model and data: `bayesq quantize --model ./my-bert --data sst2.parquet --text-column sentence
    --label-column label --budget 3.0 --out my-bert-3b.safetensors` (writes the export, a report next to
    it and an MLflow run)."""
    if distill and method != "bayesq":
        _fail(f"--distill applies to --method bayesq (the bayesq-distill row); --method {method} does not distil")
    if source is not None or data is not None:
        if model is not None:
            _fail(f"give an embedded model name ({model}) or --model/--data, not both")
        if source is None or data is None:
            _fail("your own model needs both --model (a Hugging Face folder, torchvision:<arch> or "
                  "package.module:function) and --data (a dataset folder or file)")
        _quantize_byo(source, data, split, tuple(text_column), image_column, label_column, max_length, image_size,
                      checkpoint, num_classes, tokenizer, calibration, selection, test, name, method, budget, out,
                      params, seed, distill, track, target, accuracy_level)
        return
    if model is None:
        _fail("name an embedded model (e.g. lite0-fmnist), or pass --model and --data for your own")
    _quantize_embedded(model, method, budget, out, params, models, raw, seed, distill, target, accuracy_level)


def _quantize_embedded(model: str, method: str, budget: float, out: Path, params: Path, models: Path, raw: Path,
                       seed: int | None, distill: bool, target: str, accuracy_level: int) -> None:
    """``bayesq quantize <embedded model>``: one row (:func:`flows.row.run_row`) on the model the
    pipeline fine-tuned, compared with it on the test split; the report goes next to the export."""
    from bayesq.harness.models.zoo import get_entry
    from bayesq.methods import Inputs
    from flows.common import read_params
    from flows.finetune import load_model, raw_path
    from flows.methods import Method
    from flows.prepare import calibration_batches, checked_exclude, selection_batches
    from flows.quantize import embedded_subject
    from flows.row import by_library, run_row, targeted

    choices = [m.value for m in Method]
    if method not in choices:
        _fail(f"--method {method}: choose one of {', '.join(choices)}")
    try:
        p = read_params(params)
        entry = get_entry(model)
    except (ValueError, KeyError, FileNotFoundError) as err:
        _fail(str(err))
    model_file = models / model / "model.safetensors"
    if not model_file.is_file():
        _fail(f"no fine-tuned model at {model_file}: run `bayesq run` first, or pass --models")
    seed = p.seeds[0] if seed is None else seed
    net = load_model(entry, model_file)
    try:
        exclude = checked_exclude(model, net, p.excluded(model))  # params.yaml's exclude, as the pipeline
    except ValueError as err:
        _fail(str(err))
    src = raw_path(entry, raw)
    splits = entry.load_splits(p.data, src)
    idx, batches = calibration_batches(entry, splits, p.data, p.calibration, seed)
    cfg, quant, label = _embedded_config(p, method, budget, seed, distill)
    try:
        cfg, quant = targeted((cfg, quant), method, target, out)
    except ValueError as err:
        _fail(str(err))
    meta = _embedded_metadata(p, params, model, label, budget, seed, cfg, quant, model_file, src, idx, tuple(exclude))
    inputs = Inputs(calibration=batches, selection=selection_batches(entry, splits, p.data, p.calibration, seed),
                    exclude=tuple(exclude))
    test = list(entry.batches(splits.test_inputs, 64, p.data))
    draws = {"calibration": {"n": len(idx)}, "test": {"n": len(splits.test_labels)}}
    reports = []
    subject = embedded_subject(entry, net, splits, p.data, partial(_compare, net, test, splits.test_labels, reports, {
        "model_source": str(model_file), "dataset": str(src), "dataset_digest": meta["dataset_digest"],
        "draws": draws}), tag=f"[quantize] {model}", example=batches[0])
    try:
        record = run_row(subject, by_library(net, cfg, quant, budget, inputs, p.quant), label, budget, seed, out, meta,
                         target=target, accuracy_level=accuracy_level, say=typer.echo)
    except (ValueError, MemoryError) as err:  # bad input; a peak the machine cannot hold (bayesq.memory)
        _fail(str(err))
    _say_row(record, out, reports[-1].lines())


def _compare(fp, test: list, labels, reports: list, fields: dict, loaded, path: Path) -> dict:
    """An embedded row's evaluation: the loaded file against the FP model on the test split
    (:func:`flows.byo.compared`); the report is appended to ``reports``."""
    from flows.byo import compared

    typer.echo(f"comparing with FP on the {len(labels)} test examples ...")
    return {**fields, **compared(fp, loaded, test, labels, path, reports)}


def _say_row(record: dict, out: Path, lines: list[str] | None) -> None:
    """Say what a row's file holds, what stayed in floating point and what was corrected, then its
    report (given its ``lines``, written next to the export first: :func:`flows.byo.write_report`)."""
    from flows.byo import report_paths, write_report

    r, e = record, record["export"]
    if r["target"] == "onnxruntime":
        typer.echo(f"{r['model']} at {r['budget']} bits for onnxruntime: {r['avg_bits']:.4f} bits/weight accounted, "
                   f"{e['file_avg_bits']:.4f} stored for the {len(e['matmulnbits'])} MatMulNBits layers; "
                   f"{e['file_bytes'] / 1e6:.2f} MB -> {out}; ONNX Runtime's logits within {e['max_logit_diff']:.2e} "
                   "of BayesQ's model at accuracy level 1")
    else:
        typer.echo(f"{r['model']} at {r['budget']} bits: {r['avg_bits']:.4f} bits/weight accounted, "
                   f"{e['payload_avg_bits']:.4f} in the file; {r['avg_bits_all']:.4f} over all weight matrices "
                   f"({len(r['unquantized'])} kept in floating point); {e['file_bytes'] / 1e6:.2f} MB "
                   f"({e['fp_bytes'] / 1e6:.2f} MB float tensors) -> {out} ({r['quantize_seconds']:.0f} s)")
    for name, why in {**r["unquantized"], **e.get("kept", {})}.items():
        typer.echo(f"  floating point: {name} ({why})")
    if "variant" in r:
        typer.echo(f"variant kept: {r['variant']}")
    if "bias_corrected" in r:
        skipped = "".join(f"\n  not corrected: {k} ({why})" for k, why in r["bias_skipped"].items())
        typer.echo(f"bias correction: {r['bias_corrected']} layers' mean outputs restored{skipped}")
    if "output_offset_layer" in r:
        before, after = r["output_offset_kl"]
        typer.echo(f"output offset: {r['output_offset_layer']}'s bias refitted, calibration KL {before:.5f} -> "
                   f"{after:.5f}" if r["output_offset_layer"] else f"output offset: none ({r['output_offset_skipped']})")
    if lines is not None:
        write_report(out, record, lines)
    typer.echo(report_paths(out)[1].read_text())


def _embedded_config(p, method: str, budget: float, seed: int, distill: bool) -> tuple:
    """(library config, QuantConfig of a BayesQ row or None, the row's label) of ``bayesq quantize
    --method``: BayesQ with params.yaml's settings (distillation only with ``--distill``), another
    BayesQ row or a baseline as the pipeline builds it."""
    from bayesq.config import BayesQConfig
    from bayesq.settings import replace
    from flows.configs import method_config

    d = p.distill if distill else replace(p.distill, max_budget=0.0)
    if method == "bayesq":
        cfg = BayesQConfig(budget=budget, posterior=p.posterior, quant=p.quant, allocation=p.allocation, distill=d,
                           seed=seed)
        return cfg, p.quant, ("bayesq-distill" if d.applies(budget) else "bayesq")
    return (*method_config(method, p, budget, seed), method)  # quant None for a baseline: its variant's, later


def _embedded_metadata(p, params: Path, model: str, label: str, budget: float, seed: int, cfg, quant,
                       model_file: Path, src: Path, idx, exclude: tuple[str, ...]) -> dict:
    """The export header's lineage of a ``bayesq quantize <embedded model>`` row."""
    from bayesq.config import BayesQConfig
    from flows.common import code_version, digest
    from flows.lineage import export_lineage, input_lineage, row_metadata

    posterior = (cfg if isinstance(cfg, BayesQConfig) else getattr(cfg, "bayesq", p)).posterior
    fitted = {"posterior": f"fitted in this run, not saved ({posterior.curvature.value}; settings in params)"}
    return row_metadata(model, label, budget, seed, code_version(), export_lineage(p),
                        input_lineage(str(model_file), str(src), digest(src), None, idx), params_file=str(params),
                        **(fitted if quant is not None else {}), **({"exclude": ",".join(exclude)} if exclude else {}))


def _quantize_byo(source, data, split, text_columns, image_column, label_column, max_length, image_size, checkpoint,
                  num_classes, tokenizer, calibration, selection, test, name, method, budget, out, params, seed,
                  distill, track, target="bayesq", accuracy_level=4) -> None:
    """``bayesq quantize --model ... --data ...`` (:mod:`flows.byo`)."""
    from flows.byo import BYO_METHODS, byo_from_mapping, prepare, run_row, track_row
    from flows.common import code_version, read_params
    from flows.lineage import export_lineage

    method = "bayesq-distill" if distill and method == "bayesq" else method
    if method not in BYO_METHODS:
        _fail(f"--method {method}: choose one of {', '.join(BYO_METHODS)}")
    try:
        p = read_params(params)
        spec = byo_from_mapping({"name": name, "model": source, "data": str(data), "split": split,
                                 "text_column": list(text_columns), "image_column": image_column,
                                 "label_column": label_column, "max_length": max_length, "image_size": image_size,
                                 "checkpoint": checkpoint, "num_classes": num_classes, "tokenizer": tokenizer,
                                 "calibration": calibration, "selection": selection, "test": test,
                                 "budgets": [budget], "methods": [method]}, "command line")
        seed = p.seeds[0] if seed is None else seed
        prep = prepare(spec, seed, say=typer.echo)
        record = run_row(prep, method, budget, p, seed, out, export_lineage(p), code_version(), say=typer.echo,
                         target=target, accuracy_level=accuracy_level)
    except (ValueError, FileNotFoundError, TypeError, MemoryError) as err:
        _fail(str(err))
    _say_row(record, out, None)
    if track:
        run_id = track_row(record, p, params_path=params)
        typer.echo(f"MLflow run {run_id} (experiment bayesq-byo)")


@app.command("eval")
def eval_export(
    export: Path = typer.Argument(..., help="an export (.safetensors, or .onnx for --target onnxruntime) written by "
                                            "`bayesq quantize --model ...`"),
    data: Path = typer.Option(..., help="data to compare on (a dataset folder or file)"),
    reference: str = typer.Option("", help="the FP model (default: the model the export names, if it is here)"),
    checkpoint: str = typer.Option("", help="the reference's state dict (torchvision:<arch>)"),
    split: str = typer.Option("", help="split of a dataset folder (default: the export's)"),
    text_column: list[str] = typer.Option([], help="text column(s) (default: the export's)"),
    image_column: str = typer.Option("", help="image column (default: the export's)"),
    label_column: Optional[str] = typer.Option(None, help="label column (default: the export's; '' for none)"),
    test: int = typer.Option(512, help="examples when the data is not the export's own (its test draw otherwise)"),
    seed: int = typer.Option(0, help="seed of that draw"),
    out: Optional[Path] = typer.Option(None, help="also write the record as JSON here"),
) -> None:
    """Compare an export with its FP model on data (KL, agreement; accuracy with labels; perplexity for a
    causal LM; 95 % paired intervals), rebuilt from the export alone: no producer code needed."""
    from bayesq.export import ExportError
    from flows.byo import evaluate_export
    from flows.common import write_json

    try:
        record, lines = evaluate_export(export, str(data), split, tuple(text_column), image_column, label_column,
                                        reference, checkpoint, test, seed, say=typer.echo)
    except (ValueError, FileNotFoundError, ExportError, TypeError) as err:
        _fail(str(err))
    for line in lines:
        typer.echo(line)
    if out is not None:
        write_json(out, record)


@app.command()
def report(results: Path = typer.Option(ROOT / "results" / "results.json", help="the quantize stage's results"),
           models: Path = typer.Option(ROOT / "models", help="fine-tuned models (their fp.json)"),
           out: Path = typer.Option(ROOT / "reports", help="folder for the tables and figures"),
           summary: Path = typer.Option(ROOT / "docs" / "results.md", help="the one-page results summary")) -> None:
    """Write the reports (main table, exports, calibration / robustness, figures) and the results summary."""
    from flows.report import report as write_report

    if not results.is_file():
        _fail(f"no results at {results}: run `bayesq run` first")
    write_report(results, models, out, summary)
    typer.echo(f"reports written to {out}, the summary to {summary}")


def _flat(prefix: str, obj) -> dict[str, str]:
    if isinstance(obj, dict) and obj:
        return {k: v for key, val in obj.items() for k, v in _flat(f"{prefix}.{key}", val).items()}
    return {prefix: str(obj)}


def _check(rows: dict[str, str]) -> list[str]:
    """Re-hash the checkpoint and posterior the export names (paths relative to the repository
    or the working directory), and for a user's model (``model_source``) its model folder and
    data (:func:`flows.common.digest`); lines saying ok / MISMATCH / missing."""
    from bayesq.tensorfile import file_sha256
    from flows.common import digest

    out = []
    checks = [("checkpoint", "checkpoint_sha256", file_sha256), ("posterior", "posterior_sha256", file_sha256)]
    if "model_source" in rows:  # a user's model (flows/byo.py): its folder (when it is one) and its data
        checks += [("model_source", "model_digest", digest), ("dataset", "dataset_digest", digest)]
    for what, key, hasher in checks:
        if key not in rows:
            continue
        path = next((p for p in (ROOT / rows[what], Path(rows[what])) if p.exists()), None)
        if path is None or (hasher is file_sha256 and not path.is_file()):
            out.append(f"{what} {rows[what]}: missing here (`dvc pull` fetches the pipeline's artifacts)")
        else:
            ok = hasher(path) == rows[key]
            out.append(f"{what} {path}: {'ok' if ok else 'MISMATCH (it changed since the export was written)'}")
    return out


@app.command()
def lineage(file: Path = typer.Argument(..., help="an export (.safetensors)"),
            check: bool = typer.Option(False, "--check", help="re-hash the checkpoint and posterior it names")) -> None:
    """Print what produced an export: model, method, budget, seed, commit, params, checkpoint,
    posterior and calibration inputs (with their hashes)."""
    import json

    from bayesq.export import ExportError, read_export

    try:
        c = read_export(file)
    except (ExportError, FileNotFoundError) as err:
        _fail(str(err))
    rows = {"format": f"{c.metadata['format']} v{c.metadata['format_version']}",
            "content sha256": c.metadata["content_sha256"], "architecture": c.architecture or "-",
            "accounted bits": c.metadata.get("accounted_bits", "-"),
            "avg bits (quantised weights)": c.metadata.get("avg_bits", "-"),
            "avg bits (all weight matrices)": c.metadata.get("avg_bits_all", "-"), **c.user}
    indices = rows.pop("calibration_indices", None)
    if indices and indices[0].isdigit():
        ids = indices.split(",")
        rows["calibration_indices"] = f"{len(ids)} training inputs: {', '.join(ids[:8])}{', ...' if len(ids) > 8 else ''}"
    elif indices:
        rows["calibration_indices"] = indices
    params = rows.pop("params", None)
    if params:
        rows.update(_flat("params", json.loads(params)))
    width = max(map(len, rows))
    for k, v in rows.items():
        typer.echo(f"{k.ljust(width)}  {v}")
    if check:
        problems = _check(rows)
        for line in problems:
            typer.echo(line)
        if any("MISMATCH" in line for line in problems):
            raise typer.Exit(1)


zoo_app = typer.Typer(no_args_is_help=True, help="Recompress a model zoo (once, or served on a schedule).")
app.add_typer(zoo_app, name="zoo")


def zoo_deployment(zoo: Path, cron: str, params: Path, raw: Path, models: Path, out: Path, dask: Optional[str]):
    """A Prefect deployment of the zoo flow on ``cron`` (validated), with absolute paths."""
    from prefect.client.schemas.schedules import CronSchedule

    from flows.zoo import make_zoo_flow, read_zoo

    read_zoo(zoo)  # fail now, not at 3 a.m.
    try:
        schedule = CronSchedule(cron=cron)
    except ValueError as err:
        raise ValueError(f"--cron {cron!r} is not a cron expression (e.g. '0 3 * * 0': Sundays 03:00): {err}") from None
    parameters = {"zoo": str(zoo.resolve()), "params_path": str(params.resolve()), "raw": str(raw.resolve()),
                  "models": str(models.resolve()), "out": str(out.resolve())}
    return make_zoo_flow(dask).to_deployment(name="bayesq-zoo", schedule=schedule, parameters=parameters)


@zoo_app.command("run")
def zoo_run(zoo: Path = typer.Option(..., help="zoo file (YAML list of models)"),
            params: Path = typer.Option(ROOT / "params.yaml"), raw: Path = typer.Option(ROOT / "data" / "raw"),
            models: Path = typer.Option(ROOT / "models"), out: Path = typer.Option(ROOT / "results-zoo"),
            dask: Optional[str] = typer.Option(None, help="'local' (2-worker LocalCluster) or a scheduler address"),
            workers: int = typer.Option(2, help="tasks at a time: threads (no --dask; 1 = serial) or the local "
                                                "Dask cluster's worker processes"),
            threads: Optional[int] = typer.Option(None, help="torch intra-op threads per task (default: all "
                                                             "cores, or cores / workers on a local Dask "
                                                             "cluster); equal counts give byte-identical exports")
            ) -> None:
    """Recompress every model of the zoo file at its budgets, once."""
    from flows.zoo import make_zoo_flow, read_zoo

    try:
        read_zoo(zoo)
        zoo_flow = make_zoo_flow(dask, workers, threads)
    except (ValueError, FileNotFoundError) as err:
        _fail(str(err))
    start = time.perf_counter()
    res = zoo_flow(zoo, params, raw, models, out, threads)
    typer.echo(f"wall time {time.perf_counter() - start:.1f} s")
    typer.echo(f"{len(res['records'])} model-budget rows, {len(res['failures'])} failed model(s) -> {out}")
    if res.get("paired") is not None:
        typer.echo(f"your models, with BayesQ minus each other method on the same test examples: {out / 'zoo.md'}")
    if res["failures"]:
        raise typer.Exit(1)


@zoo_app.command("serve")
def zoo_serve(zoo: Path = typer.Option(..., help="zoo file (YAML list of models)"),
              cron: str = typer.Option("0 3 * * 0", help="schedule (cron; default Sundays 03:00)"),
              params: Path = typer.Option(ROOT / "params.yaml"), raw: Path = typer.Option(ROOT / "data" / "raw"),
              models: Path = typer.Option(ROOT / "models"), out: Path = typer.Option(ROOT / "results-zoo"),
              dask: Optional[str] = typer.Option(None, help="'local' or a Dask scheduler address")) -> None:
    """Serve the zoo flow as a Prefect deployment on a cron schedule (runs until Ctrl-C)."""
    from prefect import serve

    try:
        deployment = zoo_deployment(zoo, cron, params, raw, models, out, dask)
    except (ValueError, FileNotFoundError) as err:
        _fail(str(err))
    typer.echo(f"serving 'bayesq-zoo' on '{cron}'; Ctrl-C stops")
    serve(deployment)


def _serve(servers: dict[str, tuple[list[str], dict[str, str]]]) -> None:
    """Start the servers (command, extra environment), wait until Ctrl-C or one of them exits,
    then stop all of them.

    Ctrl-C is a clean stop; a server that exits by itself (e.g. its port is taken) exits 1."""
    import os

    procs = {name: subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}) for name, (cmd, env) in servers.items()}
    try:
        while all(p.poll() is None for p in procs.values()):
            time.sleep(0.5)
        gone = [f"{n} (status {p.returncode})" for n, p in procs.items() if p.poll() is not None]
        typer.secho(f"{', '.join(gone)} exited; stopping the others", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        typer.echo("stopping")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def mlflow_runs_url(base: str, tracking_uri: str, experiment: str = "bayesq") -> str:
    """The URL of ``experiment``'s runs table in the MLflow UI at ``base``
    (:func:`flows.tracking.runs_table_url`); ``base`` itself while the store has no such
    experiment yet."""
    import mlflow

    try:
        found = mlflow.tracking.MlflowClient(tracking_uri).get_experiment_by_name(experiment)
    except Exception:  # noqa: BLE001  (no store yet: nothing to link to)
        found = None
    if found is None:
        return base
    from flows.tracking import runs_table_url

    return runs_table_url(base, found)


def ui_servers(mlflow_port: int, prefect_port: int, tracking_uri: str) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Command and extra environment of each UI server, both on 127.0.0.1.

    MLflow with one worker (the default four are heavy on 2 cores). Prefect with the API URL its
    UI calls set to this port (Prefect 3.8 points the UI at port 4200 otherwise) and the V1 UI
    as the default (the V2 UI loads a third-party analytics script when a page opens).
    """
    bin_dir = Path(sys.executable).parent
    prefect_env = {"PREFECT_UI_API_URL": f"http://127.0.0.1:{prefect_port}/api",
                   "PREFECT_SERVER_UI_V2_ENABLED": "false",
                   "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false"}
    return {"mlflow": ([str(bin_dir / "mlflow"), "ui", "--backend-store-uri", tracking_uri, "--host", "127.0.0.1",
                        "--port", str(mlflow_port), "--workers", "1"], {}),
            "prefect": ([str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1",
                         "--port", str(prefect_port)], prefect_env)}


@app.command()
def ui(mlflow_port: int = typer.Option(5000, help="MLflow UI port on 127.0.0.1"),
       prefect_port: int = typer.Option(4200, help="Prefect UI port on 127.0.0.1")) -> None:
    """MLflow UI and Prefect UI on loopback; prints the pages to open; Ctrl-C stops both."""
    import os

    uri = os.environ["MLFLOW_TRACKING_URI"]
    typer.echo(f"MLflow runs   {mlflow_runs_url(f'http://127.0.0.1:{mlflow_port}', uri)}\n"
               f"Prefect runs  http://127.0.0.1:{prefect_port}/runs\nCtrl-C stops both")
    _serve(ui_servers(mlflow_port, prefect_port, uri))


if __name__ == "__main__":
    app()
