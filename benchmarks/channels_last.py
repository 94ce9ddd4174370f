"""Forward passes of an embedded image model in the default (contiguous) and channels-last layout,
side by side in one process: wall seconds, their ratio and the largest logit difference.

    python benchmarks/channels_last.py [--models lite0-fmnist] [--images 512] [--threads 1]

``flows.finetune.load_model`` loads image models channels-last (``ZooEntry.memory_format``) for
quantising and evaluating; this prints why. Needs ``models/`` and ``data/raw`` from ``make run``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def timed_logits(model, batches, repeats: int = 3) -> tuple[float, torch.Tensor]:
    """(best wall seconds of ``repeats`` passes over ``batches``, the concatenated logits)."""
    best, out = float("inf"), None
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            out = torch.cat([model(b) for b in batches])
            best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    from flows.settings import apply_defaults

    apply_defaults()  # the pipeline's environment, before Prefect / Hugging Face are imported
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="lite0-fmnist")
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    a = ap.parse_args()
    from bayesq.harness.models.zoo import get_entry
    from flows.common import read_params
    from flows.finetune import load_model, raw_path

    torch.set_num_threads(a.threads)
    params = read_params(a.params)
    for name in a.models.split(","):
        entry = get_entry(name)
        splits = entry.load_splits(params.data, raw_path(entry, Path("data/raw")))
        batches = entry.batches(splits.test_inputs[: a.images], 64, params.data)
        model = load_model(entry, Path("models") / name / "model.safetensors")
        plain, y0 = timed_logits(model.to(memory_format=torch.contiguous_format), batches)
        last, y1 = timed_logits(model.to(memory_format=torch.channels_last), batches)
        print(f"{name}, {a.images} images, {a.threads} thread(s): contiguous {plain:.2f} s, channels-last "
              f"{last:.2f} s, ratio {plain / last:.2f}; largest logit difference {float((y0 - y1).abs().max()):.1e}")


if __name__ == "__main__":
    main()
