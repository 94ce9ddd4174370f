"""Deterministic safetensors files: canonical header, byte-identical across processes, readable."""

import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from bayesq.tensorfile import canonical_bytes, file_sha256, save_tensors

ROOT = Path(__file__).resolve().parent.parent


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"b/x": torch.randn(3, 5, generator=g, dtype=torch.float64), "a": torch.arange(7, dtype=torch.uint8),
            "c": torch.randn(4, generator=g).half()}


def test_save_tensors_round_trip_and_canonical_header(tmp_path):
    meta = {f"k{i}": str(i) for i in range(40)}
    path = save_tensors(tmp_path / "t.safetensors", _tensors(), meta)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    text = raw[8:8 + n].decode().rstrip(" ")
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == meta
        for k, v in _tensors().items():
            assert torch.equal(f.get_tensor(k), v)
    assert canonical_bytes(raw) == raw  # idempotent
    assert not list(tmp_path.glob("*.partial"))


SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from bayesq.tensorfile import save_tensors
    meta = {f"key{i}": str(i * 7) for i in range(64)}
    save_tensors(sys.argv[1], {"w": torch.arange(12.0).reshape(3, 4), "z": torch.ones(5, dtype=torch.int32)}, meta)
""")


def test_save_tensors_byte_identical_across_processes(tmp_path):
    # safetensors writes its metadata map in a per-process hash order; the canonical header does not
    paths = [tmp_path / f"{i}.safetensors" for i in range(3)]
    for p in paths:
        subprocess.run([sys.executable, "-c", SCRIPT, str(p)], cwd=ROOT, check=True)
    assert len({file_sha256(p) for p in paths}) == 1


def test_file_sha256_matches_hashlib(tmp_path):
    import hashlib

    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(256)) * 5000)
    assert file_sha256(p) == hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.parametrize("bad", [b"", b"\x10\x00\x00\x00\x00\x00\x00\x00{"])
def test_canonical_bytes_rejects_truncated(bad):
    with pytest.raises((struct.error, ValueError)):
        canonical_bytes(bad)
