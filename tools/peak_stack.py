"""Where a method's peak resident memory is reached: the main thread's stack at each new high.

A thread samples the process's RSS every 5 ms; whenever it passes the last reported level by
``--step`` GiB it prints the level and the innermost frames of the main thread (library frames
only), and at the end the deepest stack at the overall peak. The model and inputs are those of
``benchmarks/scale.py`` (random weights; ``--calibration`` calibration and as many selection inputs).

    python tools/peak_stack.py --size gpt2 --method gptq [--calibration 16] [--step 0.25]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="gpt2")
    ap.add_argument("--method", default="bayesq", help="bayesq (the library default) or a params.yaml method row")
    ap.add_argument("--calibration", type=int, default=16)
    ap.add_argument("--budget", type=float, default=3.0)
    ap.add_argument("--step", type=float, default=0.25, help="GiB between reported levels")
    a = ap.parse_args()
    import scale
    from flows.settings import apply_defaults

    apply_defaults()
    args = argparse.Namespace(size=a.size, calibration=a.calibration, selection=a.calibration, tokens=128,
                              pixels=224, device="cpu", threads=0)
    model, cal, sel = scale.setup(args)
    main_id, peak, stop = threading.main_thread().ident, [0.0, []], threading.Event()

    def stack() -> list[str]:
        frame = sys._current_frames().get(main_id)
        return [f"{Path(f.f_code.co_filename).relative_to(ROOT)}:{line} {f.f_code.co_name}"
                for f, line in traceback.walk_stack(frame) if str(ROOT) in f.f_code.co_filename
                and ".venv" not in f.f_code.co_filename] if frame else []

    def sample() -> None:
        reported = 0.0
        while not stop.is_set():
            r = rss_gib()
            if r > peak[0]:
                peak[:] = r, stack()
                if r > reported + a.step:
                    reported = r
                    print(f"{r:6.2f} GiB  " + " <- ".join(peak[1][:4]), flush=True)
            time.sleep(0.005)

    from bayesq.config import BayesQConfig
    from bayesq.methods import Inputs, quantize_with
    from flows.configs import method_config
    from flows.params import read_params

    cfg = BayesQConfig() if a.method == "bayesq" else method_config(a.method, read_params(ROOT / "params.yaml"),
                                                                    a.budget, 0)[0]
    print(f"model and inputs: {rss_gib():.2f} GiB", flush=True)
    threading.Thread(target=sample, daemon=True).start()
    start = time.perf_counter()
    quantize_with(model, cfg, a.budget, Inputs(calibration=cal, selection=sel))
    stop.set()
    print(f"{time.perf_counter() - start:.1f} s; peak {peak[0]:.2f} GiB at:\n  " + "\n  ".join(peak[1]))


if __name__ == "__main__":
    main()
