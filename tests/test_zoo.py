"""Tests of bayesq.harness.models.zoo without pretrained weights or real data files."""

from __future__ import annotations

import gzip
import io
import struct
import tarfile
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bayesq.harness.data.fashion_mnist import FILES
from bayesq.harness.models import zoo
from bayesq.harness.models.config import DataConfig, FinetuneConfig
from bayesq.harness.models.zoo import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    MODEL_NAMES,
    Lite0FashionMNIST,
    MiniLMSentiment,
    Splits,
    ZooEntry,
    evaluate,
    get_entry,
    logits,
    register,
)

TINY_DATA = DataConfig(
    image_size=32,
    image_train_subset=6,
    image_test_subset=100,  # more than available: capped
    text_max_length=8,
    text_test_fraction=0.25,
    text_train_subset=100,
    text_test_subset=1,
)


def tiny_bert(num_labels: int = 2) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=64, num_labels=num_labels,
    )
    return BertForSequenceClassification(config).double().eval()


class LinearEntry(ZooEntry):
    """A float64 linear classifier on (N, 4) features, for registry/fine-tuning tests."""

    name = "linear-test"
    task = "image"
    default_raw = Path("/nonexistent")

    def build(self, pretrained: bool = True) -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(4, 2).double()

    def load_splits(self, data: DataConfig, raw: Path) -> Splits:
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(64, 4, generator=gen, dtype=torch.float64)
        y = (x[:, 0] > 0).to(torch.int64)
        return Splits(x[:48], y[:48], x[48:], y[48:])

    def batches(self, inputs: Any, batch_size: int, data: DataConfig) -> list[Any]:
        return [inputs[i:i + batch_size] for i in range(0, len(inputs), batch_size)]

    def learning_rate(self, cfg: FinetuneConfig) -> float:
        return cfg.lr_image


# ---------------------------------------------------------------- registry


def test_get_entry_builtin_names() -> None:
    assert MODEL_NAMES == ("lite0-fmnist", "minilm-sentiment", "resnet18-fmnist")
    assert get_entry("lite0-fmnist").task == "image"
    assert get_entry("minilm-sentiment").task == "text"


def test_get_entry_unknown_name_suggests_close_match() -> None:
    with pytest.raises(ValueError) as info:
        get_entry("lite0-fmist")
    msg = str(info.value)
    assert msg.startswith("unknown model 'lite0-fmist'")
    assert "did you mean 'lite0-fmnist'" in msg
    assert "known models: lite0-fmnist, minilm-sentiment, resnet18-fmnist" in msg


def test_register_adds_entry_and_rejects_duplicates() -> None:
    entry = LinearEntry()
    register(entry)
    try:
        assert get_entry("linear-test") is entry
        with pytest.raises(ValueError, match="already registered"):
            register(LinearEntry())
        register(LinearEntry(), replace=True)
        assert get_entry("linear-test") is not entry
    finally:
        zoo.unregister("linear-test")
    with pytest.raises(ValueError, match="unknown model"):
        get_entry("linear-test")


# ---------------------------------------------------------------- logits / evaluate / finetune


def test_logits_tensor_batch() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    torch.testing.assert_close(logits(model, x), model(x))


def test_logits_dict_batch_unwraps_hf_output() -> None:
    model = tiny_bert()
    batch = {
        "input_ids": torch.tensor([[101, 2204, 102], [101, 102, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        "token_type_ids": torch.zeros(2, 3, dtype=torch.int64),
    }
    out = logits(model, batch)
    assert out.shape == (2, 2) and out.dtype == torch.float64
    torch.testing.assert_close(out, model(**batch).logits)


def test_logits_object_with_logits_attribute() -> None:
    class Wrapped(nn.Module):
        def forward(self, x: torch.Tensor) -> SimpleNamespace:
            return SimpleNamespace(logits=2 * x)

    x = torch.ones(2, 3, dtype=torch.float64)
    torch.testing.assert_close(logits(Wrapped(), x), 2 * x)


def test_evaluate_accuracy_over_batches() -> None:
    model = nn.Identity()
    scores = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 1, 1])
    assert evaluate(model, [scores[:3], scores[3:]], labels) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="labels"):
        evaluate(model, [scores[:3]], labels)


def test_finetune_seeded_learns_and_ends_in_eval_mode() -> None:
    entry = LinearEntry()
    splits = entry.load_splits(TINY_DATA, entry.default_raw)
    cfg = FinetuneConfig(epochs=20, batch_size=8, lr_image=0.1, weight_decay=0.0, seed=3)
    before = evaluate(entry.build(), entry.batches(splits.test_inputs, 8, TINY_DATA), splits.test_labels)
    a = entry.finetune(entry.build(), splits, TINY_DATA, cfg)
    b = entry.finetune(entry.build(), splits, TINY_DATA, cfg)
    assert not a.training
    torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=0)
    after = evaluate(a, entry.batches(splits.test_inputs, 8, TINY_DATA), splits.test_labels)
    assert after >= 0.9 and after >= before


