"""Zoo entry for a real Hugging Face sequence classifier on a GLUE task that a user has on disk.

``BertGLUE``: a Hugging Face sequence classifier (local directory or cached hub id) on one GLUE
task read from the official TSVs, evaluated on dev with the official metrics (``bayesq.metrics``).

Nothing is loaded or registered at import (transformers is imported when used); see
``bayesq.harness.models.real.register_real``. ``DataConfig.text_*_subset`` cap the splits (seeded
subsets; set the test cap above the dev size for official full-set numbers). Tokenization
follows the entry's ``max_length``, not ``DataConfig.text_max_length``.
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from bayesq.harness.data.sentiment import seeded_permutation
from bayesq.evaluation import predict
from bayesq.metrics import glue_metrics, glue_task
from bayesq.harness.models.config import DataConfig, FinetuneConfig
from bayesq.harness.models.zoo import BUILD_SEED, Splits, ZooEntry

log = logging.getLogger(__name__)


def _subset(pool: Tensor, cap: int, seed: int) -> Tensor:
    """First ``cap`` entries of a seeded permutation of ``pool`` (int64 (M,)), sorted ascending."""
    return pool[seeded_permutation(len(pool), seed)[:cap]].sort().values


def predictions(model: nn.Module, batches: Sequence[Any]) -> Tensor:
    """Arg-max class ids, int64 (N,), of ``model`` over ``batches`` in order
    (:func:`bayesq.evaluation.predict`: eval mode, no grad, an error on no batches)."""
    return predict(model, batches).argmax(dim=-1)


# --------------------------------------------------------------------------- GLUE


@dataclass(frozen=True)
class GlueTaskSpec:
    """Where a GLUE task's TSVs live and how to read them; ``labels[k]`` has label id ``k``."""

    folder: str
    train: str
    dev: str
    text_columns: tuple[str, ...]
    label_column: str
    labels: tuple[str, ...]


_NLI = ("sentence1", "sentence2"), "gold_label", ("entailment", "neutral", "contradiction")

#: Official GLUE TSV layout; label ids follow the Hugging Face GLUE convention.
GLUE_SPECS: dict[str, GlueTaskSpec] = {
    "sst2": GlueTaskSpec("SST-2", "train.tsv", "dev.tsv", ("sentence",), "label", ("0", "1")),
    "qnli": GlueTaskSpec("QNLI", "train.tsv", "dev.tsv", ("question", "sentence"), "label",
                         ("entailment", "not_entailment")),
    "qqp": GlueTaskSpec("QQP", "train.tsv", "dev.tsv", ("question1", "question2"), "is_duplicate", ("0", "1")),
    "mnli-m": GlueTaskSpec("MNLI", "train.tsv", "dev_matched.tsv", *_NLI),
    "mnli-mm": GlueTaskSpec("MNLI", "train.tsv", "dev_mismatched.tsv", *_NLI),
}


