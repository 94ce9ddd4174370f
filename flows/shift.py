"""DVC stage `shift`: calibration data that does not match deployment (``make ablations``).

    python -m flows shift --params params.yaml --raw data/raw --models models --out results-shift \\
                          --report reports/shift.md

Users calibrate on the data they have, not on a draw of what their model will serve. Every
correction fitted to calibration outputs (BayesQ's output offset and bias correction, its
selection among grids; the baselines' bias correction and offset) is checked here on test
examples from another domain than its fit. For each case of ``shift.cases`` in ``params.yaml``
(a model, the part of the data it is calibrated on, the parts it is tested on) and each method of
``shift.methods``, the rows of :data:`ROWS` run: the method as the pipeline runs it and without
its data-fitted corrections (BayesQ also without its offset alone and without its grid
selection). The calibration and held-out selection inputs are drawn from the calibration part
exactly as the quantize stage draws them from a training split (:mod:`flows.prepare`).

Each row's test logits go to ``<out>/logits/<case>/<test>/<method>__<row>.safetensors`` (the FP
model's to ``.../fp.safetensors``), one cached Prefect task per row. BayesQ's row without its
offset also yields :data:`FULL_OFFSET`, the same model with the offset fitted in full (the default
until 2026-12-07), which is how the default's offset differs from it. The report compares every
row with the FP model example by example (KL, top-1 agreement, accuracy) and pairs each method's
default with its row without corrections and BayesQ's default with GPTQ's, with 95 % paired
bootstrap intervals (:func:`bayesq.comparison.paired_difference`). Every row is an MLflow child run.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from prefect import flow, task

from bayesq.comparison import (
    agreement_per_example, correct_per_example, fidelity_summary, kl_per_example, paired_difference,
)
from bayesq.evaluation import predict
from bayesq.harness.data.sentiment import binary_labels, load_vader_domain, seeded_permutation
from bayesq.harness.models.zoo import Splits, get_entry
from bayesq.methods import Inputs, quantize_with
from bayesq.output_offset import fit_output_offset
from bayesq.tensorfile import save_tensors
from flows.common import CACHE, code_version, digest, parser, read_params, write_json
from flows.configs import method_config
from flows.finetune import load_model, raw_path
from flows.labels import ci_text
from flows.methods import SHIFT_METHODS, Method
from flows.params import ablation_params
from flows.prepare import calibration_batches, selection_batches
from flows.robustness import DOMAIN_SEED, domain_split, read_tensors
from flows.stage_params import ShiftCase
from flows.tracking import flow_run_namer, mlflow_child, mlflow_parent, row_params, say, write_run_file

DEFAULT = "default"
NO_CORRECTIONS = "no corrections"
NO_OFFSET = "no output offset"
FULL_OFFSET = "offset fitted in full (before)"
BAYESQ_ROWS = ((DEFAULT, {}), (NO_OFFSET, {"quant.output_offset": False}),
               (NO_CORRECTIONS, {"quant.output_offset": False, "quant.bias_correction": False}),
               ("no grid selection", {"quant.select_grids": False}))
#: The rows of each method: (label, params.yaml overrides). A baseline's corrections are its bias
#: correction and the output offset of its kept variant (``baselines.<method>.bias_correction``).
ROWS = {m: BAYESQ_ROWS if m is Method.BAYESQ else
        ((DEFAULT, {}), (NO_CORRECTIONS, {f"baselines.{m.value}.bias_correction": False})) for m in SHIFT_METHODS}
BATCH = 64  # test examples per forward pass


def case_splits(case: ShiftCase, params, raw: Path, test_examples: int) -> tuple[Splits, dict[str, Splits]]:
    """(the calibration pool as a :class:`Splits` whose training part is drawn from, {test name:
    a :class:`Splits` whose test part is scored}) of one case. Text: the ``movie`` domain is the
    model's own training / test split, another domain its sentences labelled by sign (tests: at
    most ``test_examples`` of them, a seeded subset). Images: the training images of the calibration
    classes; the test split's first ``test_examples`` images, every class."""
    entry = get_entry(case.model)
    own = entry.load_splits(params.data, raw)
    none = torch.zeros(0, dtype=torch.int64)
    if entry.task == "image":
        keep = torch.isin(own.train_labels, torch.tensor(case.calibrate, dtype=torch.int64))
        pool = Splits(own.train_inputs[keep], own.train_labels[keep], own.test_inputs[:0], none)
        test = Splits(own.train_inputs[:0], none, own.test_inputs[:test_examples], own.test_labels[:test_examples])
        return pool, {"all": test}
    if case.calibrate == "movie":
        pool = Splits(own.train_inputs, own.train_labels, [], none)
    else:
        sentences, labels = binary_labels(load_vader_domain(raw, case.calibrate))
        pool = Splits(sentences, labels, [], none)
    tests = {}
    for domain in case.test:
        if domain == "movie":  # the test split, in its length order: a seeded subset of it when capped
            keep = seeded_permutation(len(own.test_labels), DOMAIN_SEED)[:test_examples].sort().values
            inputs, labels = [own.test_inputs[i] for i in keep.tolist()], own.test_labels[keep]
        else:
            inputs, labels = domain_split(raw, domain, test_examples)
        tests[domain] = Splits([], none, inputs, labels)
    return pool, tests


