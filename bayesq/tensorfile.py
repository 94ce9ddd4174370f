"""Deterministic safetensors files: the same tensors and metadata give the same bytes.

safetensors serialises its ``__metadata__`` map in hash order, which differs between processes, so
two runs with identical results would write files with different sha256 digests. :func:`save_tensors`
rewrites the JSON header in one canonical form (keys sorted, no spaces, padded with spaces to a
multiple of 8 bytes as the format asks); the tensor bytes and their offsets are left as written.
Files stay ordinary safetensors (``safe_open`` / ``load_file`` read them).

Layout (safetensors): ``u64 little-endian header length N | N bytes of JSON | tensor data``.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Mapping

import torch


def canonical_bytes(raw: bytes) -> bytes:
    """``raw`` (a safetensors file's bytes) with its header in canonical JSON."""
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + raw[8 + n:]


def save_tensors(path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``tensors`` (contiguous, CPU) and string ``metadata`` to ``path`` byte-deterministically.

    Written to a temporary file next to ``path`` and renamed, so an interrupted write leaves no
    file at ``path`` and concurrent writers of the same file never interleave.
    """
    from safetensors.torch import save

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = canonical_bytes(save(dict(tensors), metadata=dict(metadata) if metadata else None))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".partial")  # unique per writer
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
