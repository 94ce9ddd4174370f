"""The `deploy` stage (flows/deploy.py): its params section, ONNX Runtime's peers, and the whole
flow on a tiny model whose first layer ONNX Runtime's own quantisers can reach (a MatMul)."""

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch import nn

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from test_flows import TinyEntry  # noqa: E402

from bayesq.harness.models.zoo import register, unregister  # noqa: E402
from flows.params import load_params
from flows.stage_params import deploy_peer

PARAMS_YAML = Path(__file__).resolve().parents[1] / "params.yaml"


class _Tokens(nn.Module):
    """(B, 1, 16, 16) images -> (B, 2, 128): two 'tokens' of 128 pixels, so the next Linear is a MatMul."""

    def forward(self, x):
        return x.reshape(x.shape[0], 2, 128)


class TinyTokenEntry(TinyEntry):
    """16x16 images whose label is the brightened quadrant, read as two tokens of 128 pixels."""

    name = "tiny-tokens"
    side = 16

    def build(self, pretrained: bool = True) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(_Tokens(), nn.Linear(128, 32), nn.ReLU(), nn.Flatten(), nn.Linear(64, 4))


@pytest.fixture
def token_entry():
    register(TinyTokenEntry(), replace=True)
    yield
    unregister("tiny-tokens")


def test_params_yaml_deploy_section_loads_in_every_profile():
    raw = yaml.safe_load(PARAMS_YAML.read_text())
    for profile in raw["profiles"]:
        d = load_params({**raw, "profile": profile}).deploy
        assert set(d.models) == {"lite0-fmnist", "minilm-sentiment"} and d.budgets == (3.0, 4.0)
        assert [deploy_peer(p).name for p in d.peers] == [f"ort-{p}" for p in d.peers]


@pytest.mark.parametrize("section, match", [
    ({"peers": ["rtn-3b-b128"]}, r"deploy\.peers = \('rtn-3b-b128',\): each peer is <rtn\|hqq\|gptq>"),
    ({"peers": ["gptq-2b-b64"]}, r"deploy\.peers"),
    ({"peers": ["rtn4-b128"]}, r"deploy\.peers"),
    ({"methods": ["ocs"]}, r"deploy\.methods = \['ocs'\]: choose from \['bayesq', 'gptq', 'awq'\]"),
    ({"models": ["lite0"]}, r"deploy\.models = 'lite0': unknown model"),
    ({"accuracy_level": 0}, r"deploy\.accuracy_level = 0: MatMulNBits' accuracy levels are 1"),
    ({"budget": [3.0]}, r"deploy.*budget"),
])
def test_deploy_section_invalid_names_the_field(section, match):
    with pytest.raises(ValueError, match=match):
        load_params({"deploy": section})


def test_peer_names_and_refusals():
    from bayesq.baselines.ort import Peer

    assert deploy_peer("hqq-2b-b64") == Peer("hqq", 2, 64) and Peer("hqq", 2, 64).name == "ort-hqq-2b-b64"
    with pytest.raises(ValueError, match="ONNX Runtime's GPTQ quantises to 4 bits"):
        Peer("gptq", 8, 64)
    with pytest.raises(ValueError, match="block = 48"):
        Peer("rtn", 4, 48)


