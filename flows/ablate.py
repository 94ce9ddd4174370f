"""DVC stage `ablate`: BayesQ with one component switched per row, on the embedded models.

    python -m flows ablate --params params.yaml --raw data/raw --models models --out results-ablations

Rows come from ``ablations.rows`` in ``params.yaml`` (``{group: {label: {section.key: value}}}``),
each the main parameters with its overrides applied (validated on load); a row may also name
``method: bayesq-distill`` (default ``bayesq``).  Per (model, row) a
posterior task and a table task (both cached, so rows that share a posterior or table reuse
it), then one quantise-and-evaluate task per ablation budget, scored against the FP model's
test logits (one cached FP evaluation per model) example by example: KL to FP and correctness
in ``<out>/examples/<group>/<row>/``, for the report's paired differences against the first
row.  Every evaluation is an MLflow child run tagged with its group and row.  Writes ``<out>/ablations.json``: ``records`` (one per
model, row and budget) and ``diminishing`` (the core row's loss-reduction curve per budget).
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from bayesq.assignment import loss_reduction_curve
from bayesq.harness.models.zoo import get_entry
from flows.common import code_version, digest, parser, read_params, write_json
from flows.finetune import load_model, raw_path
from flows.methods import Method
from flows.params import ablation_params
from flows.prepare import (
    checked_exclude, config_tag, fit_inputs, posterior_task, prep_code, reference_task, shared_cost, stats_task,
    table_task,
)
from flows.quantize import Row, Source, quantize_eval_task
from flows.robustness import fp_eval_task
from flows.tracking import (
    flow_run_namer, log_row_artifacts, mlflow_child, mlflow_parent, row_params, say, write_run_file,
)

ROW_METHODS = (Method.BAYESQ, Method.BAYESQ_DISTILL)  # what a row's optional ``method`` key may name


def row_method(over: dict, where: str) -> Method:
    """The method of a row: its ``method`` key (``bayesq`` or ``bayesq-distill``), default ``bayesq``."""
    value = over.get("method", Method.BAYESQ.value)
    if value not in [m.value for m in ROW_METHODS]:
        raise ValueError(f"{where}: method {value!r} is not one an ablation row can run; "
                         f"use one of {[m.value for m in ROW_METHODS]}")
    return Method(value)


def ablation_rows(params) -> list[tuple[str, str, dict, object]]:
    """(group, label, overrides, params of the row) for every row, validated; a row's optional
    ``method`` key (not a params section) is kept in the overrides and read by :func:`row_method`."""
    rows = []
    for group, labels in params.ablations.rows.items():
        for label, over in labels.items():
            where = f"ablations.rows.{group}.{label}"
            row_method(dict(over), where)
            dotted = {k: v for k, v in over.items() if k != "method"}
            rows.append((group, label, dict(over), ablation_params(params, dotted, where)))
    if not rows:
        raise ValueError("ablations.rows is empty: list at least one row in params.yaml")
    return rows


@flow(name="bayesq-ablate", flow_run_name=flow_run_namer("ablate"))
def ablate_flow(params_path: Path, raw: Path, models: Path, out: Path) -> list[dict]:

    params = read_params(params_path)
    rows = ablation_rows(params)
    seed = params.seeds[0]
    code = code_version()
    records, curves = [], {}
    names = params.ablations.models or params.models
    with mlflow_parent("bayesq-ablations", "ablate", params.profile, {}, params_path) as parent:
        write_run_file(Path(out), parent)
        for name in names:
            entry = get_entry(name)
            model_file = Path(models) / name / "model.safetensors"
            mdig, src = digest(model_file), raw_path(entry, raw)
            sdig = digest(src)
            if params.excluded(name):  # each pattern must match a layer: checked before any row runs
                checked_exclude(name, load_model(entry, model_file), params.excluded(name))
            fp = fp_eval_task(name, str(model_file), mdig, str(src), sdig, params.data, params.robustness, seed,
                              prep_code(), out=str(out))  # writes the FP test logits the rows compare with
            for i, (group, label, over, p) in enumerate(rows):
                try:
                    recs, curve = _row(name, i, group, label, over, p, params, model_file, mdig, src, sdig,
                                       seed, out, code, parent.info.run_id, fp["logits_file"])
                except Exception as err:  # one broken row is reported, the others still run
                    say(f"[ablate] {name} {group} / {label}: FAILED: {err!r}")
                    records.append({"model": name, "group": group, "row": label, "error": repr(err),
                                    "overrides": {k: str(v) for k, v in over.items()}})
                    continue
                records += recs
                if curve:
                    curves[name] = curve
    write_json(Path(out) / "ablations.json", {"records": records, "diminishing": curves})
    return records


def _row(name, index, group, label, over, p, params, model_file, mdig, src, sdig, seed, out, code, parent_id,
         fp_logits: str):
    """Posterior, table and every budget of one ablation row on one model (tasks are cached),
    leaving out the modules the model excludes (``exclude`` in params.yaml)."""
    records, curve = [], None
    cal = fit_inputs(p.calibration)  # the fits ignore the selection settings (rows differing only there share them)
    exclude = p.excluded(name)
    post = posterior_task(name, str(model_file), mdig, str(src), sdig, p.data, cal,
                          p.posterior, seed, str(Path(out) / "posterior"), prep_code(),
                          tag=config_tag(cal, p.posterior), exclude=exclude)
    stats = stats_task(name, str(model_file), mdig, str(src), sdig, p.data, cal, seed,
                       str(Path(out) / "stats"), prep_code(), exclude=exclude)
    tab = table_task(name, str(model_file), mdig, post["path"], digest(Path(post["path"])),
                     str(src), sdig, p.data, cal, p.quant, seed,
                     str(Path(out) / "tables"), prep_code(), tag=config_tag(p.quant),
                     stats_file=stats["path"], stats_sha256=stats["sha256"])
    ref = reference_task(name, str(model_file), mdig, str(src), sdig, p.data, p.calibration, seed,
                         str(Path(out) / "reference"), prep_code())
    key = f"{digest(Path(post['path']))}:{p.quant}:{p.calibration}"
    if index == 0:
        curve = {str(b): {str(f): v for f, v in loss_reduction_curve(
            tab["table"], b, p.allocation).items()} for b in params.ablations.budgets}
    for budget in params.ablations.budgets:
        method = row_method(over, label)
        row = Row(Source(name, str(model_file), mdig, str(src), sdig), method.value, budget, seed, code, p.data,
                  p.quant, p.allocation, str(Path(out) / "exports" / group / label), calibration=p.calibration,
                  distill=p.distill, table_key=key, posterior_file=post["path"],
                  examples_dir=str(Path(out) / "examples" / group / label), fp_logits=fp_logits,
                  stats_file=stats["path"], stats_sha256=stats["sha256"], reference_file=ref.get("path"),
                  reference_sha256=ref.get("sha256", ""), exclude=exclude)
        r = quantize_eval_task(row, tab["table"], tab.get("tables"))
        r = {**r, **shared_cost(r, stats, ref), "group": group, "row": label, "overrides": {k: str(v) for k, v in over.items()},
             "posterior_seconds": post["seconds"], "table_seconds": tab["seconds"]}
        say(f"[ablate] {name} {group} / {label} @ {budget}: acc {r['accuracy']:.4f} at {r['avg_bits']:.4f} bits")
        metrics = {k: r[k] for k in ("accuracy", "avg_bits", "quantize_seconds", "eval_seconds", "posterior_seconds",
                                     "table_seconds", "stats_seconds", "reference_seconds", "kl_mean", "kl_se",
                                     "agreement") if k in r}
        one_time = sum(r.get(k, 0.0) for k in ("quantize_seconds", "posterior_seconds", "table_seconds",
                                                 "stats_seconds", "reference_seconds"))
        mlflow_child(parent_id, f"{name}/{group}/{label}/b{float(budget)}/s{seed}",
                     {"model": name, "group": group, "row": label, "seed": seed, "budget": budget,
                      **{f"override.{k}": str(v) for k, v in over.items()},
                      **row_params(p, method, p.posterior, p.quant)},
                     metrics, {"profile": params.profile, "code_version": code},
                     seconds=one_time + r.get("eval_seconds", 0.0),
                     artifacts=lambda c, rid: log_row_artifacts(c, rid, r))
        records.append(r)
    return records, curve


def main() -> None:
    p = parser("Run the ablation rows of params.yaml on the embedded models")
    p.add_argument("--raw", type=Path, required=True)
    p.add_argument("--models", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    ablate_flow(a.params, a.raw, a.models, a.out)


if __name__ == "__main__":
    main()
