from pathlib import Path

import pytest
import yaml

from bayesq.config import BayesQConfig, PosteriorConfig, QuantConfig, from_mapping, load_params

ROOT = Path(__file__).resolve().parent.parent


def test_load_params_repository_file_is_valid():
    params = load_params(yaml.safe_load((ROOT / "params.yaml").read_text()))
    assert params.profile == "quick" and params.seeds == (17,)
    assert params.budgets == (3.0,)  # the quick profile's one budget
    assert params.quant.bits == (2, 3, 4, 8) and params.quant.group_size == 64
    assert (params.calibration.images, params.calibration.sentences) == (500, 1000)


def test_load_params_full_profile_overrides():
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["profile"] = "full"
    params = load_params(raw)
    assert params.seeds == (17, 29, 43) and params.budgets == (3.0, 3.5, 4.0)
    assert params.distill.samples == 8 and params.baselines.hawq_probes == 2
    assert params.quant.group_size == 64  # untouched keys keep their base value


@pytest.mark.parametrize(
    "section, key, message",
    [
        ("posterior", "dampin", r"posterior: unknown key 'dampin' \(did you mean 'damping'\?\)"),
        ("quant", "group_sise", r"quant: unknown key 'group_sise' \(did you mean 'group_size'\?\)"),
        (None, "budgetz", r"params: unknown key 'budgetz' \(did you mean 'budgets'\?\)"),
    ],
)
def test_load_params_misspelled_key_names_it(section, key, message):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    (raw[section] if section else raw)[key] = 1
    with pytest.raises(ValueError, match=message):
        load_params(raw)


def test_load_params_unknown_profile():
    with pytest.raises(ValueError, match="unknown profile; defined: quick"):
        load_params({"profile": "huge", "profiles": {"quick": {}}})


@pytest.mark.parametrize(
    "cls, kwargs, field",
    [
        (PosteriorConfig, {"damping": 0}, "posterior.damping"),
        (QuantConfig, {"bits": (4, 2)}, "quant.bits"),
        (QuantConfig, {"bits": (2, 16)}, "quant.bits"),
        (QuantConfig, {"group_size": 0}, "quant.group_size"),
        (QuantConfig, {"feedback_table": "yes"}, "quant.feedback_table"),
        (QuantConfig, {"feedback_search": "yes"}, "quant.feedback_search"),
        (QuantConfig, {"refit": 1}, "quant.refit"),
        (QuantConfig, {"codebook": "vq", "unit": "tensor", "vq_dim": 4, "group_size": 30, "rounding": "nearest"}, "quant.group_size"),
        (BayesQConfig, {"budget": -1.0}, "config.budget"),
    ],
)
def test_config_invalid_value_names_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        cls(**kwargs)


def test_from_mapping_list_to_tuple():
    assert from_mapping(QuantConfig, {"bits": [3, 4]}, "quant").bits == (3, 4)


def test_params_unknown_method_rejected():
    with pytest.raises(ValueError, match="params.methods"):
        load_params({"methods": ["gptq-magic"]})


@pytest.mark.parametrize("key, value, match", [
    ("gptq_damp", 0.0, "baselines.gptq_damp = 0.0"), ("gptq_act_order", "yes", "baselines.gptq_act_order"),
    ("awq_grid", 0, "baselines.awq_grid = 0"), ("hawq_probes", 1.5, "baselines.hawq_probes = 1.5"),
    ("bias_correction", 1, "baselines.bias_correction = 1"),
])
def test_baselines_config_bad_value_names_field(key, value, match):
    with pytest.raises(ValueError, match=match):
        load_params({"baselines": {key: value}})


def test_params_yaml_loads_with_every_method():
    from bayesq.config import Method

    p = load_params(yaml.safe_load((Path(__file__).parents[1] / "params.yaml").read_text()))
    assert set(p.methods) == set(Method) and p.baselines.hawq_probes >= 1


def test_from_mapping_removed_key_names_the_replacement():
    from bayesq.config import CalibrationConfig

    with pytest.raises(ValueError, match=r"calibration.fisher_scale was removed: .*posterior.n_data"):
        from_mapping(CalibrationConfig, {"images": 10, "fisher_scale": "train"}, "calibration")


def test_quant_config_rejects_unknown_objective_and_cost_terms():
    with pytest.raises(ValueError, match="objective"):
        QuantConfig(objective="posterior")
    with pytest.raises(ValueError, match="cost_terms"):
        QuantConfig(cost_terms="prior")


def test_calibration_selection_parses_and_names_the_choices():
    from bayesq.config import CalibrationConfig, SelectionInputs

    assert CalibrationConfig().selection == SelectionInputs.HELD_OUT
    assert from_mapping(CalibrationConfig, {"selection": "calibration"}, "calibration").selection == "calibration"
    with pytest.raises(ValueError, match=r"calibration\.selection.*held-out.*calibration"):
        CalibrationConfig(selection="heldout")
    assert from_mapping(CalibrationConfig, {"selection_images": 300}, "calibration").selection_images == 300
    for key in ("selection_images", "selection_sentences"):
        with pytest.raises(ValueError, match=rf"calibration\.{key}"):
            from_mapping(CalibrationConfig, {key: 0}, "calibration")
