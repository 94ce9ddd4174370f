"""DVC stage `deploy`: the embedded models as ONNX Runtime files, next to ONNX Runtime's own quantisers.

    python -m flows deploy --params params.yaml --raw data/raw --models models --out results-deploy \\
                           --report reports/deploy.md

For each model of ``deploy.models`` (``params.yaml``), in ONNX Runtime's format (``MatMulNBits``,
the ``onnxruntime`` target, :mod:`bayesq.targets`):

* the FP32 graph: the model's own ONNX export (:func:`bayesq.onnx_export.graph_of`);
* ONNX Runtime's own quantisers on it (``deploy.peers``: RTN, HQQ, GPTQ at a width and block,
  :mod:`bayesq.baselines.ort`), GPTQ reading the same calibration inputs as every other row;
* each method of ``deploy.methods`` (BayesQ, our GPTQ and AWQ) under the target at each of
  ``deploy.budgets``, and BayesQ again at each peer's true bits (the bits its ``MatMulNBits``
  tensors hold per weight), each written by :func:`bayesq.onnx_export.export_onnx`.

Every file runs in ONNX Runtime on the same test examples (at most ``deploy.test_examples`` of the
test split, a seeded subset) and is compared with the FP32 graph's outputs there
(:func:`bayesq.fidelity.score_examples`: KL, top-1 agreement, accuracy); BayesQ minus each peer
and minus our GPTQ and AWQ at the same budget is paired on those examples with 95 % intervals.
Latency: median of ``deploy.repeats`` calls at each of ``deploy.batches`` (test examples), ``deploy.threads`` threads,
every file of a model timed in one run next to its FP32 graph, in rounds (:func:`latencies`). Layers the format cannot hold
(convolutions) stay in floating point and are listed with their reason.

One cached Prefect task per file (the peers, each row); latency is measured afresh in every run.
Writes ``<out>/<model>/<row>.onnx``, ``<out>/examples/<model>/<row>.safetensors``,
``<out>/deploy.json`` and the report; every row is an MLflow child run with its file as an
artifact (a file over 8 MiB as ``export_ref.json``: DVC keeps its bytes, :func:`flows.tracking.log_export`).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from prefect import flow, task

from bayesq.baselines.ort import matmulnbits_bits, ort_quantize
from bayesq.comparison import paired_difference
from bayesq.fidelity import fidelity_report, score_examples
from bayesq.harness.data.sentiment import seeded_permutation
from bayesq.harness.models.zoo import get_entry
from bayesq.methods import Inputs
from bayesq.onnx_export import OnnxModel, graph_of, latencies as onnx_latencies
from bayesq.stage_cache import MemoryCache
from flows.byo import load_examples, save_examples
from flows.common import CACHE, code_version, digest, parser, read_params, write_json
from flows.configs import method_config
from flows.finetune import load_model, raw_path
from flows.labels import ci_text
from flows.lineage import export_lineage, input_lineage, row_metadata
from flows.prepare import calibration_batches, selection_batches
from flows.row import by_library, embedded_subject, run_row, targeted
from flows.stage_params import deploy_peer
from flows.tracking import flow_run_namer, log_export, mlflow_child, mlflow_parent, row_params, say, write_run_file

TARGET = "onnxruntime"
BATCH = 64  # test examples per scoring pass
TEST_SEED = 0  # the seeded subset of the test split every row is scored on


def row_label(method: str, budget: float) -> str:
    """``<method>-b<budget>`` (the budget to 4 decimals), e.g. ``bayesq-b3.0``, ``bayesq-b4.2882``."""
    return f"{method}-b{round(float(budget), 4)}"


def test_draw(entry, splits, params) -> tuple[list, torch.Tensor | None]:
    """(test batches, labels) of at most ``deploy.test_examples`` test examples: a seeded subset
    of the test split, in the split's order."""
    n = len(splits.test_labels)
    keep = seeded_permutation(n, TEST_SEED)[: params.deploy.test_examples].sort().values
    inputs = (splits.test_inputs[keep] if isinstance(splits.test_inputs, torch.Tensor)
              else [splits.test_inputs[i] for i in keep.tolist()])
    return list(entry.batches(inputs, BATCH, params.data)), splits.test_labels[keep]


def _setup(model: str, model_file: str, raw: str, params, seed: int):
    """(entry, FP model, splits, calibration indices, calibration batches) of ``model``."""
    entry = get_entry(model)
    net = load_model(entry, Path(model_file))
    splits = entry.load_splits(params.data, raw_path(entry, Path(raw)))
    idx, cal = calibration_batches(entry, splits, params.data, params.calibration, seed)
    return entry, net, splits, idx, list(cal)