def logits_file(out: Path, case: str, test: str, row: str) -> Path:
    """Where a row's test logits go: ``<out>/logits/<case>/<test>/<row>.safetensors``."""
    return Path(out) / "logits" / case / test / f"{row.replace(' ', '-').replace('/', '-')}.safetensors"


def row_name(method: str, label: str) -> str:
    """The file and report name of a row: ``<method>__<label>``."""
    return f"{method}__{label}"


@task(cache_policy=CACHE, persist_result=True, task_run_name="shift FP {case.name}")
def fp_task(case: ShiftCase, model_file: str, model_digest: str, raw: str, raw_digest: str, params, out: str,
            code: str) -> dict:
    """The FP model's logits (float32) and the labels of every test set of ``case``: {test: file}."""
    entry = get_entry(case.model)
    model = load_model(entry, Path(model_file))
    _, tests = case_splits(case, params, Path(raw), params.shift.test_examples)
    files = {}
    for test, split in tests.items():
        z = predict(model, entry.batches(split.test_inputs, BATCH, params.data), f"FP on {test}")
        path = logits_file(Path(out), case.name, test, "fp")
        save_tensors(path, {"logits": z.float().contiguous(), "labels": split.test_labels.contiguous()},
                     {"case": case.name, "test": test})
        files[test] = str(path)
    return files


@task(cache_policy=CACHE, persist_result=True, task_run_name="shift {case.name} {method} {label}")
def row_task(case: ShiftCase, method: str, label: str, params, seed: int, model_file: str, model_digest: str,
             raw: str, raw_digest: str, out: str, code: str) -> list[dict]:
    """Quantise ``case.model`` with ``method`` under the row's ``params`` on the case's calibration
    and selection draws; its logits on every test set. Returns one record per row it yields
    (BayesQ without its offset also yields :data:`FULL_OFFSET`): ``{case, method, row, avg_bits,
    seconds, files: {test: logits file}}``."""
    entry = get_entry(case.model)
    model = load_model(entry, Path(model_file))
    budget = params.shift.budget
    pool, tests = case_splits(case, params, Path(raw), params.shift.test_examples)
    _, cal = calibration_batches(entry, pool, params.data, params.calibration, seed)
    sel = selection_batches(entry, pool, params.data, params.calibration, seed)
    config = method_config(method, params, budget, seed)[0]
    start = time.perf_counter()
    result = quantize_with(model, config, budget, Inputs(calibration=cal, selection=sel,
                                                         exclude=params.excluded(case.model))).result
    seconds = time.perf_counter() - start
    shifted = {label: torch.zeros(())}
    if method == Method.BAYESQ.value and label == NO_OFFSET:  # the same model with the offset fitted in full
        full = fit_output_offset(model, result.model, cal, selection=sel, shrink=1.0)
        if full.fitted:
            shifted[FULL_OFFSET] = full.shift.float()
    files: dict[str, dict[str, str]] = {row: {} for row in shifted}
    for test, split in tests.items():  # one pass of the model per test set, shared by the rows it yields
        z = predict(result.model, entry.batches(split.test_inputs, BATCH, params.data), f"{label} on {test}")
        for row, shift in shifted.items():
            path = logits_file(Path(out), case.name, test, row_name(method, row))
            save_tensors(path, {"logits": (z + shift).float().contiguous()}, {"case": case.name, "test": test})
            files[row][test] = str(path)
    return [{"case": case.name, "model": case.model, "method": method, "row": row, "avg_bits": result.average_bits,
             "seconds": seconds, "files": files[row]} for row in shifted]


