"""bayesq.harness.models.imagenet on tiny checkpoints and images made in tmp_path (no network, no real files)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from bayesq.metrics import accuracy
from bayesq.harness.models.config import DataConfig
from bayesq.harness.models.imagenet import ResNet50ImageNet, holdout_split
from bayesq.harness.models.real import predictions
from bayesq.harness.models.zoo import IMAGENET_MEAN, IMAGENET_STD, evaluate

DATA = DataConfig(image_size=32, image_train_subset=1000, image_test_subset=1000,
                  text_train_subset=1000, text_test_subset=1000, split_seed=0)
CLASSES = ["n02", "n01", "n03"]  # created unsorted: label ids must follow the sorted order
PER_CLASS = 5


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


# --------------------------------------------------------------------------- ImageNet fixtures


def _write_images(folder: Path, per_class: int, seed: int) -> None:
    """Random RGB PNGs and grayscale JPEGs of varied sizes, ``folder/<class>/<i>.<ext>``."""
    rng = np.random.default_rng(seed)
    for c in CLASSES:
        (folder / c).mkdir(parents=True)
        for i in range(per_class):
            h, w = int(rng.integers(33, 60)), int(rng.integers(33, 60))
            if i % 2:
                Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8), "L").save(folder / c / f"{i}.JPEG")
            else:
                Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB").save(folder / c / f"{i}.png")
    (folder / CLASSES[0] / "notes.txt").write_text("not an image")


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("imagenet")
    val_only, with_train = base / "val_only", base / "with_train"
    _write_images(val_only / "val", PER_CLASS, seed=0)
    _write_images(with_train / "val", PER_CLASS, seed=1)
    _write_images(with_train / "train", 2, seed=2)
    return {"val_only": val_only, "with_train": with_train}


@pytest.fixture(scope="module")
def resnet_ckpt(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    import torchvision

    torch.manual_seed(123)
    state = torchvision.models.resnet18(num_classes=3).state_dict()
    path = tmp_path_factory.mktemp("ckpt") / "resnet18.pth"
    torch.save(state, path)
    return path, state


def _resnet(weights, **kw) -> ResNet50ImageNet:
    return ResNet50ImageNet(weights=weights, arch="resnet18", num_classes=3, image_size=32, **kw)


def _same_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> bool:
    got = model.state_dict()
    return got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)


# --------------------------------------------------------------------------- ResNet weights


def test_build_loads_exactly_the_saved_weights(resnet_ckpt):
    path, state = resnet_ckpt
    entry = _resnet(path)
    model = entry.build()
    assert _same_state(model, state) and not model.training
    fresh = entry.build(pretrained=False)
    assert not _same_state(fresh, state)
    assert _same_state(entry.build(pretrained=False), fresh.state_dict())  # seeded init


def test_build_from_safetensors_and_wrapped_checkpoint(resnet_ckpt, tmp_path):
    from safetensors.torch import save_file

    _, state = resnet_ckpt
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "w.safetensors"))
    assert _same_state(_resnet(str(tmp_path / "w.safetensors")).build(), state)
    torch.save({"model": {f"module.{k}": v for k, v in state.items()}, "epoch": 3}, tmp_path / "ckpt.pt")
    assert _same_state(_resnet(tmp_path / "ckpt.pt").build(), state)


def test_torchvision_weights_name_from_hub_cache(tmp_path, monkeypatch):
    import torchvision

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    expected = tmp_path / "torch" / "hub" / "checkpoints" / "squeezenet1_1-b8a52dc0.pth"
    entry = ResNet50ImageNet(weights="SqueezeNet1_1_Weights.IMAGENET1K_V1", arch="squeezenet1_1")
    with pytest.raises(FileNotFoundError, match=re.escape(str(expected)) + ".*pass weights="):
        entry.build()
    torch.manual_seed(7)
    state = torchvision.models.squeezenet1_1(num_classes=1000).state_dict()
    expected.parent.mkdir(parents=True)
    torch.save(state, expected)
    for name in ("SqueezeNet1_1_Weights.IMAGENET1K_V1", "IMAGENET1K_V1", "DEFAULT", None):
        assert ResNet50ImageNet(weights=name, arch="squeezenet1_1").weights_path() == expected
    assert _same_state(entry.build(), state)
    with pytest.raises(ValueError, match="not weights of 'squeezenet1_1'"):
        ResNet50ImageNet(weights="ResNet50_Weights.IMAGENET1K_V2", arch="squeezenet1_1").build()
    with pytest.raises(ValueError, match="choices: IMAGENET1K_V1, DEFAULT"):
        ResNet50ImageNet(weights="IMAGENET9K", arch="squeezenet1_1").build()


def test_weights_errors(resnet_ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="weights file not found: .*missing.pth"):
        _resnet(tmp_path / "missing.pth").build()
    with pytest.raises(RuntimeError, match="does not fit torchvision resnet18 with 4 classes"):
        ResNet50ImageNet(weights=resnet_ckpt[0], arch="resnet18", num_classes=4).build()
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="not a state_dict"):
        _resnet(tmp_path / "list.pt").build()


# --------------------------------------------------------------------------- ImageNet data


def _label_of(path: str) -> int:
    return sorted(CLASSES).index(Path(path).parent.name)


def test_load_splits_val_only_holds_out_calibration(imagenet):
    entry = _resnet(None)
    s = entry.load_splits(DATA, imagenet["val_only"])
    # 5 per class, holdout 0.2 -> 1 per class for calibration, 4 per class evaluated
    assert len(s.train_inputs) == 3 and len(s.test_inputs) == 12
    assert not set(s.train_inputs) & set(s.test_inputs)
    assert len(set(s.train_inputs) | set(s.test_inputs)) == 3 * PER_CLASS
    assert all(not p.endswith(".txt") for p in s.test_inputs)
    assert s.train_labels.tolist() == [0, 1, 2]
    for inputs, labels in ((s.train_inputs, s.train_labels), (s.test_inputs, s.test_labels)):
        assert labels.dtype == torch.int64
        assert labels.tolist() == [_label_of(p) for p in inputs]
    assert s.test_labels.bincount().tolist() == [4, 4, 4]
    again = entry.load_splits(DATA, imagenet["val_only"] / "val")  # the val folder itself
    assert again.train_inputs == s.train_inputs and again.test_inputs == s.test_inputs
    other = _resnet(None).load_splits(DataConfig(image_size=32, split_seed=5), imagenet["val_only"])
    assert other.train_inputs != s.train_inputs  # another seed holds out other images
    capped = entry.load_splits(DataConfig(image_size=32, image_train_subset=2, image_test_subset=5),
                               imagenet["val_only"])
    assert len(capped.train_inputs) == 2 and len(capped.test_inputs) == 5
    assert set(capped.test_inputs) <= set(s.test_inputs) and capped.test_inputs == sorted(capped.test_inputs)


def test_holdout_split_is_per_class_disjoint_and_seeded():
    labels = torch.tensor([0] * 10 + [1] * 3 + [2] * 1)
    held, rest = holdout_split(labels, 0.2, seed=0)
    assert labels[held].bincount(minlength=3).tolist() == [2, 1, 0]
    assert sorted(held.tolist() + rest.tolist()) == list(range(14))
    assert torch.equal(held, holdout_split(labels, 0.2, seed=0)[0])


def test_load_splits_with_train_folder(imagenet, tmp_path):
    s = _resnet(None).load_splits(DATA, imagenet["with_train"])
    assert len(s.train_inputs) == 3 * 2 and len(s.test_inputs) == 3 * PER_CLASS
    assert all("/train/" in p for p in s.train_inputs) and all("/val/" in p for p in s.test_inputs)
    assert s.train_labels.tolist() == [_label_of(p) for p in s.train_inputs] == [0, 0, 1, 1, 2, 2]
    bad = tmp_path / "bad"
    _write_images(bad / "val", 1, seed=3)
    for c in ("n01", "n02", "n09"):  # three classes, but not the same three
        (bad / "train" / c).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(bad / "train" / c / "x.png")
    with pytest.raises(ValueError, match="different class folders"):
        ResNet50ImageNet(arch="resnet18", num_classes=3).load_splits(DATA, bad)


def test_imagenet_data_errors(imagenet, tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "val")) + ".*one folder per class"):
        _resnet(None).load_splits(DATA, tmp_path)
    (tmp_path / "val" / "n01").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="is not an ImageFolder tree"):
        _resnet(None).load_splits(DATA, tmp_path)
    with pytest.raises(ValueError, match="has 3 class folders but the model has 1000 outputs"):
        ResNet50ImageNet().load_splits(DATA, imagenet["val_only"])


def _reference_preprocess(path: str, size: int) -> torch.Tensor:
    """Hand-written eval preprocessing: PIL bilinear resize, center crop, /255, mean/std."""
    im = Image.open(path).convert("RGB")
    w, h = im.size
    short = round(size * 256 / 224)
    nw, nh = (short, int(short * h / w)) if w <= h else (int(short * w / h), short)
    im = im.resize((nw, nh), Image.BILINEAR)
    top, left = round((nh - size) / 2.0), round((nw - size) / 2.0)
    x = np.asarray(im.crop((left, top, left + size, top + size)), dtype=np.float64) / 255.0
    x = (x - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)  # (S, S, 3)
    return torch.from_numpy(x.transpose(2, 0, 1))  # (3, S, S) float64


def test_batches_shapes_dtypes_and_normalisation(imagenet):
    entry = _resnet(None)
    s = entry.load_splits(DATA, imagenet["val_only"])
    batches = entry.batches(s.test_inputs, 5, DATA)
    assert len(batches) == math.ceil(12 / 5) == 3
    shapes = [tuple(b.shape) for b in batches]
    assert shapes == [(5, 3, 32, 32), (5, 3, 32, 32), (2, 3, 32, 32)]
    assert all(b.dtype == torch.float32 for b in batches)
    for i in (0, 1):  # an RGB PNG and a grayscale JPEG
        ref = _reference_preprocess(s.test_inputs[i], 32)
        torch.testing.assert_close(batches[0][i].double(), ref, atol=1e-5, rtol=0)
    single = _resnet(None, workers=1).batches(s.test_inputs, 5, DATA)
    assert all(torch.equal(a, b) for a, b in zip(single, batches))
    assert torch.equal(batches[-1], batches[2]) and len(list(batches)) == 3
    with pytest.raises(IndexError):
        batches[3]


def test_evaluate_end_to_end_on_tiny_resnet(imagenet, resnet_ckpt):
    entry = _resnet(resnet_ckpt[0])
    s = entry.load_splits(DATA, imagenet["val_only"])
    model = entry.build()
    batches = entry.batches(s.test_inputs, 4, DATA)
    acc = evaluate(model, batches, s.test_labels)
    assert 0.0 <= acc <= 1.0
    assert acc == pytest.approx(accuracy(predictions(model, batches), s.test_labels))

