"""Zoo entries for real checkpoints and data sets that a user has on disk.

``ResNet50ImageNet``
    torchvision ResNet-50 (any torchvision classifier via ``arch``) on an ImageNet folder in
    ``torchvision.datasets.ImageFolder`` layout (``<root>/val/<wnid>/*.JPEG``, optional
    ``<root>/train/``). Sorted folder names are the label ids, which for the 1000 WordNet ids
    is torchvision's class order.
``BertGLUE``
    a Hugging Face sequence classifier (local directory or cached hub id) on one GLUE task
    read from the official TSV files (``SST-2/``, ``QNLI/``, ``QQP/``, ``MNLI/`` under
    ``glue_dir``), evaluated on the dev set with the official metrics (``bayesq.metrics``).

Nothing is loaded at import time and nothing is registered: register the entries the pipeline
should know by name, in the process that runs it::

    from bayesq.models.real import register_real
    register_real(imagenet_root="/data/imagenet", resnet_weights="IMAGENET1K_V2",
                  glue_dir="/data/glue",
                  bert_models={"sst2": "/ckpt/bert-sst2", "mnli-m": "/ckpt/bert-mnli"})
    # -> ("resnet50-imagenet", "bert-sst2", "bert-mnli-m"); then get_entry("bert-sst2") ...

or build entries yourself and call ``bayesq.models.zoo.register(entry)``. The data sizes come
from ``DataConfig`` (``image_*_subset`` / ``text_*_subset`` cap the splits by a seeded
subset); set the test caps above the dev/val size for the official full-set numbers.
Preprocessing is the entry's own protocol: ``image_size`` / ``max_length`` of the entry are
used, ``DataConfig.image_size`` / ``text_max_length`` are not.
"""

from __future__ import annotations

import csv
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence
from urllib.parse import urlparse

import torch
from torch import Tensor, nn

from bayesq.config import DataConfig, FinetuneConfig
from bayesq.data.sentiment import seeded_permutation
from bayesq.forward import logits
from bayesq.metrics import glue_metrics, glue_task
from bayesq.models.zoo import (
    BUILD_SEED, IMAGENET_MEAN, IMAGENET_STD, Splits, ZooEntry, known_models, register,
)

log = logging.getLogger(__name__)

STATE_DICT_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".safetensors")


def _subset(pool: Tensor, cap: int, seed: int) -> Tensor:
    """First ``cap`` entries of a seeded permutation of ``pool`` (int64 (M,)), sorted ascending."""
    return pool[seeded_permutation(len(pool), seed)[:cap]].sort().values


def predictions(model: nn.Module, batches: Sequence[Any]) -> Tensor:
    """Arg-max class ids, int64 (N,), of ``model`` (eval mode, no grad) over ``batches`` in order."""
    model.eval()
    with torch.no_grad():
        out = [logits(model, b).argmax(dim=-1).cpu() for b in batches]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