class _Replay(torch.nn.Module):
    """The FP32 graph's outputs on the test draw (:func:`fp_outputs`), returned batch by batch in
    the order :func:`bayesq.fidelity.score_examples` reads them: the reference of every row of a
    model, computed once."""

    def __init__(self, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.outputs, self.at = outputs, 0

    def forward(self, *args, **kwargs) -> torch.Tensor:
        self.at += 1
        return self.outputs[self.at - 1]


_FP_OUTPUTS: dict[tuple[str, str], list[torch.Tensor]] = {}  # (FP32 file, its digest) -> outputs, within one run
_STAGES = MemoryCache(max_items=2)  # BayesQ's curvature pass of a model, shared by its rows' budgets in a run


def fp_outputs(fp_file: str, fp_digest: str, entry, splits, params) -> list[torch.Tensor]:
    """The FP32 graph's first output on each batch of the test draw, in ONNX Runtime (computed
    once per file and digest in a process)."""
    key = (fp_file, fp_digest)
    if key not in _FP_OUTPUTS:
        fp = OnnxModel(fp_file)
        _FP_OUTPUTS[key] = [fp(**b) if isinstance(b, dict) else fp(b) for b in test_draw(entry, splits, params)[0]]
    return _FP_OUTPUTS[key]


def _score(fp_file: str, fp_digest: str, path: Path, entry, splits, params, out: Path, model: str, row: str,
           quantized: OnnxModel | None = None) -> str:
    """Score the file at ``path`` (run as ``quantized`` when given) against the FP32 graph on the
    test draw; the per-example file."""
    batches, labels = test_draw(entry, splits, params)
    reference = _Replay(fp_outputs(fp_file, fp_digest, entry, splits, params))
    scores = score_examples(reference, quantized or OnnxModel(path), batches, labels, desc=f"{model} {row} in ONNX Runtime")
    return str(save_examples(path, scores, Path(out) / "examples" / model))


@task(cache_policy=CACHE, persist_result=True, task_run_name="deploy FP32 graph {model}")
def graph_task(model: str, model_file: str, model_digest: str, raw: str, raw_digest: str, params, seed: int,
               out: str, code: str) -> dict:
    """The model's FP32 ONNX graph: ``{file, bytes}``."""
    import onnx

    _, net, _, _, cal = _setup(model, model_file, raw, params, seed)
    path = Path(out) / model / "fp32.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(graph_of(net, cal[0]), str(path))
    return {"file": str(path), "bytes": path.stat().st_size}


@task(cache_policy=CACHE, persist_result=True, task_run_name="deploy {model} ort-{peer}")
def peer_task(model: str, peer: str, fp_file: str, fp_digest: str, model_file: str, model_digest: str, raw: str,
              raw_digest: str, params, seed: int, out: str, code: str) -> dict:
    """ONNX Runtime's quantiser ``peer`` on the FP32 graph, scored: the row's record."""
    p = deploy_peer(peer)
    entry, _, splits, _, cal = _setup(model, model_file, raw, params, seed)
    path = Path(out) / model / f"{p.name}.onnx"
    start = time.perf_counter()
    ort_quantize(fp_file, p, path, cal, params.deploy.accuracy_level)  # GPTQ: minutes, its own progress bar
    seconds = time.perf_counter() - start
    stored, weights = matmulnbits_bits(path)
    record = {"model": model, "row": p.name, "method": p.name, "kind": "peer", "file": str(path),
              "file_bytes": path.stat().st_size, "seconds": seconds, "weights": weights,
              "avg_bits": stored / weights if weights else None, "kept": {}}
    if not weights:  # nothing it could quantise: no row to compare
        record["skipped"] = ("ONNX Runtime's quantiser found no MatMul to quantise (its Gemm and Conv nodes stay in "
                             "floating point)")
        return record
    record["examples"] = _score(fp_file, fp_digest, path, entry, splits, params, Path(out), model, p.name)
    return record


@task(cache_policy=CACHE, persist_result=True, task_run_name="deploy {model} {method} b{budget}")
def row_task(model: str, method: str, budget: float, fp_file: str, fp_digest: str, model_file: str,
             model_digest: str, raw: str, raw_digest: str, params, seed: int, out: str, code: str) -> dict:
    """``method`` under the onnxruntime target at ``budget``, exported and scored: the row's record."""
    entry, net, splits, idx, cal = _setup(model, model_file, raw, params, seed)
    row = row_label(method, budget)
    path = Path(out) / model / f"{row}.onnx"
    cfg, quant = targeted(method_config(method, params, budget, seed), method, TARGET, path)
    src = raw_path(entry, Path(raw))  # the lineage as every export holds it (not keyed: a cache hit keeps the file's)
    meta = row_metadata(model, method, budget, seed, code, export_lineage(params),
                        input_lineage(model_file, str(src), raw_digest, None, idx))
    inputs = Inputs(calibration=cal, selection=selection_batches(entry, splits, params.data, params.calibration, seed),
                    exclude=tuple(params.excluded(model)), cache=_STAGES)
    score = lambda loaded, file: {"examples": _score(fp_file, fp_digest, file, entry, splits, params,  # noqa: E731
                                                     Path(out), model, row, loaded)}
    r = run_row(embedded_subject(entry, net, splits, params.data, score, f"[deploy] {model}", example=cal[0]),
                by_library(net, cfg, quant, budget, inputs, params.quant), method, budget, seed, path, meta,
                target=TARGET, accuracy_level=params.deploy.accuracy_level, say=say)
    e = r["export"]
    return {"model": model, "row": row, "method": method, "kind": "ours", "budget": budget, "file": str(path),
            "file_bytes": e["file_bytes"], "seconds": r["quantize_seconds"], "weights": e["weights"],
            "avg_bits": e["file_avg_bits"], "logit_diff": e["max_logit_diff"], "kept": {**r["unquantized"], **e["kept"]},
            "examples": r["examples"]}


def summarise(records: list[dict]) -> list[dict]:
    """Each scored row's KL / agreement / accuracy with 95 % intervals, and, for BayesQ, its
    paired differences: at each peer's bits minus that peer (``vs_peers``), at each budget minus
    each other method of ours at the same budget (``vs_ours``: GPTQ, AWQ); each ``{kl, agreement, accuracy}`` of
    ``{diff, ci_low, ci_high}`` (points for the last two)."""
    scores = {(r["model"], r["row"]): load_examples(Path(r["examples"])) for r in records if "examples" in r}
    out = []
    for r in records:
        s = dict(r)
        if "examples" in r:
            s["fidelity"] = fidelity_report(scores[r["model"], r["row"]]).as_dict()
        if r["method"] == "bayesq":
            mine = scores[r["model"], r["row"]]
            for other in records:
                if other["model"] != r["model"] or "examples" not in other:
                    continue
                at_its_bits = other["kind"] == "peer" and round(other["avg_bits"], 4) == round(r["budget"], 4)
                same_budget = (other["kind"] == "ours" and other["method"] != "bayesq"
                               and other["budget"] == r["budget"])
                if at_its_bits or same_budget:
                    key = "vs_peers" if at_its_bits else "vs_ours"
                    s.setdefault(key, {})[other["row"]] = _paired(mine, scores[other["model"], other["row"]])
        out.append(s)
    return out


def _paired(a, b) -> dict[str, dict[str, float]]:
    d = {"kl": paired_difference(a.kl, b.kl).as_dict(),
         "agreement": paired_difference(a.agree, b.agree, scale=100.0).as_dict()}
    if a.correct_q is not None and b.correct_q is not None:
        d["accuracy"] = paired_difference(a.correct_q, b.correct_q, scale=100.0).as_dict()
    return d


def latency_batches(entry, params, raw: str) -> dict[int, object]:
    """The batch each latency is timed on, for each ``b`` of ``deploy.batches``: ``b`` test
    examples drawn at random (seeded; a split sorted by length would give its shortest first)."""
    splits = entry.load_splits(params.data, raw_path(entry, Path(raw)))
    order = seeded_permutation(len(splits.test_labels), TEST_SEED)
    out = {}
    for b in params.deploy.batches:
        pick = order[:b]
        inputs = (splits.test_inputs[pick] if isinstance(splits.test_inputs, torch.Tensor)
                  else [splits.test_inputs[i] for i in pick.tolist()])
        out[b] = next(iter(entry.batches(inputs, b, params.data)))
    return out


ROUNDS = 3  # latency: each file timed in this many rounds over all files of a model, the median of the rounds


def latencies(model: str, files: dict[str, str], inputs: dict[int, object], params) -> dict[str, dict]:
    """Median latency (ms) of every file of ``model`` on each of ``inputs`` (batch size ->
    batch): ``{row: {batch: ms}}`` (``fp32`` included), timed in :data:`ROUNDS` rounds with one
    live session at a time (:func:`bayesq.onnx_export.latencies`)."""
    cfg = params.deploy
    out = onnx_latencies(files, inputs, cfg.threads, cfg.repeats, ROUNDS)
    for row, ms in out.items():
        say(f"[deploy] {model} {row}: " + ", ".join(f"batch {b} {v:.2f} ms" for b, v in ms.items()))
    return out


def shape_text(inputs: dict[int, object]) -> str:
    """What the latency batches hold, e.g. ``batch 1: (1, 23), batch 8: (8, 41)``."""
    def shape(x):
        return tuple((x["input_ids"] if isinstance(x, dict) else x).shape)

    return ", ".join(f"batch {b}: {shape(x)}" for b, x in inputs.items()) + " (test examples drawn at random)"


def report_markdown(rows: list[dict], speed: dict[str, dict], shapes: dict[str, str], fp_bytes: dict[str, int],
                    params) -> str:
    """``reports/deploy.md``: per model, every file's true bits, size, fidelity and latency against
    FP32; then BayesQ against each peer at its bits and against our GPTQ and AWQ, paired."""
    cfg = params.deploy
    lines = ["# Deployed in ONNX Runtime", "",
             f"Written by the `deploy` stage (`flows/deploy.py`). Every file is an ONNX graph whose quantised "
             f"layers are `MatMulNBits` nodes, run by ONNX Runtime on the CPU at accuracy level {cfg.accuracy_level} "
             f"and compared with the model's FP32 ONNX graph on the same {cfg.test_examples} test examples at most "
             "(KL(p_FP ‖ p_Q) in nats, top-1 agreement and accuracy in %, each with its 95 % interval). BayesQ, "
             "our GPTQ and AWQ quantise for the `onnxruntime` target (widths 2 / 4 / 8, float32 scales, every stored "
             "bit counted); ONNX Runtime's own quantisers (`ort-…`) run on the FP32 graph. Bits: what the file's "
             f"MatMulNBits tensors store per weight they hold. Latency: the median over {ROUNDS} rounds (each visiting "
             f"every file of the model) of the median of {cfg.repeats} calls, {cfg.threads} threads; ratio FP32 / "
             "file (above 1: faster). Differences are paired on the same examples; * marks an interval that "
             "excludes 0.", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        fp = speed.get(model, {}).get("fp32", {})
        lines += [f"## {model}", "", f"Latency inputs: {shapes.get(model, '')}.", "",
                  "| file | bits / weight | MB | KL | agreement % | accuracy % | "
                  + " | ".join(f"batch {b}: ms (× FP32)" for b in cfg.batches) + " |",
                  "|---|---|---|---|---|---|" + "---|" * len(cfg.batches)]
        fp_mb = fp_bytes[model] / 1e6
        fp_acc = next((r["fidelity"]["accuracy_fp"] for r in mine if r.get("fidelity", {}).get("accuracy_fp") is not None),
                      None)
        lines.append(f"| FP32 | 32 | {fp_mb:.2f} | – | – | {'–' if fp_acc is None else f'{100 * fp_acc:.2f}'} | "
                     + " | ".join(f"{fp.get(b, float('nan')):.2f}" for b in cfg.batches) + " |")
        for r in mine:
            f = r.get("fidelity")
            bits = "–" if r["avg_bits"] is None else f"{r['avg_bits']:.4f}"
            ms = speed.get(model, {}).get(r["row"], {})
            cells = " | ".join(f"{ms[b]:.2f} ({fp[b] / ms[b]:.2f}×)" if b in ms and b in fp else "–" for b in cfg.batches)
            if f is None:
                lines.append(f"| {r['row']} | {bits} | {r['file_bytes'] / 1e6:.2f} | {r.get('skipped', '–')} | | | {cells} |")
                continue
            acc = (f"{100 * f['accuracy_q']:.2f}" if f.get("accuracy_q") is not None else "–")
            lines.append(f"| {r['row']} | {bits} | {r['file_bytes'] / 1e6:.2f} | {f['kl']:.5f} [{f['kl_ci_low']:.5f}, "
                         f"{f['kl_ci_high']:.5f}] | {100 * f['agreement']:.2f} | {acc} | {cells} |")
        lines += ["", "BayesQ minus the other file, paired on the same test examples:", "",
                  "| BayesQ | against | KL | agreement (points) | accuracy (points) |", "|---|---|---|---|---|"]
        for r in mine:
            for key in ("vs_peers", "vs_ours"):
                for other, d in r.get(key, {}).items():
                    acc = ci_text(d["accuracy"], "+.2f") if "accuracy" in d else "–"
                    lines.append(f"| {r['row']} | {other} | {ci_text(d['kl'], '+.5f')} | "
                                 f"{ci_text(d['agreement'], '+.2f')} | {acc} |")
        kept: dict[str, list[str]] = {}
        for name, why in {k: v for r in mine for k, v in r.get("kept", {}).items()}.items():
            kept.setdefault(why, []).append(name)
        for why, names in kept.items():
            shown = ", ".join(f"`{n}`" for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            lines += ["", f"In floating point in our files, {len(names)} weight(s): {why}: {shown}."]
        lines.append("")
    return "\n".join(lines)


@flow(name="bayesq-deploy", flow_run_name=flow_run_namer("deploy"))
def deploy_flow(params_path: Path, raw: Path, models: Path, out: Path, report: Path) -> list[dict]:
    """Every file of every model (cached tasks), their latencies, then ``<out>/deploy.json`` and ``report``."""
    params = read_params(params_path)
    cfg, seed, code = params.deploy, params.seeds[0], code_version()
    records, speed, shapes, fp_bytes = [], {}, {}, {}
    with mlflow_parent("bayesq-deploy", "deploy", params.profile, {}, params_path) as parent:
        write_run_file(Path(out), parent)
        for model in cfg.models:
            entry = get_entry(model)
            model_file = Path(models) / model / "model.safetensors"
            src = raw_path(entry, raw)
            mdig, sdig = digest(model_file), digest(src)
            args = (str(model_file), mdig, str(raw), sdig, params, seed, str(out), code)  # raw: the folder
            say(f"[deploy] {model}: the FP32 graph")
            fp = graph_task(model, *args)
            fdig = digest(Path(fp["file"]))
            mine = []
            for peer in cfg.peers:
                say(f"[deploy] {model}: ONNX Runtime's {peer}")
                mine.append(peer_task(model, peer, fp["file"], fdig, *args))
            budgets = {m.value: list(cfg.budgets) for m in cfg.methods}
            if "bayesq" in budgets:  # BayesQ again at each peer's true bits
                budgets["bayesq"] += [round(r["avg_bits"], 4) for r in mine if r["avg_bits"]]
            for method, bs in budgets.items():
                for budget in dict.fromkeys(bs):
                    say(f"[deploy] {model}: {method} at {budget} bits for ONNX Runtime")
                    mine.append(row_task(model, method, float(budget), fp["file"], fdig, *args))
            fp_bytes[model] = fp["bytes"]
            records += mine
            inputs = latency_batches(entry, params, str(raw))
            speed[model] = latencies(model, {"fp32": fp["file"], **{r["row"]: r["file"] for r in mine}}, inputs, params)
            shapes[model] = shape_text(inputs)
        rows = summarise(records)
        for r in rows:
            f = r.get("fidelity", {})
            metrics = {k: v for k, v in {"avg_bits": r["avg_bits"], "file_bytes": r["file_bytes"], "kl": f.get("kl"),
                                         "agreement": f.get("agreement"), "accuracy": f.get("accuracy_q"),
                                         **{f"latency_ms_batch{b}": ms for b, ms in speed[r["model"]][r["row"]].items()}
                                         }.items() if v is not None}
            method = r["method"] if r["kind"] == "ours" else "ort"
            extra = row_params(params, method) if r["kind"] == "ours" else {"peer": r["row"]}
            mlflow_child(parent.info.run_id, f"{r['model']}/{r['row']}",
                         {"model": r["model"], "row": r["row"], "seed": seed, "target": TARGET,
                          "accuracy_level": cfg.accuracy_level, **extra},
                         metrics, {"profile": params.profile, "code_version": code}, seconds=r["seconds"],
                         artifacts=lambda client, run_id, path=r["file"]: log_export(client, run_id, Path(path)))
    write_json(Path(out) / "deploy.json", {"rows": rows, "latency_ms": speed, "fp32_bytes": fp_bytes})
    Path(report).parent.mkdir(parents=True, exist_ok=True)
    Path(report).write_text(report_markdown(rows, speed, shapes, fp_bytes, params))
    say(f"[deploy] {len(rows)} files: {report}")
    return rows


def main() -> None:
    p = parser("The embedded models in ONNX Runtime next to its own quantisers: reports/deploy.md")
    p.add_argument("--raw", type=Path, required=True)
    p.add_argument("--models", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--report", type=Path, required=True)
    a = p.parse_args()
    deploy_flow(a.params, a.raw, a.models, a.out, a.report)


if __name__ == "__main__":
    main()