def scores(fp_file: str, row_file: str) -> dict[str, torch.Tensor]:
    """Per-example ``kl`` (float64), ``agree`` and ``correct`` (float64 0/1) of a row's saved
    logits against the FP model's, on the same test examples."""
    fp, row = read_tensors(Path(fp_file)), read_tensors(Path(row_file))
    z_fp, z = fp["logits"].double(), row["logits"].double()
    return {"kl": kl_per_example(z_fp, z), "agree": agreement_per_example(z_fp, z).double(),
            "correct": correct_per_example(z, fp["labels"]).double()}


def summarise(records: list[dict], fp_files: dict[str, dict[str, str]]) -> list[dict]:
    """Per (case, test, row): KL (mean, SE), agreement and accuracy (%), and the paired
    differences the report shows: the row minus its method's row without corrections
    (``vs_no_corrections``), BayesQ's default minus GPTQ's default (``vs_gptq``) and minus the
    offset fitted in full (``vs_full_offset``); each ``{kl: {diff, ci_low, ci_high}, agreement: ...,
    accuracy: ...}`` (agreement and accuracy in points)."""
    by_test: dict[tuple[str, str], dict[str, dict]] = {}
    for r in records:
        for test, path in r["files"].items():
            by_test.setdefault((r["case"], test), {})[row_name(r["method"], r["row"])] = \
                {**r, "test": test, "scores": scores(fp_files[r["case"]][test], path)}
    out = []
    for (case, test), rows in by_test.items():
        for name, r in rows.items():
            s = r["scores"]
            fid = fidelity_summary(s["kl"], s["agree"])
            summary = {k: r[k] for k in ("case", "model", "method", "row", "avg_bits", "seconds", "test")}
            summary |= {"kl_mean": fid.kl_mean, "kl_se": fid.kl_se, "agreement": 100 * fid.agreement,
                        "accuracy": 100 * float(s["correct"].mean()), "n": fid.n}
            pairs = {"vs_no_corrections": row_name(r["method"], NO_CORRECTIONS)}
            if name == row_name(Method.BAYESQ.value, DEFAULT):
                pairs |= {"vs_gptq": row_name(Method.GPTQ.value, DEFAULT),
                          "vs_full_offset": row_name(Method.BAYESQ.value, FULL_OFFSET)}
            for key, other in pairs.items():
                if other in rows and other != name:
                    summary[key] = _paired(s, rows[other]["scores"])
            out.append(summary)
    return out