def read_glue_tsv(
    path: Path, text_columns: Sequence[str], label_column: str, labels: Sequence[str]
) -> tuple[list[Any], Tensor, int]:
    """Read one official GLUE TSV (tab-separated, ``csv.QUOTE_NONE``, header row, UTF-8).

    Columns are found by name in the header; rows with another number of fields than the
    header are skipped and counted (QQP's train.tsv has some); blank lines are ignored.

    Returns:
        ``(inputs, label ids int64 (N,), skipped rows)``; ``inputs``: ``list[str]`` for one text
        column, ``list[tuple[str, str]]`` for a pair; label id ``k`` = ``labels[k]``.

    Raises:
        FileNotFoundError naming the expected path; ValueError for missing columns, an empty
        file, a label not in ``labels`` (with file and line) or no readable row.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GLUE file not found: expected {path}")
    ids = {name: k for k, name in enumerate(labels)}
    inputs: list[Any] = []
    label_ids: list[int] = []
    skipped = 0
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, None)
        if not header:
            raise ValueError(f"{path}: empty file (expected a header row)")
        header = [h.strip().lstrip("\ufeff") for h in header]
        missing = [c for c in (*text_columns, label_column) if c not in header]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing}; the header has {header}")
        cols = [header.index(c) for c in text_columns]
        lab = header.index(label_column)
        for row in reader:
            if not row:
                continue
            if len(row) != len(header):
                skipped += 1
                continue
            value = row[lab].strip()
            if value not in ids:
                raise ValueError(f"{path}, line {reader.line_num}: label {value!r} in column "
                                 f"{label_column!r} is not one of {list(labels)}")
            texts = tuple(row[c] for c in cols)
            inputs.append(texts[0] if len(texts) == 1 else texts)
            label_ids.append(ids[value])
    if not inputs:
        raise ValueError(f"{path}: no readable rows ({skipped} malformed)")
    if skipped:
        log.warning("%s: skipped %d malformed rows", path, skipped)
    return inputs, torch.tensor(label_ids, dtype=torch.int64), skipped


class BertGLUE(ZooEntry):
    """A Hugging Face sequence classifier (e.g. BERT) on one GLUE task, evaluated on dev.

    Args:
        model: local checkpoint directory, or a hub id present in the local HF cache.
        glue_dir: folder holding the official GLUE task folders; the entry's ``default_raw``.
        task: one of ``"mnli-m"``, ``"mnli-mm"``, ``"qnli"``, ``"qqp"``, ``"sst2"``.
        name: registry name (default ``"bert-<task>"``).
        max_length: tokens per example (pairs truncated longest-first).

    Label ids follow the HF GLUE convention (``GLUE_SPECS``); a checkpoint whose ``id2label``
    names the same labels in another order is refused rather than silently mis-scored.
    """

    task = "text"

    def __init__(
        self, model: str | Path, glue_dir: Path, task: str, name: str | None = None,
        max_length: int = 128,
    ) -> None:
        if max_length < 2:
            raise ValueError(f"max_length = {max_length} must be >= 2")
        self.glue_task = glue_task(task)
        self.spec = GLUE_SPECS[self.glue_task]
        self.checkpoint = str(model)
        self.default_raw = Path(glue_dir)
        self.name = name or f"bert-{self.glue_task}"
        self.max_length = max_length
        self.num_labels = len(self.spec.labels)
        #: rows skipped as malformed, per TSV file read
        self.skipped_rows: dict[str, int] = {}
        self._tokenizer: Any = None
        self._tables: dict[Path, tuple[list[Any], Tensor]] = {}

    def _hf(self, loader: Any, what: str, **kwargs: Any) -> Any:
        """``loader.from_pretrained(checkpoint)``; a missing model becomes FileNotFoundError."""
        try:
            return loader.from_pretrained(self.checkpoint, **kwargs)
        except OSError as err:
            raise FileNotFoundError(f"{what} {self.checkpoint!r}: not a local checkpoint directory and not "
                                    f"in the Hugging Face cache (offline): {err}") from err

    def config(self) -> Any:
        """The checkpoint's config with ``num_labels`` of the task; checks the label set.

        Raises:
            ValueError: a classification checkpoint with another number of labels, or with the
                task's label names in another order.
        """
        from transformers import AutoConfig

        config = self._hf(AutoConfig, "model config")
        is_classifier = any(a.endswith("ForSequenceClassification") for a in config.architectures or ())
        if is_classifier and config.num_labels != self.num_labels:
            raise ValueError(f"{self.checkpoint}: classifier with {config.num_labels} labels, but GLUE "
                             f"{self.glue_task} has {self.num_labels} {list(self.spec.labels)}")
        if not is_classifier:
            config.num_labels = self.num_labels
        names = [str(config.id2label.get(k, config.id2label.get(str(k), ""))).lower()
                 for k in range(self.num_labels)]
        if set(names) == set(self.spec.labels) and names != list(self.spec.labels):
            raise ValueError(f"{self.checkpoint}: label order {names} differs from the GLUE convention "
                             f"{list(self.spec.labels)} used for the labels")
        return config

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer, loaded once per entry."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = self._hf(AutoTokenizer, "tokenizer")
        return self._tokenizer

    def build(self, pretrained: bool = True) -> nn.Module:
        """``AutoModelForSequenceClassification`` with the task's labels, eval mode.

        ``pretrained=False``: same config, seeded random init. A checkpoint without a
        classification head gets a new (seeded) one, with a warning. Raises RuntimeError when
        any other weight is missing or has a mismatched shape.
        """
        from transformers import AutoModelForSequenceClassification as Auto
        from transformers.utils import logging as hf_logging

        config = self.config()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(BUILD_SEED)
            if not pretrained:
                return Auto.from_config(config).eval()
            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()
            try:
                model, info = self._hf(Auto, "model", config=config, output_loading_info=True)
            finally:
                hf_logging.set_verbosity(verbosity)
        missing = set(map(str, info.get("missing_keys", ())))
        head = {k for k in missing if k.startswith(("classifier.", "score."))}
        bad = (missing - head) | set(map(str, info.get("mismatched_keys", ())))
        if bad or info.get("error_msgs"):
            raise RuntimeError(f"{self.checkpoint}: checkpoint does not fit its config: {sorted(bad)} "
                               f"{info.get('error_msgs') or ''}")
        if head:
            log.warning("%s: no classification head; %s newly initialised", self.checkpoint, sorted(head))
        return model.eval()

    def read(self, raw: Path, file: str) -> tuple[list[Any], Tensor]:
        """``read_glue_tsv`` of ``<raw>/<task folder>/<file>``, cached; records ``skipped_rows``."""
        path = Path(raw) / self.spec.folder / file
        if path not in self._tables:
            spec = self.spec
            inputs, labels, skipped = read_glue_tsv(path, spec.text_columns, spec.label_column, spec.labels)
            self.skipped_rows[str(path)] = skipped
            self._tables[path] = (inputs, labels)
        return self._tables[path]

    def load_splits(self, data: DataConfig, raw: Path) -> Splits:
        """Train = ``train.tsv`` (calibration / fine-tuning), test = the task's dev TSV.

        Seeded subsets (``data.split_seed``) capped at ``text_train_subset`` /
        ``text_test_subset``; the test part is ordered by text length (less padding per batch).
        Inputs: ``list[str]`` (SST-2) or ``list[tuple[str, str]]`` (pairs).
        """
        train_x, train_y = self.read(raw, self.spec.train)
        dev_x, dev_y = self.read(raw, self.spec.dev)
        train_idx = _subset(torch.arange(len(train_y)), data.text_train_subset, data.split_seed)
        test_idx = _subset(torch.arange(len(dev_y)), data.text_test_subset, data.split_seed)

        def length(x: Any) -> int:
            return len(x) if isinstance(x, str) else sum(map(len, x))

        order = torch.tensor([length(dev_x[i]) for i in test_idx.tolist()]).argsort(stable=True)
        test_idx = test_idx[order]
        return Splits(
            [train_x[i] for i in train_idx.tolist()], train_y[train_idx],
            [dev_x[i] for i in test_idx.tolist()], dev_y[test_idx],
        )

    def batches(self, inputs: Sequence[Any], batch_size: int, data: DataConfig) -> list[dict[str, Tensor]]:
        """Tokenize into dicts of int64 (B, L) ``input_ids`` / ``attention_mask`` /
        ``token_type_ids``, padded to the batch's longest, at most ``max_length`` tokens."""
        out = []
        for i in range(0, len(inputs), batch_size):
            chunk = list(inputs[i:i + batch_size])
            pairs = not isinstance(chunk[0], str)
            args = ([p[0] for p in chunk], [p[1] for p in chunk]) if pairs else (chunk,)
            enc = self.tokenizer(
                *args, padding="longest", truncation=True, max_length=self.max_length,
                return_tensors="pt", return_token_type_ids=True, return_attention_mask=True,
            )
            out.append({k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc})
        return out

    def metrics(self, model: nn.Module, batches: Sequence[Any], labels: Tensor) -> dict[str, float]:
        """The official GLUE metrics of ``model`` on ``batches`` (``glue_metrics``)."""
        return glue_metrics(self.glue_task, predictions(model, batches), labels)

    def learning_rate(self, cfg: FinetuneConfig) -> float:
        return cfg.lr_text

