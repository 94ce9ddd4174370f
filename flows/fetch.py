"""Obtain the raw embedded data into ``data/raw`` (run by ``make data``; idempotent).

* Fashion-MNIST: the Debian package ``dataset-fashion-mnist`` (installed with apt-get when
  missing and running as root), else torchvision's downloader where a network allows it.
* Movie-review sentences: the vaderSentiment 3.3.2 source archive from PyPI.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

FMNIST_DEB = Path("/usr/share/datasets/fashion-mnist")
FMNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
VADER = "vaderSentiment-3.3.2.tar.gz"


def _run(cmd: list[str]) -> bool:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode == 0


def fetch_fashion_mnist(out: Path) -> None:
    dest = out / "fashion-mnist"
    if all((dest / f).exists() for f in FMNIST_FILES):
        return
    if not FMNIST_DEB.exists() and shutil.which("apt-get") and os.geteuid() == 0:
        _run(["apt-get", "update", "-q"]) and _run(["apt-get", "install", "-y", "-q", "dataset-fashion-mnist"])
    dest.mkdir(parents=True, exist_ok=True)
    if FMNIST_DEB.exists():
        for f in FMNIST_FILES:
            shutil.copy(FMNIST_DEB / f, dest / f)
        return
    try:  # no apt: torchvision's downloader (needs a network)
        from torchvision.datasets import FashionMNIST

        FashionMNIST(str(out / "torchvision"), download=True)
        for f in FMNIST_FILES:
            shutil.copy(out / "torchvision" / "FashionMNIST" / "raw" / f, dest / f)
    except Exception as err:  # noqa: BLE001 - report any download failure the same way
        sys.exit(f"could not obtain Fashion-MNIST ({err}); install the Debian package "
                 "dataset-fashion-mnist or put the four IDX .gz files in " + str(dest))


def fetch_vader(out: Path) -> None:
    if (out / VADER).exists():
        return
    ok = _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "-q", "-d", str(out), "vaderSentiment==3.3.2"])
    if not ok or not (out / VADER).exists():
        sys.exit(f"could not download {VADER} from PyPI; place it in {out}")


def main() -> None:
    p = argparse.ArgumentParser(description="Fetch the raw embedded data")
    p.add_argument("--out", type=Path, default=Path("data/raw"))
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    fetch_fashion_mnist(a.out)
    fetch_vader(a.out)


if __name__ == "__main__":
    main()
