#!/usr/bin/env bash
# Wall time of the embedded zoo (zoo.yaml), cold caches, three ways:
#   serial          one task at a time, torch on all cores (--workers 1)
#   serial-1thread  one task at a time, one torch thread (--workers 1 --threads 1)
#   dask            a 2-worker Dask LocalCluster, one torch thread per worker (--dask local --workers 2)
# Each run gets its own empty Prefect result store and MLflow store under $1 (default
# /tmp/bayesq-zoo-timing), so none reuses another's (or the pipeline's) work; all write to the same
# output path (moved aside after each run), so their exports compare byte for byte. Exports record
# the torch thread count, and distillation's float reductions follow it: dask should match
# serial-1thread byte for byte.
#   bash benchmarks/zoo_wall_time.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-/tmp/bayesq-zoo-timing}
rm -rf "$DIR" && mkdir -p "$DIR"
for mode in serial serial-1thread dask; do
  case $mode in
    serial) args=(--workers 1) ;;
    serial-1thread) args=(--workers 1 --threads 1) ;;
    dask) args=(--dask local --workers 2) ;;
  esac
  start=$(date +%s.%N)
  PREFECT_LOCAL_STORAGE_PATH="$DIR/$mode/prefect" MLFLOW_TRACKING_URI="sqlite:///$DIR/$mode/mlflow.db" \
    .venv/bin/bayesq zoo run --zoo zoo.yaml --out "$DIR/out" "${args[@]}" > "$DIR/$mode.log" 2>&1
  end=$(date +%s.%N)
  mv "$DIR/out" "$DIR/$mode/out"
  echo "$mode: $(echo "$end - $start" | bc) s (${args[*]})" | tee -a "$DIR/times.txt"
done
.venv/bin/python - "$DIR" <<'PY'
import json, sys
d = sys.argv[1]
modes = ("serial", "serial-1thread", "dask")
rows = {m: {(r["model"], r["budget"]): r for r in json.load(open(f"{d}/{m}/out/zoo_results.json"))["records"]}
        for m in modes}
print(f"{'model':18s} budget  acc: {' / '.join(modes)}   dask export vs serial-1thread | vs serial (tensors)")
for key, s in sorted(rows["serial"].items()):
    one, k = rows["serial-1thread"][key], rows["dask"][key]
    same = "identical" if k["export"]["sha256"] == one["export"]["sha256"] else "DIFFERENT"
    tensors = "same" if k["export"]["content_sha256"] == s["export"]["content_sha256"] else "differ"
    print(f"{key[0]:18s} {key[1]:6}  {s['accuracy']:.4f} / {one['accuracy']:.4f} / {k['accuracy']:.4f}   "
          f"file {same} | tensors {tensors}")
PY