@pytest.mark.parametrize("threads", [1, 3])
def test_finetune_runs_on_configured_threads_and_restores_count(threads) -> None:
    entry = LinearEntry()
    splits = entry.load_splits(TINY_DATA, entry.default_raw)
    seen = []
    model = entry.build()
    model.register_forward_pre_hook(lambda mod, args: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    entry.finetune(model, splits, TINY_DATA, FinetuneConfig(epochs=1, batch_size=16, threads=threads))
    assert seen and set(seen) == {threads}
    assert torch.get_num_threads() == before
    seen.clear()
    entry.finetune(model, splits, TINY_DATA, FinetuneConfig(epochs=1, batch_size=16, threads=0))
    assert set(seen) == {before}  # 0: the count as set


class BackboneEntry(LinearEntry):
    """A float64 two-layer net whose second layer ``head`` is the new classifier."""

    name = "backbone-test"
    head = "head"

    def build(self, pretrained: bool = True) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(OrderedDict(body=nn.Sequential(nn.Linear(4, 8), nn.Tanh()),
                                         head=nn.Linear(8, 2))).double()


def test_finetune_frozen_backbone_trains_head_only() -> None:
    entry = BackboneEntry()
    splits = entry.load_splits(TINY_DATA, entry.default_raw)
    cfg = FinetuneConfig(frozen_backbone=("backbone-test",), head_epochs=30, batch_size=8, lr_image=0.05,
                         weight_decay=0.0)
    before = entry.build()
    model = entry.finetune(entry.build(), splits, TINY_DATA, cfg)
    assert not model.training
    for (name, a), b in zip(model.body.named_parameters(), before.body.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert not torch.equal(model.head.weight, before.head.weight)
    assert evaluate(model, entry.batches(splits.test_inputs, 8, TINY_DATA), splits.test_labels) >= 0.9


def test_finetune_frozen_backbone_vs_whole_model_steps() -> None:
    """Head steps on features computed once equal AdamW steps through the whole model with the
    backbone's parameters excluded from the optimiser, same shuffles."""
    entry = BackboneEntry()
    splits = entry.load_splits(TINY_DATA, entry.default_raw)
    cfg = FinetuneConfig(frozen_backbone=("backbone-test",), head_epochs=2, batch_size=8, lr_image=0.05, seed=4)
    fast = entry.finetune(entry.build(), splits, TINY_DATA, cfg)
    ref = entry.build().eval()
    opt = torch.optim.AdamW(ref.head.parameters(), lr=cfg.lr_image, weight_decay=cfg.weight_decay)
    n = len(splits.train_labels)
    for epoch in range(cfg.head_epochs):
        order = zoo.seeded_permutation(n, cfg.seed * 1000003 + epoch)
        for start in range(0, n, cfg.batch_size):
            idx = order[start:start + cfg.batch_size]
            loss = F.cross_entropy(ref(splits.train_inputs[idx]), splits.train_labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    for (name, a), b in zip(fast.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)


def test_finetune_frozen_backbone_of_scratch_entry_names_field() -> None:
    entry = BackboneEntry()
    entry.pretrained_backbone = False
    splits = entry.load_splits(TINY_DATA, entry.default_raw)
    with pytest.raises(ValueError, match="finetune.frozen_backbone lists 'backbone-test'.*random"):
        entry.finetune(entry.build(), splits, TINY_DATA, FinetuneConfig(frozen_backbone=("backbone-test",)))
    assert get_entry("resnet18-fmnist").pretrained_backbone is False


def test_head_inputs_head_called_twice_raises() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 2).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(x) + self.head(x)

    entry = BackboneEntry()
    with pytest.raises(ValueError, match="head 'head' must be called once per batch"):
        entry.head_inputs(Twice(), torch.zeros(3, 4, dtype=torch.float64), TINY_DATA, 2)


@pytest.mark.parametrize("value", ["lite0-fmnist", [1]])
def test_finetune_config_bad_frozen_backbone_names_field(value) -> None:
    with pytest.raises(ValueError, match="finetune.frozen_backbone"):
        FinetuneConfig(frozen_backbone=value)


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_finetune_config_bad_threads_names_field(value) -> None:
    with pytest.raises(ValueError, match="finetune.threads"):
        FinetuneConfig(threads=value)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_finetune_config_bad_length_groups_names_field(value) -> None:
    with pytest.raises(ValueError, match="finetune.length_groups"):
        FinetuneConfig(length_groups=value)


def test_minibatches_by_length_cover_each_input_once_with_less_padding() -> None:
    g = torch.Generator().manual_seed(0)
    n, bs = 1000, 32
    lengths = torch.randint(1, 200, (n,), generator=g) ** 2 // 200  # skewed, like sentence lengths
    order = torch.randperm(n, generator=g)
    plain = zoo.minibatches(order, bs)
    grouped = zoo.minibatches(order, bs, lengths, groups=10, seed=5)
    assert [b.tolist() for b in plain] == [b.tolist() for b in order.split(bs)]
    assert sorted(torch.cat(grouped).tolist()) == list(range(n)) and len(grouped) == len(plain)
    assert all(len(b) == bs for b in grouped[:-1] if len(b) != n % bs)
    padded = lambda batches: sum(len(b) * int(lengths[b].max()) for b in batches)  # noqa: E731
    assert padded(grouped) < 0.7 * padded(plain)
    for c, chunk in enumerate(order.split(10 * bs)):  # each batch: a length-sorted slice of one chunk
        inside = [b for b in grouped if set(b.tolist()) <= set(chunk.tolist())]
        assert sorted(torch.cat(inside).tolist()) == sorted(chunk.tolist())
        for b in inside:
            assert torch.equal(lengths[b], lengths[b].sort().values)
    again = zoo.minibatches(order, bs, lengths, groups=10, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(grouped, again))
    assert [b.tolist() for b in zoo.minibatches(order, bs, lengths, groups=0)] == [b.tolist() for b in plain]


# ---------------------------------------------------------------- image entry


def test_preprocess_images_shapes_and_normalisation() -> None:
    entry = Lite0FashionMNIST()
    images = torch.zeros(5, 28, 28, dtype=torch.uint8)
    images[0] = 255
    batches = entry.batches(images, 2, TINY_DATA)
    assert [tuple(b.shape) for b in batches] == [(2, 3, 32, 32), (2, 3, 32, 32), (1, 3, 32, 32)]
    assert all(b.dtype == torch.float32 for b in batches)
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float64)
    std = torch.tensor(IMAGENET_STD, dtype=torch.float64)
    white = batches[0][0].double().mean(dim=(1, 2))
    black = batches[0][1].double().mean(dim=(1, 2))
    torch.testing.assert_close(white, (1 - mean) / std, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(black, -mean / std, rtol=1e-5, atol=1e-5)


def test_lite0_build_random_init_has_10_class_head() -> None:
    model = Lite0FashionMNIST().build(pretrained=False)
    assert isinstance(model._fc, nn.Linear) and model._fc.out_features == 10
    assert not model.training
    with torch.no_grad():
        out = logits(model, torch.zeros(2, 3, 32, 32))
    assert out.shape == (2, 10)


def test_lite0_load_splits_seeded_subsets(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for key, shape in (("train_images", (10, 28, 28)), ("train_labels", (10,)),
                       ("test_images", (4, 28, 28)), ("test_labels", (4,))):
        arr = rng.integers(0, 10, shape, dtype=np.uint8)
        head = struct.pack(">HBB", 0, 8, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
        with gzip.open(tmp_path / FILES[key], "wb") as fh:
            fh.write(head + arr.tobytes())
    entry = Lite0FashionMNIST()
    splits = entry.load_splits(TINY_DATA, tmp_path)
    again = entry.load_splits(TINY_DATA, tmp_path)
    assert splits.train_inputs.shape == (6, 28, 28) and splits.train_inputs.dtype == torch.uint8
    assert splits.test_inputs.shape == (4, 28, 28)  # capped at the 4 available
    assert splits.train_labels.dtype == torch.int64
    assert torch.equal(splits.train_inputs, again.train_inputs)


# ---------------------------------------------------------------- text entry


def make_movie_archive(path: Path, lines: list[bytes]) -> Path:
    payload = b"\r\n".join(lines)
    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w:gz") as tar:
        info = tarfile.TarInfo("hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    with tarfile.open(path, "w:gz") as tar:
        data = inner.getvalue()
        info = tarfile.TarInfo("vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


def test_minilm_load_splits_drops_zeros_and_caps(tmp_path: Path) -> None:
    lines = [f"{i}\t{r}\tsentence {i}".encode() for i, r in enumerate([1, -1, 0, 2, -2, 0.5, 0, -0.5, 3])]
    archive = make_movie_archive(tmp_path / "v.tar.gz", lines)
    splits = MiniLMSentiment().load_splits(TINY_DATA, archive)
    assert len(splits.train_inputs) == 5 and len(splits.test_inputs) == 1  # 7 kept, 2 test -> cap 1
    assert set(splits.train_inputs).isdisjoint(splits.test_inputs)
    assert "sentence 2" not in splits.train_inputs + splits.test_inputs
    assert splits.train_labels.dtype == torch.int64


def test_minilm_batches_pad_longest_and_truncate() -> None:
    entry = MiniLMSentiment()
    texts = ["good", "a very long sentence that will surely be truncated here", "bad film"]
    batches = entry.batches(texts, 2, TINY_DATA)
    assert len(batches) == 2
    first, second = batches
    assert set(first) == {"input_ids", "attention_mask", "token_type_ids"}
    assert first["input_ids"].shape == (2, 8) and first["input_ids"].dtype == torch.int64
    assert first["attention_mask"][0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert second["input_ids"].shape == (1, 4)  # [CLS] bad film [SEP]: padded to its own longest
    assert entry.tokenizer is entry.tokenizer  # loaded once and cached
    out = logits(tiny_bert().float(), first)
    assert out.shape == (2, 2)
