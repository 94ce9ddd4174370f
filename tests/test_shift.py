"""The `shift` stage (flows/shift.py): its params section, the data of a case, and the whole flow
on a tiny model calibrated on half of its classes."""

from pathlib import Path

import pytest
import torch
import yaml
from test_flows import _params, tiny_entry  # noqa: F401 - the tiny zoo model and its params

from bayesq.comparison import kl_per_example, paired_difference
from flows.params import load_params
from flows.stage_params import ShiftCase

PARAMS_YAML = Path(__file__).resolve().parents[1] / "params.yaml"


def test_params_yaml_shift_cases_load_in_every_profile():
    raw = yaml.safe_load(PARAMS_YAML.read_text())
    for profile in raw["profiles"]:
        cases = load_params({**raw, "profile": profile}).shift.shift_cases()
        assert {c.model for c in cases} == {"minilm-sentiment", "lite0-fmnist"}
        assert ShiftCase("classes-0-2-to-all", "lite0-fmnist", (0, 1, 2), ("all",)) in cases
        assert ShiftCase("tweets-to-movie", "minilm-sentiment", "tweets", ("movie",)) in cases


@pytest.mark.parametrize("case, match", [
    ({"model": "lite0-fmnst", "calibrate": [0], "test": ["all"]}, r"shift\.cases\.c\.model = 'lite0-fmnst': unknown model"),
    ({"model": "lite0-fmnist", "calibrate": [0, 10], "test": ["all"]},
     r"shift\.cases\.c\.calibrate = \[0, 10\]: an image model calibrates on a list of its classes, integers in 0\.\.9"),
    ({"model": "lite0-fmnist", "calibrate": list(range(10)), "test": ["all"]}, r"every class: that is no shift"),
    ({"model": "lite0-fmnist", "calibrate": [1], "test": ["movie"]}, r"shift\.cases\.c\.test = \['movie'\]: .*\[all\]"),
    ({"model": "minilm-sentiment", "calibrate": "twitter", "test": ["movie"]},
     r"shift\.cases\.c\.calibrate = 'twitter': a text model calibrates on one domain of \['movie', 'tweets'"),
    ({"model": "minilm-sentiment", "calibrate": "tweets", "test": ["tweets", "movie"]},
     r"shift\.cases\.c\.test = .*the calibration domain is no shift"),
    ({"model": "minilm-sentiment", "calibrate": "tweets", "test": []}, r"shift\.cases\.c\.test = \[\]: need a non-empty list"),
    ({"model": "minilm-sentiment", "calibrate": "tweets"}, r"shift\.cases\.c = .*exactly the keys \['model', 'calibrate', 'test'\]"),
])
def test_shift_case_invalid_names_the_field(case, match):
    with pytest.raises(ValueError, match=match):
        load_params({"shift": {"cases": {"c": case}}})


def test_shift_methods_are_bayesq_and_the_rivals_with_corrections():
    with pytest.raises(ValueError, match=r"shift\.methods = \['bayesq', 'rtn-group'\]: choose from \['bayesq', 'gptq', 'optq', 'awq'\]"):
        load_params({"shift": {"methods": ["bayesq", "rtn-group"]}})


def test_case_splits_image_pool_holds_only_the_calibration_classes(tmp_path, tiny_entry):  # noqa: F811
    from flows.common import read_params
    from flows.shift import case_splits

    params = read_params(_params(tmp_path))
    pool, tests = case_splits(ShiftCase("c", "tiny-cnn", (0, 1), ("all",)), params, tmp_path, 70)
    assert set(pool.train_labels.tolist()) == {0, 1} and len(pool.train_labels) > 100
    assert list(tests) == ["all"] and len(tests["all"].test_labels) == 70
    assert set(tests["all"].test_labels.tolist()) == {0, 1, 2, 3}


def test_shift_flow_end_to_end(tmp_path, prefect_harness, tiny_entry):  # noqa: F811
    """Calibrated on two of the tiny CNN's four classes, tested on all: every row of BayesQ and
    GPTQ, the default's offset half of the full fit on the same model, and the report's paired
    differences recomputed from the saved logits."""
    from flows.common import read_json
    from flows.finetune import finetune_flow
    from flows.robustness import read_tensors
    from flows.shift import FULL_OFFSET, logits_file, row_name, shift_flow

    params = _params(tmp_path)
    cfg = yaml.safe_load(params.read_text())
    cfg["calibration"].update(selection_images=64)
    cfg["shift"] = {"methods": ["bayesq", "gptq"], "test_examples": 100,
                    "cases": {"half": {"model": "tiny-cnn", "calibrate": [0, 1], "test": ["all"]}}}
    params.write_text(yaml.safe_dump(cfg))
    raw, models, out, report = tmp_path / "raw", tmp_path / "models", tmp_path / "shift", tmp_path / "shift.md"
    raw.mkdir()
    (raw / "tiny.bin").write_bytes(b"synthetic")
    finetune_flow(params, raw, models)
    rows = shift_flow(params, raw, models, out, report)

    names = {(r["method"], r["row"]) for r in rows}
    assert names == {("bayesq", "default"), ("bayesq", "no output offset"), ("bayesq", "no corrections"),
                     ("bayesq", "no grid selection"), ("bayesq", FULL_OFFSET), ("gptq", "default"),
                     ("gptq", "no corrections")}
    logits = {row: read_tensors(logits_file(out, "half", "all", row_name(m, row)))["logits"].double()
              for m, row in names if m == "bayesq"}
    half, full = (logits[r] - logits["no output offset"] for r in ("default", FULL_OFFSET))
    assert float(full.abs().max()) > 1e-3  # an offset that moved, so the check can fail
    torch.testing.assert_close(half, 0.5 * full, rtol=0, atol=1e-5)  # float32 logits
    fp = read_tensors(logits_file(out, "half", "all", "fp"))
    default = next(r for r in rows if (r["method"], r["row"]) == ("bayesq", "default"))
    gptq = read_tensors(logits_file(out, "half", "all", row_name("gptq", "default")))["logits"].double()
    want = paired_difference(kl_per_example(fp["logits"].double(), logits["default"]),
                             kl_per_example(fp["logits"].double(), gptq))
    assert default["vs_gptq"]["kl"] == pytest.approx(want.as_dict(), rel=1e-9)
    assert default["n"] == 100 and 0 <= default["agreement"] <= 100
    assert read_json(out / "shift.json") == {"rows": rows}
    text = report.read_text()
    assert "## half: tiny-cnn, calibrated on classes 0, 1, tested on all (100 examples)" in text
    assert "BayesQ's default − GPTQ's default: KL" in text and "| gptq | no corrections |" in text
