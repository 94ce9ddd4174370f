#!/usr/bin/env bash
# Everything one short GPU session checks, in one call (the kernels, the exported models, the
# one-time cost on CUDA), each step bounded so the rest still runs:
#
#   bash benchmarks/gpu.sh [OUT]          # OUT: where the logs go (default: reports/gpu)
#
# On a GPU machine with PyTorch and Triton but without this project's installed packages: run
# benchmarks/gpu_site.sh here first, take .gpu along, and run there with PYTHONPATH=$PWD/.gpu/site.
#
# 1. correctness: the kernel and export tests with compiled Triton on the GPU, autotuning off
#    (BAYESQ_AUTOTUNE=0: each kernel at its first tile; step 2 checks the tuned ones) (every bit-width,
#    mixed widths, LUT codebooks, every test shape, the benchmark's shapes) -> OUT/pytest.txt
# 2. speed: benchmarks/kernels.py -> OUT/kernels.json and reports/kernels.md (copied to OUT);
#    the exported embedded models from results/exports when the pipeline ran here, else each
#    embedded architecture with random weights (--random-weights)
# 3. one-time cost on CUDA: BayesQ's default against GPTQ's strongest variant, model and
#    inputs on the GPU (benchmarks/scale.py --device cuda; the embedded architectures at the
#    pipeline's input sizes and counts, random weights) -> OUT/scale.txt; failures' stderr
#    -> OUT/errors.txt
# The defaults (steps 1-3) fit one 10-minute device call: at most 100 + 190 + 100 + 150 s (measured on
# an H200 on 2026-11-30: step 1 took 104 s with 16 workers, steps 1-2 and the sweep 339 s in all).
# PYTHON (default python3) runs it; SIZES (default empty: none; e.g. resnet50,bert-base,gpt2,gpt2-medium)
# the model sizes of step 5; SWEEP=1 adds step 4: the units GEMVs over tile shapes at batch 1 and 4
# (kernels.py --sweep -> OUT/sweep.json, OUT/sweep.md); COST=0 skips step 3. PYTEST_S, KERNELS_S,
# SWEEP_S: the time limits of steps 1, 2 and 4 in seconds (100, 190, 150; PYTEST_S=0 / KERNELS_S=0 skip steps 1 / 2).
set -u
cd "$(dirname "$0")/.."
OUT=${1:-reports/gpu}
PY=${PYTHON:-python3}
SIZES=${SIZES-}
mkdir -p "$OUT" reports
unset TRITON_INTERPRET  # compiled kernels
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== $(date -u +%FT%TZ) device" | tee "$OUT/gpu.log"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee -a "$OUT/gpu.log"

if [ "${PYTEST_S:-100}" != 0 ]; then
    echo "== 1. kernel and export tests on CUDA" | tee -a "$OUT/gpu.log"
    # -o addopts= drops the project's -q, so -v names each test as it finishes (a run cut short
    # still says which failed); pytest-timeout, where installed, stops a test stuck for 90 s
    PER_TEST=$($PY -c "import pytest_timeout" 2>/dev/null && echo --timeout=90)
    BAYESQ_AUTOTUNE=0 timeout --kill-after=10 ${PYTEST_S:-100} $PY -m pytest -p no:cacheprovider -o addopts= -m "not ui" -n auto -v -rfE \
        --tb=short --durations=15 $PER_TEST tests/test_kernels.py tests/test_packing.py tests/test_export.py \
        > "$OUT/pytest.txt" 2>&1
    echo "pytest exit $?: $(grep -E "[0-9]+ (passed|failed)" "$OUT/pytest.txt" | tail -1); $(grep -c " PASSED " "$OUT/pytest.txt") passed and $(grep -c " FAILED " "$OUT/pytest.txt") failed so far" | tee -a "$OUT/gpu.log"
fi

if [ "${KERNELS_S:-190}" != 0 ]; then
    echo "== 2. kernel speed" | tee -a "$OUT/gpu.log"
    E2E=(--random-weights)
    [ -d results/exports ] && [ -d models ] && E2E=()
    timeout ${KERNELS_S:-190} $PY benchmarks/kernels.py --models lite0-fmnist minilm-sentiment "${E2E[@]}" \
        --out "$OUT/kernels.json" --report reports/kernels.md 2>&1 | grep -v "it/s\]" | tee -a "$OUT/gpu.log"
    cp reports/kernels.md "$OUT/" 2>/dev/null
fi

rm -rf "$OUT/errors" "$OUT/errors.txt"
scale() {  # timeout, scale.py arguments; failed children's stderr gathered in OUT/errors.txt
    timeout "$1" $PY benchmarks/scale.py --device cuda --limit-gib 0 --errors "$OUT/errors" "${@:2}" 2>&1 \
        | tee -a "$OUT/scale.txt" | tee -a "$OUT/gpu.log"
    for f in "$OUT"/errors/*; do [ -f "$f" ] && { echo "--- $f"; tail -60 "$f"; }; done >> "$OUT/errors.txt"
    rm -rf "$OUT/errors"
}
: > "$OUT/scale.txt"
if [ "${COST:-1}" = 1 ]; then
    echo "== 3. one-time cost on CUDA: the embedded architectures at the pipeline's sizes" | tee -a "$OUT/gpu.log"
    scale 100 --sizes lite0 --pixels 64 --calibration 500 --selection 2000 --timeout 45
    scale 150 --sizes minilm --tokens 64 --calibration 1000 --selection 2000 --timeout 70
fi
if [ -n "${SWEEP:-}" ]; then
    echo "== 4. GEMV tile sweep" | tee -a "$OUT/gpu.log"
    timeout ${SWEEP_S:-150} $PY benchmarks/kernels.py --sweep --out "$OUT/sweep.json" --report "$OUT/sweep.md" 2>&1 | tee -a "$OUT/gpu.log"
fi
if [ -n "$SIZES" ]; then
    echo "== 5. one-time cost on CUDA: $SIZES" | tee -a "$OUT/gpu.log"
    scale 600 --sizes "$SIZES" --timeout 240
fi
echo "== done $(date -u +%FT%TZ)" | tee -a "$OUT/gpu.log"
