#!/usr/bin/env bash
# Wall time of the embedded zoo (zoo.yaml), cold caches: one task at a time vs a 2-worker Dask
# LocalCluster. Each run gets its own empty Prefect result store, output folder and MLflow store
# under $1 (default /tmp/bayesq-zoo-timing), so neither reuses the other's (or the pipeline's) work;
# both write to the same output path (moved aside after each run), so their exports compare byte for byte.
#   bash benchmarks/zoo_wall_time.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-/tmp/bayesq-zoo-timing}
rm -rf "$DIR" && mkdir -p "$DIR"
for mode in serial dask; do
  args=(--workers 1); [ "$mode" = dask ] && args=(--dask local --workers 2)
  start=$(date +%s.%N)
  PREFECT_LOCAL_STORAGE_PATH="$DIR/$mode/prefect" MLFLOW_TRACKING_URI="sqlite:///$DIR/$mode/mlflow.db" \
    .venv/bin/bayesq zoo run --zoo zoo.yaml --out "$DIR/out" "${args[@]}" > "$DIR/$mode.log" 2>&1
  end=$(date +%s.%N)
  mv "$DIR/out" "$DIR/$mode/out"
  echo "$mode: $(echo "$end - $start" | bc) s (${args[*]})" | tee -a "$DIR/times.txt"
done
python3 - "$DIR" <<'PY'
import json, sys
d = sys.argv[1]
rows = {m: {(r["model"], r["budget"]): r for r in json.load(open(f"{d}/{m}/out/zoo_results.json"))["records"]} for m in ("serial", "dask")}
for key, s in sorted(rows["serial"].items()):
    k = rows["dask"][key]
    print(f"{key[0]:18s} {key[1]}: acc {s['accuracy']:.4f} / {k['accuracy']:.4f}, export sha256 "
          f"{'identical' if s['export']['sha256'] == k['export']['sha256'] else 'DIFFERENT'}")
PY