def _paired(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """``a - b`` of each per-example score with its 95 % paired interval, ``{diff, ci_low, ci_high}``
    (agreement and accuracy in points)."""
    return {name: paired_difference(scale * a[key], scale * b[key]).as_dict()
            for name, key, scale in (("kl", "kl", 1.0), ("agreement", "agree", 100.0), ("accuracy", "correct", 100.0))}


def _interval(d: dict[str, float] | None, fmt: str) -> str:
    """:func:`flows.labels.ci_text` of a paired difference; "–" when there is none."""
    return ci_text(d, fmt) if d else "–"


def report_markdown(summaries: list[dict], params) -> str:
    """``reports/shift.md``: one table per (case, test set), then BayesQ's default against GPTQ's
    and against the offset fitted in full."""
    cfg = params.shift
    lines = ["# Calibration that does not match deployment", "",
             f"Written by the `shift` stage (`make ablations`; `flows/shift.py`). Each case calibrates the model on "
             f"one part of the data (its calibration and held-out selection draws, seed {params.seeds[0]}, "
             f"{params.calibration.images} + {params.calibration.selection_images} images or "
             f"{params.calibration.sentences} + {params.calibration.selection_sentences} sentences, fewer where the "
             f"part is smaller) and tests it on another, at {cfg.budget} bits. KL: mean KL(p_FP ‖ p_Q) ± its SE "
             "(nats); agreement: top-1 agreement with the FP model; accuracy against the labels (%). Differences "
             "are paired on the same test examples with 95 % bootstrap intervals; * marks an interval that "
             "excludes 0. \"− no corrections\": the row minus its method's row without data-fitted corrections "
             "(BayesQ: bias correction and output offset; GPTQ / OPTQ / AWQ: bias correction and the offset of "
             f"the kept variant). \"{FULL_OFFSET}\": BayesQ's row without its offset, with the offset fitted in full "
             "added (the default until 2026-12-07; today's default applies half of it).", ""]
    cases = {c.name: c for c in cfg.shift_cases()}
    tables: dict[tuple[str, str], list[dict]] = {}
    for s in summaries:
        tables.setdefault((s["case"], s["test"]), []).append(s)
    for (case, test), rows in tables.items():
        c = cases.get(case)
        cal = c.calibrate if c is None or isinstance(c.calibrate, str) else "classes " + ", ".join(map(str, c.calibrate))
        n = rows[0]["n"]
        lines += [f"## {case}: {rows[0]['model']}, calibrated on {cal}, tested on {test} ({n} examples)", "",
                  "| method | row | bits | KL | agreement | accuracy | KL − no corrections | agreement − no corrections (points) |",
                  "|---|---|---|---|---|---|---|---|"]
        for s in rows:
            d = s.get("vs_no_corrections")
            lines.append(f"| {s['method']} | {s['row']} | {s['avg_bits']:.3f} | {s['kl_mean']:.5f} ± {s['kl_se']:.5f} | "
                         f"{s['agreement']:.2f} | {s['accuracy']:.2f} | {_interval(d and d['kl'], '+.5f')} | "
                         f"{_interval(d and d['agreement'], '+.2f')} |")
        default = next((s for s in rows if s["method"] == Method.BAYESQ.value and s["row"] == DEFAULT), None)
        if default is not None:
            for key, what in (("vs_gptq", "GPTQ's default"), ("vs_full_offset", "the offset fitted in full")):
                d = default.get(key)
                if d:
                    lines.append("")
                    lines.append(f"BayesQ's default − {what}: KL {_interval(d['kl'], '+.5f')}, agreement "
                                 f"{_interval(d['agreement'], '+.2f')} points, accuracy {_interval(d['accuracy'], '+.2f')} points.")
        lines.append("")
    return "\n".join(lines)


@flow(name="bayesq-shift", flow_run_name=flow_run_namer("shift"))
def shift_flow(params_path: Path, raw: Path, models: Path, out: Path, report: Path) -> list[dict]:
    """Every row of every case (cached tasks), then ``<out>/shift.json`` and ``report``."""
    params = read_params(params_path)
    cfg, seed, code = params.shift, params.seeds[0], code_version()
    if not cfg.cases:
        raise ValueError("shift.cases is empty: list at least one case in params.yaml, e.g. "
                         "{tweets-to-movie: {model: minilm-sentiment, calibrate: tweets, test: [movie]}}")
    records, fp_files, settings = [], {}, {}
    with mlflow_parent("bayesq-shift", "shift", params.profile, {}, params_path) as parent:
        write_run_file(Path(out), parent)
        for case in cfg.shift_cases():
            entry = get_entry(case.model)
            model_file = Path(models) / case.model / "model.safetensors"
            src = raw_path(entry, raw)
            mdig, sdig = digest(model_file), digest(src)
            fp_files[case.name] = fp_task(case, str(model_file), mdig, str(src), sdig, params, str(out), code)
            for method in cfg.methods:
                for label, over in ROWS[method]:
                    p = ablation_params(params, over, f"shift row {label}")
                    say(f"[shift] {case.name}: {method.value} ({label})")
                    for r in row_task(case, method.value, label, p, seed, str(model_file), mdig, str(src), sdig,
                                      str(out), code):
                        records.append(r)
                        settings[(case.name, method.value, r["row"])] = (over, p)
        summaries = summarise(records, fp_files)
        for r in records:  # one child run per row, its metrics on every test set
            over, p = settings[(r["case"], r["method"], r["row"])]
            metrics = {"avg_bits": r["avg_bits"], "quantize_seconds": r["seconds"]}
            for s in summaries:
                if (s["case"], s["method"], s["row"]) == (r["case"], r["method"], r["row"]):
                    metrics |= {f"{k}_{s['test']}": s[k] for k in ("kl_mean", "agreement", "accuracy")}
            mlflow_child(parent.info.run_id, f"{r['case']}/{r['method']}/{r['row']}",
                         {"case": r["case"], "model": r["model"], "row": r["row"], "seed": seed, "budget": cfg.budget,
                          **{f"override.{k}": str(v) for k, v in over.items()},
                          **row_params(p, Method(r["method"]), p.posterior, p.quant)},
                         metrics, {"profile": params.profile, "code_version": code}, seconds=r["seconds"])
    write_json(Path(out) / "shift.json", {"rows": summaries})
    Path(report).parent.mkdir(parents=True, exist_ok=True)
    Path(report).write_text(report_markdown(summaries, params))
    say(f"[shift] {len(records)} rows: {report}")
    return summaries


def main() -> None:
    p = parser("Calibrate on one part of the data, test on another: reports/shift.md")
    p.add_argument("--raw", type=Path, required=True)
    p.add_argument("--models", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--report", type=Path, required=True)
    a = p.parse_args()
    shift_flow(a.params, a.raw, a.models, a.out, a.report)


if __name__ == "__main__":
    main()
