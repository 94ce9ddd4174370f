"""The pipeline's parameter schema (flows/params.py): the per-model ``exclude`` mapping."""

from pathlib import Path

import pytest
import yaml
from torch import nn

from flows.params import load_params

PARAMS_YAML = Path(__file__).resolve().parents[1] / "params.yaml"


def test_params_yaml_excludes_nothing_in_every_profile():
    raw = yaml.safe_load(PARAMS_YAML.read_text())
    assert raw["exclude"] == {}  # the key is there (documented), empty: results unchanged
    for profile in raw["profiles"]:
        params = load_params({**raw, "profile": profile})
        assert params.exclude == {} and params.excluded("lite0-fmnist") == ()
    assert load_params({"exclude": None}).exclude == {}  # `exclude:` with nothing after it


def test_exclude_per_model_patterns_and_profile_override():
    raw = {"exclude": {"minilm-sentiment": ["classifier", "bert.encoder.layer.0.*"]},
           "profiles": {"quick": {"exclude": {"lite0-fmnist": ["_fc"]}}}}
    params = load_params(raw)
    assert params.excluded("minilm-sentiment") == ("classifier", "bert.encoder.layer.0.*")
    assert params.excluded("lite0-fmnist") == ("_fc",)  # the profile adds a model, keeps the others
    assert params.excluded("resnet18-fmnist") == ()


@pytest.mark.parametrize("exclude, match", [
    ({"lite0-fmnst": ["_fc"]},
     r"exclude\.lite0-fmnst = .*unknown model \(did you mean 'lite0-fmnist'\?\); known models: lite0-fmnist, "
     r"minilm-sentiment, resnet18-fmnist"),
    ({"lite0-fmnist": "_fc"}, r"exclude\.lite0-fmnist = '_fc': need a list of module names or glob patterns"),
    ({"lite0-fmnist": [3]}, r"exclude\.lite0-fmnist = \(3,\): every pattern is a non-empty string"),
    ({"lite0-fmnist": ["_fc", None]}, r"exclude\.lite0-fmnist = .*every pattern is a non-empty string"),
    ({"lite0-fmnist": [""]}, r"exclude\.lite0-fmnist = .*every pattern is a non-empty string"),
    ({"lite0-fmnist": None}, r"exclude\.lite0-fmnist = None: need a list"),
    (["_fc"], r"params\.exclude = \['_fc'\]: need a mapping \{model: \[module names or glob patterns\]\}"),
])
def test_exclude_invalid_names_the_field(exclude, match):
    with pytest.raises(ValueError, match=match):
        load_params({"exclude": exclude})


def test_exclude_misspelled_top_level_key_is_suggested():
    with pytest.raises(ValueError, match=r"unknown key 'exclued' \(did you mean 'exclude'\?\)"):
        load_params({"exclued": {"lite0-fmnist": ["_fc"]}})


def test_checked_exclude_pattern_matching_no_module_names_model_and_pattern():
    from flows.prepare import checked_exclude

    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 8)), nn.Linear(8, 2))
    assert checked_exclude("m", model, ["2", "1.*", "1"]) == ("2", "1.*", "1")  # a layer; a glob; a block
    with pytest.raises(ValueError, match=r"exclude\.m: pattern 'classifer' matches no module of m "
                                         r"\(modules: 0, 1, 1\.0, \.\.\., 2\).*fix or delete it"):
        checked_exclude("m", model, ["2", "classifer"])
    attention = nn.ModuleDict({"attn": nn.MultiheadAttention(8, 2)})
    assert checked_exclude("a", attention, ["attn.q_proj"]) == ("attn.q_proj",)  # a name of the rewritten model