def _one_matmul(path: Path, w: np.ndarray) -> Path:
    """An ONNX file of ``Y = A W`` for a (K, N) float32 ``w``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    k, n = w.shape
    g = helper.make_graph([helper.make_node("MatMul", ["A", "W"], ["Y"])], "g",
                          [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
                          initializer=[numpy_helper.from_array(w, "W")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    return path


def _minmax_4bit(w: np.ndarray, block: int) -> np.ndarray:
    """(N, K) float64 dequantised weight of 4-bit asymmetric min/max round-to-nearest per block
    of ``block`` along K (the grid through zero), for a (K, N) ``w``."""
    k, n = w.shape
    blocks = w.T.reshape(n, k // block, block).astype(np.float64)
    lo, hi = np.minimum(blocks.min(-1, keepdims=True), 0), np.maximum(blocks.max(-1, keepdims=True), 0)
    scale = (hi - lo) / 15
    zero = np.clip(np.round(-lo / scale), 0, 15)
    return ((np.clip(np.round(blocks / scale) + zero, 0, 15) - zero) * scale).reshape(n, k)


def test_ort_rtn_peer_vs_numpy_round_to_nearest(tmp_path):
    """ONNX Runtime's RTN peer on one MatMul: its MatMulNBits tensors hold 4-bit asymmetric
    min/max codes of each block (checked against a numpy reference of the dequantised weight),
    and matmulnbits_bits counts them: 4 bits per weight, a float32 scale and a 4-bit zero-point
    per block of 32."""
    from bayesq.baselines.ort import Peer, matmulnbits_bits, ort_quantize
    from bayesq.onnx_export import run_onnx

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 8)).astype(np.float32)  # (K, N)
    path = ort_quantize(_one_matmul(tmp_path / "fp.onnx", w), Peer("rtn", 4, 32), tmp_path / "q.onnx")
    stored, weights = matmulnbits_bits(path)
    assert weights == 64 * 8 and stored == 64 * 8 * 4 + 8 * 2 * 32 + 8 * 8  # codes, 2 scales and 2 zeros per column
    x = rng.standard_normal((3, 64)).astype(np.float32)
    want = x.astype(np.float64) @ _minmax_4bit(w, 32).T
    np.testing.assert_allclose(run_onnx(path, torch.from_numpy(x)), want, rtol=1e-4, atol=1e-4)


def test_ort_gptq_peer_ignores_its_calibration_data(tmp_path):
    """What docs/findings.md reports of ONNX Runtime 1.32's GPTQ: its error feedback reads the
    zero triangle of the inverse Hessian's Cholesky factor, so its file is the same for any
    calibration inputs and holds plain min/max round-to-nearest codes. If this fails, ONNX Runtime
    has fixed it: rerun the deploy stage and update the findings."""
    from bayesq.baselines.ort import Peer, ort_quantize
    from bayesq.onnx_export import run_onnx

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 8)).astype(np.float32)
    fp = _one_matmul(tmp_path / "fp.onnx", w)
    mix = rng.standard_normal((64, 64)).astype(np.float32)  # correlated, unevenly scaled inputs
    outs = []
    for i, cal in enumerate(([torch.randn(32, 64, generator=torch.Generator().manual_seed(1))],
                             [torch.randn(32, 64, generator=torch.Generator().manual_seed(2)) @ torch.from_numpy(mix)])):
        path = ort_quantize(fp, Peer("gptq", 4, 32), tmp_path / f"g{i}.onnx", cal)
        outs.append(run_onnx(path, torch.eye(64)))  # the dequantised weight, (K, N)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[0].T, _minmax_4bit(w, 32), rtol=1e-5, atol=1e-6)


def test_deploy_flow_end_to_end(tmp_path, prefect_harness, token_entry):
    """The tiny model through the whole stage: ONNX Runtime's RTN and GPTQ peers (its first layer,
    a MatMul; the Gemm head stays in float there), BayesQ, our GPTQ and AWQ at 3.0 and 4.0 bits, BayesQ
    again at each peer's bits; every file scored in ONNX Runtime against the FP32 graph; BayesQ's
    paired differences recomputed from the saved examples; the report and the timings."""
    from test_flows import _params

    from bayesq.comparison import paired_difference
    from flows.byo import load_examples
    from flows.common import read_json
    from flows.deploy import deploy_flow, row_label
    from flows.finetune import finetune_flow

    params = _params(tmp_path)
    cfg = yaml.safe_load(params.read_text())
    cfg["models"] = ["tiny-tokens"]
    cfg["deploy"] = {"models": ["tiny-tokens"], "peers": ["rtn-4b-b32", "gptq-4b-b32"], "test_examples": 80,
                     "batches": [1, 4], "repeats": 3, "threads": 1}
    params.write_text(yaml.safe_dump(cfg))
    raw, models, out, report = tmp_path / "raw", tmp_path / "models", tmp_path / "deploy", tmp_path / "deploy.md"
    raw.mkdir()
    (raw / "tiny.bin").write_bytes(b"synthetic")
    finetune_flow(params, raw, models)
    rows = deploy_flow(params, raw, models, out, report)

    by = {r["row"]: r for r in rows}
    peers = {"ort-rtn-4b-b32", "ort-gptq-4b-b32"}
    assert peers <= set(by) and all(by[p]["weights"] == 128 * 32 for p in peers)  # the MatMul, not the Gemm head
    peer_bits = {round(by[p]["avg_bits"], 4) for p in peers}
    assert {row_label("bayesq", b) for b in (3.0, 4.0, *peer_bits)} | peers \
        | {row_label(m, b) for m in ("gptq", "awq") for b in (3.0, 4.0)} == set(by)
    for r in rows:
        assert Path(r["file"]).is_file() and r["fidelity"]["n"] == 80
        if r["kind"] == "ours":
            assert r["avg_bits"] <= r["budget"] + 1e-9 and r["logit_diff"] < 1e-4
    from bayesq.fidelity import score_examples
    from bayesq.harness.models.zoo import get_entry
    from bayesq.onnx_export import OnnxModel
    from flows.common import read_params
    from flows.deploy import test_draw

    entry, p = get_entry("tiny-tokens"), read_params(params)  # the FP32 reference computed once: as if run per row
    batches, labels = test_draw(entry, entry.load_splits(p.data, raw), p)
    direct = score_examples(OnnxModel(out / "tiny-tokens" / "fp32.onnx"), OnnxModel(by["gptq-b3.0"]["file"]), batches,
                            labels, desc=None)
    assert torch.equal(direct.kl, load_examples(Path(by["gptq-b3.0"]["examples"])).kl)
    bq = by[row_label("bayesq", 4.0)]
    mine, gptq = (load_examples(Path(by[k]["examples"])) for k in (row_label("bayesq", 4.0), row_label("gptq", 4.0)))
    assert bq["vs_ours"]["gptq-b4.0"]["kl"] == pytest.approx(paired_difference(mine.kl, gptq.kl).as_dict(), rel=1e-9)
    assert set(bq["vs_ours"]) == {"gptq-b4.0", "awq-b4.0"}
    for p in peers:
        at = by[row_label("bayesq", round(by[p]["avg_bits"], 4))]
        assert p in at["vs_peers"]
    import onnx

    meta = {m.key: m.value for m in onnx.load(by["bayesq-b3.0"]["file"]).metadata_props}
    assert meta["method"] == "bayesq" and meta["checkpoint_sha256"] and meta["calibration_indices"] != "none"
    saved = read_json(out / "deploy.json")
    assert set(saved["latency_ms"]["tiny-tokens"]) == {"fp32", *by} and saved["rows"] == rows
    text = report.read_text()
    assert "## tiny-tokens" in text and "| ort-rtn-4b-b32 |" in text and "batch 4: ms (× FP32)" in text
    assert "BayesQ minus the other file" in text and "convolution" not in text
