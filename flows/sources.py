"""DVC stage `sources`: the user's models and data declared in params.yaml's ``sources:``, run next
to the embedded models.

    python -m flows sources --params params.yaml --out results-sources

Each entry (a Hugging Face folder, ``torchvision:<arch>`` with a checkpoint or
``package.module:function``, and its data with the column keys; :class:`flows.params.ByoModel`)
runs at its budgets and methods for every seed, one cached task per row (:func:`flows.byo.byo_task`:
quantise, export with its skeleton, load back, compare with FP on the test draw with paired 95 %
intervals). One MLflow parent run per invocation, a child per row. Writes
``<out>/sources.json`` (``records``, ``failures``, ``paired``: BayesQ minus every other method on
the same test examples, :func:`flows.byo.paired_rows`), ``<out>/sources.md`` (the table the report
stage copies to ``reports/sources.md``) and the exports with their reports in ``<out>/exports/``.
With no ``sources:`` it writes an empty table, so the stage costs nothing by default.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows.byo import paired_rows, submit_rows, track_child
from flows.common import code_version, parser, read_params, write_json
from flows.lineage import export_lineage
from flows.tracking import flow_run_namer, mlflow_parent, say


def _cell(f: dict, key: str, scale: float = 1.0, digits: int = 4) -> str:
    if key not in f:
        return "-"
    return (f"{scale * f[key]:.{digits}f} [{scale * f[key + '_ci_low']:.{digits}f}, "
            f"{scale * f[key + '_ci_high']:.{digits}f}]")


LOGIT_COLUMNS = (("KL(FP ‖ Q)", "kl", 1.0, 5), ("agreement %", "agreement", 100.0, 2),
                 ("accuracy Q − FP (pts)", "accuracy_diff", 1.0, 2), ("perplexity Q / FP", "perplexity_ratio", 1.0, 4))
FEATURE_COLUMNS = (("feature error %", "feature_error", 100.0, 3), ("cosine", "cosine", 1.0, 5),
                   ("neighbour agreement %", "neighbour", 100.0, 2))  # (header, fidelity key, scale, digits)


def _rows_table(records: list[dict], intro: str, columns: tuple) -> list[str]:
    """Markdown lines: ``intro``, then one row per record (sorted) with ``columns`` of its fidelity."""
    out = ["", intro, "", "| model | method | budget | seed | bits/weight | " + " | ".join(c[0] for c in columns)
           + " | test examples |", "|---" * (len(columns) + 6) + "|"]
    for r in sorted(records, key=lambda r: (r["model"], r["budget"], r["method"], r["seed"])):
        f = r["fidelity"]
        cells = " | ".join(_cell(f, key, scale, digits) for _, key, scale, digits in columns)
        out.append(f"| {r['model']} | {r['method']} | {r['budget']} | {r['seed']} | {r['avg_bits']:.4f} | {cells} "
                   f"| {f['n']} |")
    return out


def sources_table(records: list[dict], failures: list[dict], title: str = "Your models (params.yaml `sources:`)") -> str:
    """Markdown: one row per (model, method, budget, seed) with the true bits and each fidelity
    metric with its 95 % paired bootstrap interval; BayesQ minus each other method on the same
    test examples; then the failures. Also the zoo flow's table of its user-model entries."""
    lines = [f"# {title}"]
    if not records and not failures:
        return "\n".join(lines + ["", "No user models are declared: add them under `sources:` in params.yaml "
                                  "(docs/usage.md, bring your own model and data).", ""])
    logit = [r for r in records if "kl" in r["fidelity"]]
    headless = [r for r in records if "kl" not in r["fidelity"]]
    if logit:
        lines += _rows_table(logit, "Quantised vs full precision on each model's test draw: value [95 % paired bootstrap "
                             "interval]. KL in nats; accuracy difference Q - FP in points; perplexity ratio Q / FP "
                             "(causal LMs).", LOGIT_COLUMNS)
    if headless:
        lines += _rows_table(headless, "Models without a head, scored on their features: relative error of the final "
                             "hidden states ||F_Q − F_FP|| / ||F_FP|| (%), cosine similarity of the mean-pooled "
                             "embeddings, and agreement of each test example's nearest neighbour among the others (%).",
                             FEATURE_COLUMNS)
    paired = paired_rows(records)
    if paired:
        lines += ["", "BayesQ minus each other method on the same test examples (paired bootstrap, 95 %; "
                      "negative KL or feature error: BayesQ closer to FP; positive accuracy, cosine or neighbour "
                      "agreement: BayesQ better):", "",
                  "| model | budget | seed | BayesQ − | KL diff (nats) | accuracy diff (pts) | feature error diff (pts) "
                  "| cosine diff | neighbour diff (pts) | examples |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for p in paired:
            cells = [_diff(p[k], d) if k in p else "-" for k, d in
                     (("kl", 5), ("accuracy", 2), ("feature_error", 3), ("cosine", 5), ("neighbour", 2))]
            lines.append(f"| {p['model']} | {p['budget']} | {p['seed']} | {p['baseline']} | {' | '.join(cells)} "
                         f"| {p['n']} |")
    for f in failures:
        lines.append(f"\n**{f['model']} failed:** {f['error']}")
    return "\n".join(lines + [""])


def _diff(d: dict, digits: int) -> str:
    return f"{d['diff']:+.{digits}f} [{d['ci_low']:+.{digits}f}, {d['ci_high']:+.{digits}f}]"


def sources_flow_body(params_path: Path, out: Path) -> dict:
    """Submit every row of every ``sources:`` entry, gather records and failures (a model that
    fails is reported, the others go on), log them to MLflow and write the results."""
    params = read_params(params_path)
    code, lineage = code_version(), export_lineage(params)
    futures, failures, records = {}, [], []
    for m in params.sources:
        try:
            futures[m.name] = submit_rows(m, params, str(out), code, lineage, params.seeds)
        except Exception as err:  # one failing model is reported; the others go on
            failures.append({"model": m.name, "error": f"{type(err).__name__}: {err}"})
    if params.sources:
        with mlflow_parent("bayesq-sources", "sources", params.profile, {}, params_path) as parent:
            for name, futs in futures.items():
                try:
                    rows = [f.result() for f in futs]
                except Exception as err:
                    failures.append({"model": name, "error": f"{type(err).__name__}: {err}"})
                    continue
                for r in rows:
                    track_child(parent.info.run_id, r, params)
                records += rows
    for f in failures:
        say(f"[sources] {f['model']}: FAILED: {f['error']}")
    result = {"records": records, "failures": failures}
    result["paired"] = paired_rows(records)
    write_json(Path(out) / "sources.json", result)
    (Path(out) / "sources.md").write_text(sources_table(records, failures))
    return result


sources_flow = flow(name="bayesq-sources", flow_run_name=flow_run_namer("sources"))(sources_flow_body)


def run_sources(params_path: Path, out: Path) -> dict:
    """:func:`sources_flow_body` as a Prefect flow when ``params_path`` declares sources; with
    none, the body alone (the empty table in seconds: no Prefect server to start, no MLflow run)."""
    if read_params(params_path).sources:
        return sources_flow(params_path, out)
    return sources_flow_body(params_path, out)


def main() -> None:
    p = parser("Quantise and evaluate the user models of params.yaml's sources")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    res = run_sources(a.params, a.out)
    if res["failures"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
