"""Zoo entry for a real torchvision classifier on an ImageNet folder that a user has on disk.

``ResNet50ImageNet``: torchvision ResNet-50 (any torchvision classifier via ``arch``) on an
ImageNet folder in ``ImageFolder`` layout (``<root>/val/<wnid>/*.JPEG``, optional ``train/``);
sorted folder names are the label ids (for the 1000 WordNet ids: torchvision's class order).

Nothing is loaded or registered at import (torchvision and PIL are imported when used); see
``bayesq.harness.models.real.register_real``. ``DataConfig.image_*_subset`` cap the splits (seeded
subsets; set the test cap above the val size for official full-set numbers). Preprocessing
follows the entry's ``image_size`` / ``resize_size``, not ``DataConfig.image_size``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import Tensor, nn

from bayesq.harness.data.sentiment import seeded_permutation
from bayesq.harness.models.config import DataConfig, FinetuneConfig
from bayesq.harness.models.zoo import BUILD_SEED, IMAGENET_MEAN, IMAGENET_STD, Splits, ZooEntry

STATE_DICT_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".safetensors")


def _subset(pool: Tensor, cap: int, seed: int) -> Tensor:
    """First ``cap`` entries of a seeded permutation of ``pool`` (int64 (M,)), sorted ascending."""
    return pool[seeded_permutation(len(pool), seed)[:cap]].sort().values



# --------------------------------------------------------------------------- weights


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """``{name: Tensor}`` from ``.safetensors`` or a ``torch.save`` file (``weights_only=True``).

    ``{"model": sd}`` / ``{"state_dict": sd}`` wrappers are unwrapped, a DDP ``module.`` prefix
    stripped. Raises FileNotFoundError (no file) or ValueError (not a state dict).
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
    """``(full name, url, <torch hub dir>/checkpoints/<url file name>)`` of torchvision weights.

    ``name``: enum member (``"IMAGENET1K_V2"``, ``"DEFAULT"``) or full name
    (``"ResNet50_Weights.IMAGENET1K_V2"``) of ``arch``'s weights. Raises ValueError for an
    unknown arch or member, or weights of another architecture.
    """
    from torchvision.models import get_model_weights

    enum_cls = get_model_weights(arch)
    prefix, _, member = name.rpartition(".")
    if prefix and prefix != enum_cls.__name__:
        raise ValueError(f"weights {name!r} are not weights of {arch!r} ({enum_cls.__name__})")
    if member not in enum_cls.__members__:
        raise ValueError(f"unknown {enum_cls.__name__} member {member!r}; choices: {', '.join(enum_cls.__members__)}")
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
    return T.Compose([T.Resize(resize, interpolation=T.InterpolationMode.BILINEAR), T.CenterCrop(image_size),
                      T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


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

    def __getitem__(self, i: int) -> Tensor:
        i = i + len(self) if i < 0 else i
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
        msg = f"{root} is not an ImageFolder tree (one sub-folder of images per class): {err}"
        raise FileNotFoundError(msg) from err
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
        """The file ``build(pretrained=True)`` reads; FileNotFoundError (with the expected path and
        url) when named torchvision weights are not in the hub cache."""
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
                msg = f"{path} does not fit torchvision {self.arch} with {self.num_classes} classes: {err}"
                raise RuntimeError(msg) from err
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
                raise ValueError(f"{folder} has {len(classes)} class folders but the model has "
                                 f"{self.num_classes} outputs (num_classes)")
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

