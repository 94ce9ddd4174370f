"""DVC stage `finetune`: fine-tune every embedded model and record its full-precision accuracy.

    python -m flows finetune --params params.yaml --raw data/raw --out models

Writes ``<out>/<model>/model.safetensors`` and ``<out>/<model>/fp.json``.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow, task

from bayesq.harness.models.zoo import evaluate, get_entry
from flows.common import CACHE, code_version, digest, parser, read_params, write_json


def raw_path(entry, raw: Path) -> Path:
    """Where an entry's raw data lives under the pipeline's raw-data folder."""
    return Path(raw) / entry.default_raw.name


def load_model(entry, path: Path):
    """The fine-tuned model of ``entry`` from its safetensors file, in ``entry.memory_format``
    (the same values; channels-last convolutions run faster on CPU)."""
    from safetensors.torch import load_model as _load

    model = entry.build(pretrained=False)
    _load(model, str(path))
    return model.to(memory_format=entry.memory_format).eval()


@task(cache_policy=CACHE, persist_result=True)
def finetune_one(name: str, raw: str, raw_digest: str, data, cfg, out: str, code: str) -> dict:
    """Fine-tune one model, save it, evaluate it in full precision; returns its FP metrics."""
    from safetensors.torch import save_model


    entry = get_entry(name)
    splits = entry.load_splits(data, Path(raw))
    start = time.perf_counter()
    model = entry.finetune(entry.build(pretrained=True), splits, data, cfg)
    seconds = time.perf_counter() - start
    folder = Path(out) / name
    folder.mkdir(parents=True, exist_ok=True)
    save_model(model, str(folder / "model.safetensors"))
    acc = evaluate(model, entry.batches(splits.test_inputs, 64, data), splits.test_labels)
    metrics = {"model": name, "fp_accuracy": acc, "finetune_seconds": seconds,
               "trained": "head" if name in cfg.frozen_backbone else "all",
               "n_train": len(splits.train_labels), "n_test": len(splits.test_labels)}
    write_json(folder / "fp.json", metrics)
    return metrics


@flow(name="bayesq-finetune")
def finetune_flow(params_path: Path, raw: Path, out: Path) -> list[dict]:

    params = read_params(params_path)
    for name in params.finetune.frozen_backbone:
        try:
            get_entry(name)
        except ValueError as err:
            raise ValueError(f"finetune.frozen_backbone: {err}") from None
    # the embedded entries' sources only: a new loader elsewhere in bayesq/harness/models retrains nothing
    code = code_version("bayesq/harness/models/zoo.py", "bayesq/harness/models/config.py", "bayesq/harness/data", "bayesq/forward.py",
                        "bayesq/evaluation.py", "flows/finetune.py",
                        exclude=("bayesq/harness/data/calibration.py",))  # sampling: not read by the fine-tune
    results = []
    for name in params.models:
        src = raw_path(get_entry(name), raw)
        m = finetune_one(name, str(src), digest(src), params.data, params.finetune, str(out), code)
        if not (Path(out) / name / "model.safetensors").exists():  # cache hit but file gone
            m = finetune_one.with_options(refresh_cache=True)(
                name, str(src), digest(src), params.data, params.finetune, str(out), code)
        print(f"[finetune] {name}: FP accuracy {m['fp_accuracy']:.4f}", flush=True)
        results.append(m)
    return results


def main() -> None:
    p = parser("Fine-tune the embedded models")
    p.add_argument("--raw", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    finetune_flow(a.params, a.raw, a.out)


if __name__ == "__main__":
    main()
