"""Shared setup of the benchmarks that evaluate one fine-tuned embedded model at one budget.

``case(description)`` parses ``--model --budget --seed --params --models --raw`` and loads what
``make run`` left behind: the fine-tuned model (``--models``, default ``models/``), its data
(``--raw``, default ``data/raw``), the seed's calibration batches (and its selection batches,
``Case.selection``) and the test batches.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Case:
    model_name: str
    budget: float
    seed: int
    params: Any  # flows.params.Params
    model: Any  # torch.nn.Module, eval mode
    calibration: list  # the seed's calibration batches (labels never used)
    test: list  # test batches
    labels: Any  # (N,) int64 test labels
    entry: Any = None  # bayesq.harness.models.zoo.ZooEntry
    splits: Any = None  # its data splits

    def draw(self, seed: int) -> list:
        """Another calibration-sized draw of training inputs (``seed`` in place of the case's)."""
        from flows.prepare import calibration_batches

        return list(calibration_batches(self.entry, self.splits, self.params.data, self.params.calibration, seed)[1])

    @property
    def selection(self) -> list | None:
        """The seed's selection batches (``calibration.selection: held-out``: a second draw, disjoint
        from the calibration draw, that scores choices among fitted candidates), else None."""
        from flows.prepare import selection_batches

        return selection_batches(self.entry, self.splits, self.params.data, self.params.calibration, self.seed)

    def accuracy(self, model) -> float:
        """Test accuracy of ``model`` in percent."""
        from bayesq.harness.models.zoo import evaluate

        return 100 * evaluate(model, self.test, self.labels)


def case(description: str) -> Case:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="lite0-fmnist")
    p.add_argument("--budget", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--params", type=Path, default=Path("params.yaml"))
    p.add_argument("--models", type=Path, default=Path("models"), help="folder of fine-tuned models")
    p.add_argument("--raw", type=Path, default=Path("data/raw"), help="folder of the raw data")
    a = p.parse_args()

    from flows.settings import apply_defaults

    apply_defaults()  # the pipeline's environment, before Prefect / Hugging Face are imported
    from bayesq.harness.models.zoo import get_entry
    from flows.common import read_params
    from flows.finetune import load_model, raw_path
    from flows.prepare import calibration_batches

    params = read_params(a.params)
    entry = get_entry(a.model)
    model = load_model(entry, a.models / a.model / "model.safetensors")
    splits = entry.load_splits(params.data, raw_path(entry, a.raw))
    _, batches = calibration_batches(entry, splits, params.data, params.calibration, a.seed)
    test = entry.batches(splits.test_inputs, 64, params.data)
    return Case(a.model, a.budget, a.seed, params, model, batches, test, splits.test_labels, entry, splits)