# --------------------------------------------------------------------------- weights


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """A state dict from ``.safetensors`` or a ``torch.save`` file (``weights_only=True``).

    Checkpoints of training scripts that wrap it as ``{"model": sd}`` / ``{"state_dict": sd}``
    are unwrapped, and a DDP ``module.`` prefix is stripped.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file holds no mapping of names to tensors (or needs full unpickling).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state: Any = load_file(str(path))
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # pickle.UnpicklingError and friends
            raise ValueError(f"{path}: cannot be read as a state_dict with weights_only=True: {err}") from err
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not state or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"{path}: not a state_dict (a mapping of parameter names to tensors)")
    if all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return dict(state)


def torchvision_weights_file(arch: str, name: str) -> tuple[str, str, Path]:
    """Where torchvision keeps the weights ``name`` of ``arch`` in the torch hub cache.

    Args:
        arch: torchvision model name, e.g. ``"resnet50"``.
        name: enum member (``"IMAGENET1K_V2"``, ``"DEFAULT"``) or full name
            (``"ResNet50_Weights.IMAGENET1K_V2"``).

    Returns:
        ``(full name, download url, <torch hub dir>/checkpoints/<file name of the url>)``.

    Raises:
        ValueError: unknown arch, member, or weights of another architecture.
    """
    from torchvision.models import get_model_weights

    enum_cls = get_model_weights(arch)
    prefix, _, member = name.rpartition(".")
    if prefix and prefix != enum_cls.__name__:
        raise ValueError(f"weights {name!r} are not weights of {arch!r} ({enum_cls.__name__})")
    if member not in enum_cls.__members__:
        raise ValueError(
            f"unknown {enum_cls.__name__} member {member!r}; choices: {', '.join(enum_cls.__members__)}"
        )
    weights = enum_cls[member]
    filename = os.path.basename(urlparse(weights.url).path)
    return str(weights), weights.url, Path(torch.hub.get_dir()) / "checkpoints" / filename


def _is_path(weights: str | Path) -> bool:
    """Whether ``weights`` names a file (else: a torchvision weights enum member)."""
    if isinstance(weights, Path):
        return True
    p = Path(weights)
    return p.suffix.lower() in STATE_DICT_SUFFIXES or "/" in weights or os.sep in weights or p.exists()


# --------------------------------------------------------------------------- images


def imagenet_eval_transform(image_size: int = 224, resize_size: int | None = None) -> Any:
    """Standard ImageNet evaluation preprocessing (torchvision ``Compose``).

    PIL RGB image -> resize the shorter side to ``resize_size`` (default
    ``round(image_size * 256 / 224)``; bilinear, antialiased) -> center crop ``image_size`` ->
    float32 (3, S, S) in [0, 1] -> ``(x - mean) / std`` with the ImageNet mean/std.
    """
    from torchvision import transforms as T

    resize = resize_size if resize_size is not None else round(image_size * 256 / 224)
    return T.Compose([
        T.Resize(resize, interpolation=T.InterpolationMode.BILINEAR),
        T.CenterCrop(image_size),
        T.ToTensor(),
        T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])


def load_image(path: str | Path, transform: Any) -> Tensor:
    """Read one image file as RGB (PIL) and apply ``transform`` -> float32 (3, S, S)."""
    from PIL import Image

    with Image.open(path) as im:
        return transform(im.convert("RGB"))


class ImageBatches(Sequence):
    """Lazy batches of image files: batch ``i`` is read and preprocessed when indexed.

    ``len`` = ``ceil(N / batch_size)``; item ``i`` is float32 (B, 3, S, S) (last B shorter).
    Decoding runs in ``workers`` threads (order preserved). Lazy so that 50k ImageNet images
    never sit in memory at once (they would take 30 GB at 224 px).
    """

    def __init__(self, paths: Sequence[str], batch_size: int, transform: Any, workers: int = 1) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size = {batch_size} must be >= 1")
        self.paths = list(paths)
        self.batch_size = batch_size
        self.transform = transform
        self.workers = max(1, workers)

    def __len__(self) -> int:
        return math.ceil(len(self.paths) / self.batch_size)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"batch {i} out of range ({len(self)} batches)")
        chunk = self.paths[i * self.batch_size:(i + 1) * self.batch_size]
        if self.workers > 1 and len(chunk) > 1:
            with ThreadPoolExecutor(max_workers=min(self.workers, len(chunk))) as pool:
                images = list(pool.map(lambda p: load_image(p, self.transform), chunk))
        else:
            images = [load_image(p, self.transform) for p in chunk]
        return torch.stack(images)  # (B, 3, S, S)


def image_folder(root: Path) -> tuple[list[str], Tensor, list[str]]:
    """List an ImageFolder tree: ``(file paths, int64 (N,) labels, sorted class names)``.

    Label ``k`` is the ``k``-th class folder in sorted order; files are in sorted order within
    each class (``torchvision.datasets.folder.make_dataset``).
    """
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    try:
        classes, class_to_idx = find_classes(str(root))
        samples = make_dataset(str(root), class_to_idx, extensions=IMG_EXTENSIONS)
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"{root} is not an ImageFolder tree (one sub-folder of images per class): {err}"
        ) from err
    paths = [p for p, _ in samples]
    labels = torch.tensor([c for _, c in samples], dtype=torch.int64)
    return paths, labels, classes


def holdout_split(labels: Tensor, fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """Per-class seeded split of ``range(N)`` into (held-out, rest), both sorted int64.

    Class ``c`` with ``n_c`` items gives ``k_c = round(n_c * fraction)`` clipped to
    ``[1, n_c - 1]`` (0 if ``n_c = 1``) items to the held-out part, chosen by a permutation
    seeded with ``seed * 1000003 + c``. ImageNet val (50 per class), fraction 0.2: 10 per class.
    """
    held, rest = [], []
    for c in labels.unique().tolist():
        idx = (labels == c).nonzero().flatten()  # (n_c,)
        n_c = len(idx)
        k = min(max(round(n_c * fraction), 1), n_c - 1) if n_c > 1 else 0
        perm = seeded_permutation(n_c, seed * 1000003 + c)
        held.append(idx[perm[:k]])
        rest.append(idx[perm[k:]])
    empty = torch.zeros(0, dtype=torch.int64)
    return (torch.cat(held).sort().values if held else empty,
            torch.cat(rest).sort().values if rest else empty)


class ResNet50ImageNet(ZooEntry):
    """torchvision ResNet-50 on ImageNet (real weights and data from disk).

    Args:
        weights: a state-dict file (``.pth``/``.pt`` via ``torch.load(weights_only=True)``, or
            ``.safetensors``) or a torchvision weights name (``"IMAGENET1K_V2"``,
            ``"ResNet50_Weights.IMAGENET1K_V2"``; None = ``"DEFAULT"``), read from the torch
            hub cache (``$TORCH_HOME/hub/checkpoints``) without any download.
        imagenet_val: ImageNet root holding ``val/`` (and optionally ``train/``), or the
            ``val`` folder itself; the entry's ``default_raw``.
        name: registry name.
        image_size: center-crop size S; resize to ``resize_size`` (default ``S * 256 / 224``).
            NB: torchvision's reference recipe for ``IMAGENET1K_V2`` resizes to 232.
        arch: any torchvision classification model name (tests use ``"resnet18"``).
        num_classes: model outputs; must equal the number of class folders.
        holdout_fraction: without ``train/``, the calibration pool is this per-class fraction of
            val (``holdout_split``, seeded by ``DataConfig.split_seed``), and the evaluated
            part is the rest: deterministic and disjoint.
        workers: image decoding threads per batch.
    """

    task = "image"

    def __init__(
        self, weights: str | Path | None = None, imagenet_val: Path | None = None,
        name: str = "resnet50-imagenet", image_size: int = 224, arch: str = "resnet50",
        num_classes: int = 1000, resize_size: int | None = None, holdout_fraction: float = 0.2,
        workers: int = 8,
    ) -> None:
        if image_size < 1 or (resize_size is not None and resize_size < image_size):
            raise ValueError(f"image_size = {image_size}, resize_size = {resize_size}: need 1 <= S <= resize")
        if not 0 < holdout_fraction < 1:
            raise ValueError(f"holdout_fraction = {holdout_fraction} must be in (0, 1)")
        self.weights = weights
        self.default_raw = Path(imagenet_val) if imagenet_val is not None else Path("imagenet")
        self.name = name
        self.image_size = image_size
        self.resize_size = resize_size
        self.arch = arch
        self.num_classes = num_classes
        self.holdout_fraction = holdout_fraction
        self.workers = workers
        self._listings: dict[Path, tuple[list[str], Tensor, list[str]]] = {}

    def weights_path(self) -> Path:
        """The state-dict file that ``build(pretrained=True)`` reads.

        Raises:
            FileNotFoundError: a named torchvision weights file is not in the hub cache (the
                message gives the expected path and the download url).
        """
        weights = self.weights if self.weights is not None else "DEFAULT"
        if _is_path(weights):
            return Path(weights)
        full, url, path = torchvision_weights_file(self.arch, str(weights))
        if not path.is_file():
            raise FileNotFoundError(
                f"torchvision weights {full} are not in the torch hub cache: expected {path} "
                f"(download {url} to that path on a machine with network, or pass "
                f"weights=<path to a .pth/.safetensors state_dict>)"
            )
        return path

    def build(self, pretrained: bool = True) -> nn.Module:
        """torchvision ``arch`` with ``num_classes`` outputs, eval mode, float32.

        ``pretrained=False``: the architecture with its seeded (``BUILD_SEED``) random init.
        ``pretrained=True``: all of the checkpoint's tensors, loaded strictly.
        """
        from torchvision.models import get_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(BUILD_SEED)
            model = get_model(self.arch, weights=None, num_classes=self.num_classes)
        if pretrained:
            path = self.weights_path()
            state = read_state_dict(path)
            try:
                model.load_state_dict(state, strict=True)
            except RuntimeError as err:
                raise RuntimeError(
                    f"{path} does not fit torchvision {self.arch} with {self.num_classes} classes: {err}"
                ) from err
        return model.eval()

    def _folders(self, raw: Path) -> tuple[Path, Path | None]:
        """``(val folder, train folder or None)`` of an ImageNet root or val folder."""
        raw = Path(raw)
        if (raw / "val").is_dir():
            val, train = raw / "val", raw / "train"
        elif raw.name == "val" and raw.is_dir():
            val, train = raw, raw.parent / "train"
        else:
            raise FileNotFoundError(
                f"ImageNet validation folder not found: expected {raw / 'val'} "
                f"(ImageFolder layout: val/<class>/<image>, one folder per class)"
            )
        return val, (train if train.is_dir() else None)

    def _listing(self, folder: Path) -> tuple[list[str], Tensor, list[str]]:
        """``image_folder(folder)``, cached per entry (ImageNet train has 1.28M files)."""
        if folder not in self._listings:
            paths, labels, classes = image_folder(folder)
            if len(classes) != self.num_classes:
                raise ValueError(
                    f"{folder} has {len(classes)} class folders but the model has "
                    f"{self.num_classes} outputs (num_classes)"
                )
            self._listings[folder] = (paths, labels, classes)
        return self._listings[folder]

    def load_splits(self, data: DataConfig, raw: Path) -> Splits:
        """Image file paths (``list[str]``) and int64 labels; seeded, capped, sorted subsets.

        Test: ``val`` (without ``train/``: the part of val left after ``holdout_split``), at most
        ``data.image_test_subset`` images. Train (calibration pool): ``train/`` if present, else
        the held-out part of val, at most ``data.image_train_subset`` images. Subsets are the
        first indices of a permutation seeded with ``data.split_seed``, in file order.
        """
        val_dir, train_dir = self._folders(raw)
        val_paths, val_labels, classes = self._listing(val_dir)
        if train_dir is not None:
            train_paths, train_labels, train_classes = self._listing(train_dir)
            if train_classes != classes:
                raise ValueError(f"{train_dir} and {val_dir} have different class folders")
            train_pool = torch.arange(len(train_paths))
            test_pool = torch.arange(len(val_paths))
        else:
            train_paths, train_labels = val_paths, val_labels
            train_pool, test_pool = holdout_split(val_labels, self.holdout_fraction, data.split_seed)
        train_idx = _subset(train_pool, data.image_train_subset, data.split_seed)
        test_idx = _subset(test_pool, data.image_test_subset, data.split_seed)
        return Splits(
            [train_paths[i] for i in train_idx.tolist()], train_labels[train_idx],
            [val_paths[i] for i in test_idx.tolist()], val_labels[test_idx],
        )

    def batches(self, inputs: Sequence[str], batch_size: int, data: DataConfig) -> ImageBatches:
        """Image files -> lazy sequence of float32 (B, 3, S, S), ``imagenet_eval_transform``."""
        transform = imagenet_eval_transform(self.image_size, self.resize_size)
        return ImageBatches(inputs, batch_size, transform, self.workers)

    def learning_rate(self, cfg: FinetuneConfig) -> float:
        return cfg.lr_image


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


_MNLI_TEXT, _MNLI_LABELS = ("sentence1", "sentence2"), ("entailment", "neutral", "contradiction")

#: Official GLUE TSV layout; label ids follow the Hugging Face GLUE convention.
GLUE_SPECS: dict[str, GlueTaskSpec] = {
    "sst2": GlueTaskSpec("SST-2", "train.tsv", "dev.tsv", ("sentence",), "label", ("0", "1")),
    "qnli": GlueTaskSpec("QNLI", "train.tsv", "dev.tsv", ("question", "sentence"), "label",
                         ("entailment", "not_entailment")),
    "qqp": GlueTaskSpec("QQP", "train.tsv", "dev.tsv", ("question1", "question2"), "is_duplicate",
                        ("0", "1")),
    "mnli-m": GlueTaskSpec("MNLI", "train.tsv", "dev_matched.tsv", _MNLI_TEXT, "gold_label", _MNLI_LABELS),
    "mnli-mm": GlueTaskSpec("MNLI", "train.tsv", "dev_mismatched.tsv", _MNLI_TEXT, "gold_label",
                            _MNLI_LABELS),
}


def read_glue_tsv(
    path: Path, text_columns: Sequence[str], label_column: str, labels: Sequence[str]
) -> tuple[list[Any], Tensor, int]:
    """Read one official GLUE TSV (tab-separated, ``csv.QUOTE_NONE``, header row, UTF-8).

    Columns are found by name in the header. Rows with a different number of fields than the
    header are skipped and counted (QQP's train.tsv has some); blank lines are ignored.

    Returns:
        ``(inputs, label ids int64 (N,), number of skipped rows)``; ``inputs`` is ``list[str]``
        for one text column, ``list[tuple[str, str]]`` for a sentence pair.

    Raises:
        FileNotFoundError: naming the expected path. ValueError: missing columns, empty file,
        a label not in ``labels`` (with file and line), or no readable row.
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
                raise ValueError(
                    f"{path}, line {reader.line_num}: label {value!r} in column {label_column!r} "
                    f"is not one of {list(labels)}"
                )
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
            raise FileNotFoundError(
                f"{what} {self.checkpoint!r}: not a local checkpoint directory and not in the "
                f"Hugging Face cache (offline): {err}"
            ) from err

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
            raise ValueError(
                f"{self.checkpoint}: classifier with {config.num_labels} labels, but GLUE "
                f"{self.glue_task} has {self.num_labels} {list(self.spec.labels)}"
            )
        if not is_classifier:
            config.num_labels = self.num_labels
        names = [str(config.id2label.get(k, config.id2label.get(str(k), ""))).lower()
                 for k in range(self.num_labels)]
        if set(names) == set(self.spec.labels) and names != list(self.spec.labels):
            raise ValueError(
                f"{self.checkpoint}: label order {names} differs from the GLUE convention "
                f"{list(self.spec.labels)} used for the labels"
            )
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
            raise RuntimeError(
                f"{self.checkpoint}: checkpoint does not fit its config: {sorted(bad)} "
                f"{info.get('error_msgs') or ''}"
            )
        if head:
            log.warning("%s: no classification head; %s newly initialised", self.checkpoint, sorted(head))
        return model.eval()

    def tsv_path(self, raw: Path, split: str) -> Path:
        """``<raw>/<task folder>/<train or dev file>`` for ``split`` in ('train', 'dev')."""
        return Path(raw) / self.spec.folder / (self.spec.train if split == "train" else self.spec.dev)

    def read(self, path: Path) -> tuple[list[Any], Tensor]:
        """``read_glue_tsv`` of this task, cached per entry; records ``skipped_rows``."""
        path = Path(path)
        if path not in self._tables:
            inputs, labels, skipped = read_glue_tsv(
                path, self.spec.text_columns, self.spec.label_column, self.spec.labels
            )
            self.skipped_rows[str(path)] = skipped
            self._tables[path] = (inputs, labels)
        return self._tables[path]

    def load_splits(self, data: DataConfig, raw: Path) -> Splits:
        """Train = ``train.tsv`` (calibration / fine-tuning), test = the task's dev TSV.

        Seeded subsets (``data.split_seed``) capped at ``text_train_subset`` /
        ``text_test_subset``; the test part is ordered by text length (less padding per batch).
        Inputs: ``list[str]`` (SST-2) or ``list[tuple[str, str]]`` (pairs).
        """
        train_x, train_y = self.read(self.tsv_path(raw, "train"))
        dev_x, dev_y = self.read(self.tsv_path(raw, "dev"))
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


# --------------------------------------------------------------------------- registration


def register_real(
    *, imagenet_root: str | Path | None = None, resnet_weights: str | Path | None = None,
    glue_dir: str | Path | None = None, bert_models: Mapping[str, str | Path] | None = None,
    replace: bool = False,
) -> tuple[str, ...]:
    """Register the real entries in ``bayesq.models.zoo`` (this process only); returns names.

    ``imagenet_root`` or ``resnet_weights`` given: ``ResNet50ImageNet(resnet_weights,
    imagenet_root)`` as ``"resnet50-imagenet"``. ``bert_models``: GLUE task -> checkpoint, each
    as ``BertGLUE(checkpoint, glue_dir, task)`` named ``"bert-<task>"``. Every entry is
    constructed (and its task name checked) and every name checked before any is registered.

    Raises:
        ValueError: ``bert_models`` without ``glue_dir``, an unknown task, or a name already
            registered (unless ``replace``).
    """
    entries: list[ZooEntry] = []
    if imagenet_root is not None or resnet_weights is not None:
        entries.append(ResNet50ImageNet(resnet_weights, None if imagenet_root is None else Path(imagenet_root)))
    if bert_models:
        if glue_dir is None:
            raise ValueError("register_real: bert_models needs glue_dir (the GLUE data folder)")
        entries += [BertGLUE(m, Path(glue_dir), task) for task, m in bert_models.items()]
    taken = [e.name for e in entries if e.name in known_models()]
    if taken and not replace:
        raise ValueError(f"model(s) {taken} already registered (pass replace=True)")
    for entry in entries:
        register(entry, replace=replace)
    return tuple(e.name for e in entries)
