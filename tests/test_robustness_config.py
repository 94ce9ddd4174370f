"""RobustnessConfig (flows/params.py) and the robustness / distill sections of params.yaml."""

import pytest

from bayesq.config import DistillConfig
from bayesq.harness.corruptions import CORRUPTIONS
from flows.methods import Method
from flows.params import RobustnessConfig, load_params


def test_robustness_config_defaults_valid():
    cfg = RobustnessConfig()
    assert set(cfg.corruptions) <= set(CORRUPTIONS)
    assert "movie" not in cfg.text_domains
    assert all(isinstance(m, Method) for m in cfg.methods)
    assert cfg.severities == (1, 2, 3, 4, 5) and cfg.ece_bins == 15


def test_robustness_config_coerces_methods_and_budgets():
    cfg = RobustnessConfig(methods=("gptq", "bayesq-distill"), budgets=(3, 4))
    assert cfg.methods == (Method.GPTQ, Method.BAYESQ_DISTILL)
    assert cfg.budgets == (3.0, 4.0) and all(isinstance(b, float) for b in cfg.budgets)


def test_robustness_config_accepts_every_known_corruption_and_domain():
    cfg = RobustnessConfig(corruptions=CORRUPTIONS, text_domains=("nyt", "tweets"), severities=(1, 5))
    assert cfg.corruptions == CORRUPTIONS


@pytest.mark.parametrize("field,value", [
    ("corruptions", ("gaussian_noise", "snow_storm")),
    ("text_domains", ("movie",)),  # the in-domain training source is not an out-of-domain test
    ("text_domains", ("tweets", "reddit")),
    ("severities", (0,)),
    ("severities", (1, 6)),
    ("severities", (2.5,)),
    ("severities", (True,)),
    ("corruption_examples", 0),
    ("domain_examples", 0),
    ("ece_bins", 0),
    ("random_bin_repeats", -1),
    ("methods", ("bayesq", "magic")),
])
def test_robustness_config_invalid_raises(field, value):
    with pytest.raises(ValueError, match=rf"robustness\.{field}"):
        RobustnessConfig(**{field: value})


def test_robustness_config_error_names_bad_value():
    with pytest.raises(ValueError, match="snow_storm"):
        RobustnessConfig(corruptions=("fog", "snow_storm"))


def test_load_params_robustness_and_distill_sections():
    raw = {
        "robustness": {"budgets": [3.5], "methods": ["bayesq", "gptq"], "severities": [2, 4],
                       "corruptions": ["fog", "contrast"], "corruption_examples": 64},
        "distill": {"steps": 50, "lr": 3e-4, "train_bias": True, "agreement": 0.9},
    }
    params = load_params(raw)
    r = params.robustness
    assert r.budgets == (3.5,) and r.methods == (Method.BAYESQ, Method.GPTQ)
    assert r.severities == (2, 4) and r.corruptions == ("fog", "contrast") and r.corruption_examples == 64
    expect = DistillConfig(steps=50, lr=3e-4, train_bias=True, agreement=0.9)
    assert params.distill == expect
    cfg = params.bayesq(3.0, 17)
    assert cfg.distill == expect and cfg.distill is params.distill
    assert cfg.budget == 3.0 and cfg.seed == 17


def test_load_params_profile_overrides_robustness():
    raw = {"profile": "tiny", "robustness": {"corruption_examples": 500},
           "profiles": {"tiny": {"robustness": {"corruption_examples": 16}}}}
    assert load_params(raw).robustness.corruption_examples == 16


@pytest.mark.parametrize("section,key,field", [("robustness", "severity", "severities"),
                                               ("distill", "stepz", "steps")])
def test_load_params_unknown_key_raises(section, key, field):
    with pytest.raises(ValueError, match=rf"{section}: unknown key '{key}' \(did you mean '{field}'\?\)"):
        load_params({section: {key: 1}})


def test_load_params_invalid_robustness_value_raises():
    with pytest.raises(ValueError, match=r"robustness\.severities"):
        load_params({"robustness": {"severities": [0, 1]}})
