"""Fashion-MNIST from the raw IDX ``.gz`` files (as shipped by Debian's ``dataset-fashion-mnist``).

IDX format (big-endian): 2 zero bytes, a type code (``0x08`` = uint8), the number of
dimensions, one 4-byte size per dimension, then the raw data.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

DEFAULT_ROOT = Path("/usr/share/datasets/fashion-mnist")

FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}

_HOW_TO_GET = (
    "install it with `apt-get install dataset-fashion-mnist` (Debian/Ubuntu; files land in "
    "/usr/share/datasets/fashion-mnist), or, where a network is reachable, download the four "
    "*-ubyte.gz files with `torchvision.datasets.FashionMNIST(root, download=True)` and pass "
    "their directory (<root>/FashionMNIST/raw)"
)


def read_idx(path: Path, ndim: int) -> Tensor:
    """Parse one gzip-compressed IDX file of unsigned bytes.

    Args:
        path: an ``*-idx{ndim}-ubyte.gz`` file.
        ndim: expected number of dimensions (3 for images, 1 for labels).

    Returns:
        uint8 tensor of the shape stored in the header, e.g. (N, 28, 28) or (N,).

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: bad magic number, wrong rank, truncated or corrupt data (names the file).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Fashion-MNIST file {path} not found; {_HOW_TO_GET}")
    try:
        with gzip.open(path, "rb") as fh:
            raw = fh.read()
    except (OSError, EOFError, zlib.error) as err:
        raise ValueError(f"{path}: corrupt or truncated gzip stream ({err})") from err
    header_len = 4 + 4 * ndim
    if len(raw) < 4:
        raise ValueError(f"{path}: truncated IDX file ({len(raw)} bytes, no magic number)")
    zero, dtype_code, rank = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08 or rank != ndim:
        raise ValueError(
            f"{path}: bad IDX magic number 0x{raw[:4].hex()} "
            f"(expected 0x000008{ndim:02x}: unsigned bytes, {ndim} dimensions)"
        )
    if len(raw) < header_len:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} < {header_len} bytes)")
    shape = struct.unpack(f">{ndim}I", raw[4:header_len])
    expected = int(np.prod(shape, dtype=np.int64))
    if len(raw) - header_len != expected:
        raise ValueError(
            f"{path}: IDX data has {len(raw) - header_len} bytes, header shape {tuple(shape)} "
            f"needs {expected} (truncated or corrupt file)"
        )
    data = np.frombuffer(raw, dtype=np.uint8, offset=header_len).reshape(shape)
    return torch.from_numpy(data.copy())


def load_fashion_mnist(
    root: Path = DEFAULT_ROOT,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Load the whole of Fashion-MNIST.

    Args:
        root: directory holding the four IDX ``.gz`` files (see ``FILES``).

    Returns:
        ``(train_images, train_labels, test_images, test_labels)``: images uint8 (N, 28, 28)
        with N = 60000 (train) and 10000 (test); labels int64 (N,) in 0..9.

    Raises:
        FileNotFoundError: ``root`` or one of the files is missing (says how to get them).
        ValueError: a file is corrupt, truncated, or image/label counts disagree.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"Fashion-MNIST directory {root} not found; {_HOW_TO_GET}")
    out = []
    for split in ("train", "test"):
        images_path = root / FILES[f"{split}_images"]
        labels_path = root / FILES[f"{split}_labels"]
        images = read_idx(images_path, 3)
        labels = read_idx(labels_path, 1).to(torch.int64)
        if images.shape[0] != labels.shape[0]:
            raise ValueError(
                f"{images_path} has {images.shape[0]} images but {labels_path} has "
                f"{labels.shape[0]} labels"
            )
        if labels.numel() and int(labels.max()) > 9:
            raise ValueError(f"{labels_path}: label {int(labels.max())} outside 0..9")
        out += [images, labels]
    return out[0], out[1], out[2], out[3]
