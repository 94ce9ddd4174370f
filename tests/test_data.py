"""Tests of bayesq.harness.data on tiny synthetic files (never the real data sets)."""

from __future__ import annotations

import gzip
import io
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from bayesq.harness.data.calibration import sample_calibration_indices, sample_selection_indices
from bayesq.harness.data.fashion_mnist import FILES, load_fashion_mnist, read_idx
from bayesq.harness.data.sentiment import (
    binary_labels,
    decode_line,
    load_vader_domain,
    split_indices,
)


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write a uint8 array as a gzip IDX file."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def make_fmnist(root: Path, n_train: int = 5, n_test: int = 3) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    arrays = (
        rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n_train, dtype=np.uint8),
        rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n_test, dtype=np.uint8),
    )
    for key, arr in zip(("train_images", "train_labels", "test_images", "test_labels"), arrays):
        write_idx(root / FILES[key], arr)
    return arrays


MOVIE_LINES = [
    b"1\t2.5\tA gripping, lovely film.",
    b"2\t-1.25\tDull and far too long.",
    b"3\t0\tIt is a movie.",
    b"4\t0.1\tCaf\xe9 scenes are nice.",  # cp1252/latin-1 byte, not UTF-8
    b"5\t-0.3\tCaf\xc3\xa9 au lait, meh.",  # valid UTF-8
]


