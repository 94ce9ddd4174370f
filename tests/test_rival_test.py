"""benchmarks/rival_test.py's saved rows: exact round-trips and keys that change with every input."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rt():
    spec = importlib.util.spec_from_file_location("rival_test", ROOT / "benchmarks" / "rival_test.py")
    module = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    sys.modules["rival_test"] = module  # its dataclass looks its module up there
    try:
        spec.loader.exec_module(module)  # it puts the repo and benchmarks/ first on sys.path
    finally:
        sys.path[:] = path
    yield module
    sys.modules.pop("rival_test", None)


def _row(rt, seed=0):
    g = torch.Generator().manual_seed(seed)
    return rt.Row(kl=torch.rand(257, generator=g, dtype=torch.float64) / 7,
                  correct=(torch.rand(257, generator=g) > 0.3).double(), bits=2.9999999999999996,
                  seconds=12.345, variant="searched-plain", allocation={"a.weight": (3, 2, 4), "b": (8,)})


def test_save_row_vs_load_row_round_trip(rt, tmp_path):
    row = _row(rt)
    path = tmp_path / "rows" / "m-bayesq-0123.safetensors"
    rt.save_row(path, row)
    back = rt.load_row(path)
    assert torch.equal(back.kl, row.kl) and back.kl.dtype == torch.float64
    assert torch.equal(back.correct, row.correct)
    assert (back.bits, back.seconds, back.variant, back.allocation) == (row.bits, row.seconds, row.variant,
                                                                        row.allocation)
    assert not list(path.parent.glob("*.tmp"))


def test_load_row_missing_or_corrupt_is_none(rt, tmp_path, capsys):
    assert rt.load_row(tmp_path / "none.safetensors") is None
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":1}")
    assert rt.load_row(bad) is None
    assert "not a readable row" in capsys.readouterr().out


def test_row_key_changes_with_each_input(rt):
    base = dict(name="lite0-fmnist", spec="lsq", cfg=("cfg", 1), budget=3.0, seed=17,
                allocation={"a": (3, 2)}, n_test=100, code="abc")
    key = rt.row_key(**base)
    assert rt.row_key(**base) == key and len(key) == 16
    for field, other in (("name", "minilm-sentiment"), ("spec", "lsq:baselines.lsq.iters=2000"),
                         ("cfg", ("cfg", 2)), ("budget", 3.5), ("seed", 18), ("allocation", {"a": (2, 3)}),
                         ("allocation", None), ("n_test", 99), ("code", "abd")):
        assert rt.row_key(**{**base, field: other}) != key, field
    assert rt.row_key(**{**base, "allocation": {"a": [3, 2]}}) == key  # lists and tuples alike


def test_safe_name_is_a_file_name(rt):
    assert rt.safe_name("lsq:baselines.lsq.iters=2000") == "lsq_baselines.lsq.iters_2000"
    assert "/" not in rt.safe_name("x:a.b=c/d")
