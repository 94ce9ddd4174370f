#!/usr/bin/env bash
# Does the pipeline land inside the committed intervals on another CPU? One machine, emulated.
#
# Re-runs the fine-tune and the bayesq / gptq / rtn-group rows of one model at 3.0 bits with every
# library that picks CPU kernels by instruction set switched to another code path (ATen's vector
# ISA, oneDNN's convolutions, MKL's BLAS: the switches of benchmarks/finetune_isa.py), in a fresh
# Prefect and MLflow store under DIR (nothing is reused from the pipeline's caches), then prints
# how far the fine-tuned weights moved and each paired comparison of this run next to the committed
# reports/paired.json and whether it lies inside the committed interval.
#   bash benchmarks/other_cpu.sh [MODEL] [DIR]      (default lite0-fmnist /tmp/bayesq-other-cpu)
# On a really different machine: PY=python3 SWITCH_ISA=0 bash benchmarks/other_cpu.sh (PY: a Python
# with the project's requirements; SWITCH_ISA=0 keeps that machine's own kernels).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-lite0-fmnist}
DIR=${2:-/tmp/bayesq-other-cpu}
PY=${PY:-.venv/bin/python}
rm -rf "$DIR" && mkdir -p "$DIR"
"$PY" - <<'PY'
import os, platform, torch
cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), platform.processor())
print(f"machine: {cpu}, {os.cpu_count()} CPUs; torch {torch.__version__}, {torch.get_num_threads()} threads, kernels {torch.backends.cpu.get_cpu_capability()}")
PY
"$PY" - "$MODEL" "$DIR" <<'PY'
import sys, yaml
model, out = sys.argv[1:]
p = yaml.safe_load(open("params.yaml"))
p.update(models=[model], methods=["bayesq", "gptq", "rtn-group"], budgets=[3.0])
yaml.safe_dump(p, open(f"{out}/params.yaml", "w"), sort_keys=False)
PY
if [ "${SWITCH_ISA:-1}" = 1 ]; then export ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=AVX MKL_CBWR=COMPATIBLE; fi
export PREFECT_HOME="$DIR/prefect" PREFECT_LOCAL_STORAGE_PATH="$DIR/prefect/results" MLFLOW_TRACKING_URI="sqlite:///$DIR/mlflow.db"
"$PY" -m flows finetune --params "$DIR/params.yaml" --raw data/raw --out "$DIR/models" > "$DIR/log.txt" 2>&1
"$PY" -m flows quantize --params "$DIR/params.yaml" --raw data/raw --models "$DIR/models" --out "$DIR/results" >> "$DIR/log.txt" 2>&1
"$PY" -m flows report --results "$DIR/results/results.json" --models "$DIR/models" --out "$DIR/reports" >> "$DIR/log.txt" 2>&1
unset ATEN_CPU_CAPABILITY ONEDNN_MAX_CPU_ISA MKL_CBWR
"$PY" - "$MODEL" "$DIR" <<'PY'
import json, sys
import torch
from safetensors.torch import load_file
model, out = sys.argv[1:]
a, b = load_file(f"models/{model}/model.safetensors"), load_file(f"{out}/models/{model}/model.safetensors")
diff = torch.cat([(a[k].double() - b[k].double()).flatten() for k in a])
ref = torch.cat([a[k].double().flatten() for k in a])
fp = [json.load(open(f"{d}/{model}/fp.json"))["fp_accuracy"] for d in ("models", f"{out}/models")]
print(f"{model} fine-tune, this run vs models/: relative L2 change {float(diff.norm() / ref.norm()):.2e}, "
      f"largest {float(diff.abs().max()):.1e}; FP accuracy {100 * fp[0]:.2f} % vs {100 * fp[1]:.2f} %")
key = lambda r: (r["model"], r["budget"], r["method"], r["baseline"], r["metric"])  # noqa: E731
committed = {key(r): r for r in json.load(open("reports/paired.json"))}
for r in json.load(open(f"{out}/reports/paired.json")):
    c = committed.get(key(r))
    if r["method"] != "bayesq" or c is None:
        continue
    inside = c["ci_low"] <= r["diff"] <= c["ci_high"]
    print(f"  {r['model']} {r['budget']} bits, {r['method']} - {r['baseline']} {r['metric']}: {r['diff']:+.5g} [{r['ci_low']:+.5g}, {r['ci_high']:+.5g}]"
          f"   committed {c['diff']:+.5g} [{c['ci_low']:+.5g}, {c['ci_high']:+.5g}]   "
          f"{'inside' if inside else 'OUTSIDE'} the committed interval")
PY