def make_vader_archive(path: Path) -> Path:
    """Nested vader-style sdist: outer tar.gz holding additional_resources/hutto_ICWSM_2014.tar.gz."""
    files = {
        "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt": b"\r\n".join(MOVIE_LINES),
        "hutto_ICWSM_2014/tweets_GroundTruth.txt": b"1\t1.0\tyay\r\n2\t-2.0\tboo\r\n",
        "hutto_ICWSM_2014/amazonReviewSnippets_GroundTruth.txt": b"1_1\t-0.9\tbroken\r\n",
        "hutto_ICWSM_2014/nytEditorialSnippets_GroundTruth.txt": b"1_1\t0.4\tnews\r\n",
    }
    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w:gz") as tar:
        for name, payload in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    with tarfile.open(path, "w:gz") as tar:
        payload = inner.getvalue()
        info = tarfile.TarInfo("vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    return path


# ---------------------------------------------------------------- Fashion-MNIST


def test_load_fashion_mnist_round_trip(tmp_path: Path) -> None:
    arrays = make_fmnist(tmp_path)
    out = load_fashion_mnist(tmp_path)
    for got, want in zip(out, arrays):
        np.testing.assert_array_equal(got.numpy(), want)
    assert out[0].dtype == torch.uint8 and out[0].shape == (5, 28, 28)
    assert out[1].dtype == torch.int64 and out[1].shape == (5,)
    assert out[2].shape == (3, 28, 28) and out[3].dtype == torch.int64


def test_read_idx_truncated_raises_naming_file(tmp_path: Path) -> None:
    make_fmnist(tmp_path)
    path = tmp_path / FILES["train_images"]
    raw = gzip.decompress(path.read_bytes())
    with gzip.open(path, "wb") as fh:
        fh.write(raw[:-10])
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz"):
        load_fashion_mnist(tmp_path)


def test_read_idx_bad_magic_raises(tmp_path: Path) -> None:
    path = tmp_path / "x-idx1-ubyte.gz"
    with gzip.open(path, "wb") as fh:
        fh.write(struct.pack(">HBB", 0, 0x0D, 1) + struct.pack(">I", 2) + b"\0" * 8)
    with pytest.raises(ValueError, match="magic"):
        read_idx(path, 1)


def test_read_idx_corrupt_gzip_raises(tmp_path: Path) -> None:
    path = tmp_path / "x-idx1-ubyte.gz"
    path.write_bytes(b"this is not gzip")
    with pytest.raises(ValueError, match="x-idx1-ubyte.gz"):
        read_idx(path, 1)


def test_load_fashion_mnist_missing_dir_says_how_to_get(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_fashion_mnist(tmp_path / "nope")


# ---------------------------------------------------------------- vader sentiment


def test_decode_line_falls_back_and_strips_cr() -> None:
    assert decode_line(b"caf\xc3\xa9\r\n") == "caf\u00e9"
    assert decode_line(b"caf\xe9\r") == "caf\u00e9"
    assert decode_line(b"\x81\x93") == "\x81\x93"  # 0x81 undefined in cp1252 -> latin-1


def test_load_vader_domain_parses_crlf_and_bad_bytes(tmp_path: Path) -> None:
    archive = make_vader_archive(tmp_path / "vaderSentiment-3.3.2.tar.gz")
    records = load_vader_domain(archive, "movie")
    assert [r for _, r in records] == [2.5, -1.25, 0.0, 0.1, -0.3]
    assert records[0][0] == "A gripping, lovely film."
    assert records[3][0] == "Caf\u00e9 scenes are nice."
    assert records[4][0] == "Caf\u00e9 au lait, meh."
    assert all("\r" not in s for s, _ in records)
    assert load_vader_domain(archive, "tweets") == [("yay", 1.0), ("boo", -2.0)]
    assert load_vader_domain(archive, "amazon") == [("broken", -0.9)]
    assert load_vader_domain(archive, "nyt") == [("news", 0.4)]


def test_load_vader_domain_unknown_domain_lists_valid(tmp_path: Path) -> None:
    archive = make_vader_archive(tmp_path / "v.tar.gz")
    with pytest.raises(ValueError, match="movie, tweets, amazon, nyt"):
        load_vader_domain(archive, "films")


def test_load_vader_domain_missing_archive_says_how_to_get(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="pip download --no-deps --no-binary :all: vader"):
        load_vader_domain(tmp_path / "missing.tar.gz", "movie")


def test_binary_labels_drops_zero_ratings() -> None:
    records = [("a", 2.0), ("b", -0.5), ("c", 0.0), ("d", 1e-3)]
    sentences, labels = binary_labels(records)
    assert sentences == ["a", "b", "d"]
    assert labels.dtype == torch.int64
    assert labels.tolist() == [1, 0, 1]


def test_split_indices_deterministic_and_disjoint() -> None:
    train, test = split_indices(101, 0.2, seed=3)
    train2, test2 = split_indices(101, 0.2, seed=3)
    assert torch.equal(train, train2) and torch.equal(test, test2)
    assert train.dtype == torch.int64 and len(test) == 20 and len(train) == 81
    assert set(train.tolist()).isdisjoint(test.tolist())
    assert sorted(train.tolist() + test.tolist()) == list(range(101))
    other, _ = split_indices(101, 0.2, seed=4)
    assert not torch.equal(train, other)


def test_split_indices_invalid_arguments_raise() -> None:
    with pytest.raises(ValueError, match="test_fraction"):
        split_indices(10, 1.0, 0)
    with pytest.raises(ValueError, match="n >= 2"):
        split_indices(1, 0.5, 0)


# ---------------------------------------------------------------- calibration


def test_sample_calibration_indices_sorted_unique_seeded() -> None:
    idx = sample_calibration_indices(50, 20, seed=1)
    assert idx.dtype == torch.int64 and idx.shape == (20,)
    assert torch.equal(idx, torch.sort(idx).values)
    assert len(set(idx.tolist())) == 20 and 0 <= int(idx.min()) and int(idx.max()) < 50
    assert torch.equal(idx, sample_calibration_indices(50, 20, seed=1))
    assert sample_calibration_indices(5, 5, seed=0).tolist() == [0, 1, 2, 3, 4]


def test_sample_selection_indices_disjoint_from_calibration_and_cover_the_rest() -> None:
    cal, sel = sample_calibration_indices(50, 20, seed=3), sample_selection_indices(50, 20, seed=3)
    assert sel.shape == (20,) and torch.equal(sel, torch.sort(sel).values)
    assert not set(cal.tolist()) & set(sel.tolist())
    assert torch.equal(sel, sample_selection_indices(50, 20, seed=3))
    # a pool under twice the calibration size: the selection is everything the calibration left
    cal, sel = sample_calibration_indices(30, 20, seed=4), sample_selection_indices(30, 20, seed=4)
    assert sorted(cal.tolist() + sel.tolist()) == list(range(30))


def test_sample_selection_indices_larger_than_calibration_is_the_next_permutation_entries() -> None:
    cal, sel = sample_calibration_indices(100, 10, seed=5), sample_selection_indices(100, 10, seed=5, n_sel=40)
    assert sel.shape == (40,) and not set(cal.tolist()) & set(sel.tolist())
    assert set(sample_selection_indices(100, 10, seed=5).tolist()) <= set(sel.tolist())  # a prefix of the same draw
    perm = torch.randperm(100, generator=torch.Generator().manual_seed(5), dtype=torch.int64)
    assert sel.tolist() == sorted(perm[10:50].tolist()) and cal.tolist() == sorted(perm[:10].tolist())
    # the pool runs out: what the calibration left
    assert sorted(sample_selection_indices(30, 10, seed=5, n_sel=50).tolist() + sample_calibration_indices(
        30, 10, seed=5).tolist()) == list(range(30))


def test_sample_selection_indices_nothing_left_names_the_fix() -> None:
    with pytest.raises(ValueError, match="none is left.*calibration.selection: calibration"):
        sample_selection_indices(5, 5, seed=0)
    with pytest.raises(ValueError, match="selection size n_sel = 0 must be >= 1"):
        sample_selection_indices(10, 5, seed=0, n_sel=0)


@pytest.mark.parametrize(
    ("n_total", "n_cal", "message"),
    [(10, 11, "exceeds the pool of 10"), (10, 0, "must be >= 1"), (0, 1, "empty calibration pool")],
)
def test_sample_calibration_indices_invalid_sizes_raise(n_total: int, n_cal: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sample_calibration_indices(n_total, n_cal, seed=0)
