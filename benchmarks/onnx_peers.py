"""BayesQ's ONNX Runtime file against ONNX Runtime's own weight-only quantisers, in the same format
(MatMulNBits), on the same FP graph and the same test examples, BayesQ at each peer's true bits.

For one model folder and data file (as `bayesq quantize --model ... --data ...` takes them): the
draws of :func:`flows.byo.prepare`; the FP32 graph is the model's own ONNX export
(:func:`bayesq.onnx_export.graph_of`); the peers are `onnxruntime.quantization.matmul_nbits_quantizer`
on it (:mod:`bayesq.baselines.ort`): RTN (its default algorithm) and HQQ at 2 bits with blocks of
64, at 4 bits with blocks of 128 and 64, and GPTQ at 4 bits, block 64 (`PEERS`), reading the same
calibration inputs. Each file's true
bits are the bytes of its MatMulNBits tensors over the weights they hold (the peers quantise the
MatMul layers; the FP graph's Gemm layers, a classifier's pooler and head, stay in float there,
while BayesQ quantises them too). BayesQ runs at each peer's true bits with `--target onnxruntime`
(the budget counts what its file stores, so its file holds at most that). Every file runs in ONNX
Runtime on the test draw (at `--accuracy-level`, default the library's) and is compared with the FP model (:func:`bayesq.fidelity.score_examples`);
printed: KL and accuracy with 95 % intervals, then BayesQ minus each peer, paired on the same examples.

    python benchmarks/onnx_peers.py --model ./minilm-sst --data reviews.parquet --text-column sentence \\
        --label-column label [--seed 17] [--peers rtn-4b-b128 hqq-4b-b128 ...] [--out /tmp/onnx-peers]

``--calibration-data other.parquet`` (the same columns): BayesQ and GPTQ calibrate (and BayesQ
selects its grids) on draws of that file instead, every file still scored on ``--data``'s test
draw: calibration data from another distribution than the one served, as users have it. (The
files' lineage then still names ``--data``'s draws.)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import onnx

from bayesq.baselines.ort import Peer, matmulnbits_bits, ort_quantize
from bayesq.comparison import paired_difference
from bayesq.fidelity import fidelity_report, score_examples
from bayesq.harness.data.files import DataSource
from bayesq.onnx_export import ACCURACY_LEVEL, OnnxModel, graph_of
from flows.byo import ByoModel, load_examples, prepare, run_row
from flows.common import read_params
from flows.settings import apply_defaults
from flows.stage_params import deploy_peer

ROOT = Path(__file__).resolve().parent.parent


PEERS = (Peer("rtn", 2, 64), Peer("hqq", 2, 64), Peer("rtn", 4, 128), Peer("rtn", 4, 64), Peer("hqq", 4, 128),
         Peer("hqq", 4, 64),
         # block 64: at 128, a row of K = 384 has 3 blocks, and ONNX Runtime 1.32 packs GPTQ zero-points
         # across rows when a row has an odd number of blocks (a reshape error)
         Peer("gptq", 4, 64))


def peers(chosen, fp: Path, calibration, out: Path, accuracy_level: int) -> dict[str, Path]:
    files = {}
    for peer in chosen:
        start = time.perf_counter()
        files[peer.name] = ort_quantize(fp, peer, out / f"{peer.name}.onnx", calibration, accuracy_level)
        print(f"{peer.name}: {time.perf_counter() - start:.0f} s", flush=True)
    return files


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--text-column", nargs="*", default=[])
    p.add_argument("--label-column", default="")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--accuracy-level", type=int, default=ACCURACY_LEVEL, help="of every file's MatMulNBits nodes")
    p.add_argument("--peers", nargs="+", default=[q.name.removeprefix("ort-") for q in PEERS],
                   help="ONNX Runtime's quantisers, <rtn|hqq|gptq>-<bits>b-b<block>")
    p.add_argument("--calibration-data", help="calibrate on this file's draws (same columns) instead of --data's")
    p.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="onnx-peers-")))
    a = p.parse_args()
    apply_defaults()
    import logging

    logging.getLogger("onnxruntime").setLevel(logging.WARNING)
    a.out.mkdir(parents=True, exist_ok=True)
    params = read_params(ROOT / "params.yaml")

    def source(path: str) -> DataSource:
        return DataSource(path, text_columns=tuple(a.text_column), label_column=a.label_column)

    prep = prepare(ByoModel("bench", a.model, source(a.data)), a.seed, say=lambda _: None)
    if a.calibration_data:
        other = prepare(ByoModel("bench-calibration", a.model, source(a.calibration_data)), a.seed, say=lambda _: None)
        prep = replace(prep, calibration=other.calibration, selection=other.selection)
    fp = a.out / "fp32.onnx"
    onnx.save(graph_of(prep.fp, prep.calibration[0]), str(fp))
    files = peers([deploy_peer(q) for q in a.peers], fp, prep.calibration, a.out, a.accuracy_level)
    scores, bits = {}, {}
    for name, path in files.items():
        stored, weights = matmulnbits_bits(path)
        bits[name] = stored / weights
        scores[name] = score_examples(prep.fp, OnnxModel(path), prep.test, prep.labels, desc=None)
    for budget in sorted({round(b, 4) for b in bits.values()}):
        name = f"bayesq-{budget}"
        r = run_row(prep, "bayesq", budget, params, a.seed, a.out / f"{name}.onnx", {}, "bench",
                    say=lambda _: None, target="onnxruntime", accuracy_level=a.accuracy_level)
        bits[name] = r["export"]["file_avg_bits"]
        scores[name] = load_examples(Path(r["examples_file"]))
        print(f"{name}: {r['quantize_seconds']:.0f} s", flush=True)
    print(f"\n{prep.spec.model}, {len(prep.draws.test)} test examples of {a.data} (seed {a.seed}), calibrated on "
          f"{a.calibration_data or a.data}; ONNX Runtime runs every file (accuracy level {a.accuracy_level})\n")
    print("| file | bits per weight (MatMulNBits) | KL to FP [95 %] | accuracy Q − FP (pts) |\n|---|---|---|---|")
    for name, s in scores.items():
        f = fidelity_report(s).as_dict()
        acc = (f"{f['accuracy_diff']:+.2f} [{f['accuracy_diff_ci_low']:+.2f}, {f['accuracy_diff_ci_high']:+.2f}]"
               if "accuracy_diff" in f else "-")
        print(f"| {name} | {bits[name]:.4f} | {f['kl']:.5f} [{f['kl_ci_low']:.5f}, {f['kl_ci_high']:.5f}] | {acc} |")
    print("\nBayesQ at a peer's bits minus the peer, paired (* resolved):\n")
    for name in files:
        ours = f"bayesq-{round(bits[name], 4)}"
        d = paired_difference(scores[ours].kl, scores[name].kl)
        star = "*" if d.ci_high < 0 or d.ci_low > 0 else ""
        line = f"{ours} - {name}: KL {d.diff:+.5f} [{d.ci_low:+.5f}, {d.ci_high:+.5f}]{star}"
        if scores[name].correct_q is not None:
            c = paired_difference(scores[ours].correct_q, scores[name].correct_q, scale=100.0)
            line += f", accuracy {c.diff:+.2f} [{c.ci_low:+.2f}, {c.ci_high:+.2f}] pts"
        print(line, flush=True)


if __name__ == "__main__":
    main()
