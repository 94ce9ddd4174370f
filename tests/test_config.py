import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from bayesq.config import (
    AllocationConfig, AllocationUnit, BayesQConfig, Codebook, DistillConfig, PosteriorConfig, Proxy, QuantConfig,
    Rounding,
)
from bayesq.harness.corruptions import CORRUPTIONS
from bayesq.settings import ascending, from_mapping, setting, validate, within
from flows.methods import Method
from flows.params import CalibrationConfig, RobustnessConfig, SelectionInputs, load_params

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
    assert params.distill.samples == 8 and params.baselines.config("hawq").probes == 2
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
        (QuantConfig, {"output_offset": "yes"}, "quant.output_offset"),
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


@pytest.mark.parametrize("method, key, value, match", [
    ("gptq", "damp", 0.0, r"baselines.gptq: GPTQConfig.damp = 0.0: must be in \(0, 1\)"),
    ("ocs", "act_order", "yes", "baselines.ocs: OCSConfig.act_order = 'yes': must be true or false"),
    ("awq", "grid", 0, "baselines.awq: AWQConfig.grid = 0"), ("hawq", "probes", 1.5, "baselines.hawq: HAWQConfig.probes = 1.5"),
    ("optq", "bias_correction", 1, "baselines.optq: GPTQConfig.bias_correction = 1"),
    ("lsq", "iters", 0, "baselines.lsq: lsq.iters must be at least 1"),
    ("brecq", "iters", 0, "baselines.brecq: brecq.iters must be at least 1"),
    ("pact", "lr", 0.0, "baselines.pact: lsq needs lr > 0"), ("dorefa", "lr", -0.1, "baselines.dorefa: dorefa.lr must be > 0"),
    ("bit-split", "epochs", 0, "baselines.bit-split: bitsplit.epochs must be at least 1"),
    ("ocs", "expand_ratios", [0.0], r"baselines.ocs: OCSConfig.expand_ratios.*\(0, 1\]"),
    ("smoothquant", "alpha", 1.5, r"baselines.smoothquant: SmoothQuantConfig.alpha = 1.5.*\[0, 1\]"),
    ("anneal", "steps", -1, "baselines.anneal: AnnealConfig.steps = -1"),
    ("anneal", "search_inputs", 0, "baselines.anneal: AnnealConfig.search_inputs = 0"),
    ("awq", "gird", 20, r"baselines.awq: unknown key 'gird' \(did you mean 'grid'\?\)"),
    ("gptq", "quant", {}, "baselines.gptq.quant: set by the pipeline"),
    ("hawq", "seed", 3, "baselines.hawq.seed: set by the pipeline"),
])
def test_baselines_section_bad_value_names_method_and_field(method, key, value, match):
    with pytest.raises(ValueError, match=match):
        load_params({"baselines": {method: {key: value}}})


@pytest.mark.parametrize("section, match", [
    ({"gptq_damp": 0.01}, r"baselines.gptq_damp was removed: .*gptq: \{damp: ...\}"),
    ({"lsq_iters": 100}, r"baselines.lsq_iters was removed: .*lsq: \{iters: ...\} \(and lsq-plus\)"),
    ({"gtpq": {}}, r"baselines: 'gtpq' is not a baseline \(did you mean 'gptq'\?\)"),
    ({"bayesq": {}}, "baselines: 'bayesq' is not a baseline"),
    ({"gptq": 0.01}, "baselines.gptq = 0.01: need a mapping"),
])
def test_baselines_section_old_keys_and_unknown_methods_are_named(section, match):
    with pytest.raises(ValueError, match=match):
        load_params({"baselines": section})


def test_baselines_sections_load_into_the_library_configs_with_its_defaults():
    """A method without a section runs with its library config's defaults (the registry entry's
    settings on top: OPTQ is GPTQ in natural order); a section changes only its own method."""
    from bayesq.baselines.gptq import GPTQConfig
    from bayesq.baselines.hawq import HAWQConfig
    from bayesq.config import QuantConfig

    q = QuantConfig(group_size=32)
    p = load_params({"quant": {"group_size": 32}, "baselines": {"gptq": {"damp": 0.05, "group_sizes": [16, 64]}}})
    assert p.baselines.config("gptq", q, 3) == GPTQConfig(q, damp=0.05, group_sizes=(16, 64))
    assert p.baselines.config("optq", q, 3) == GPTQConfig(q, act_order=False)
    assert p.baselines.config("hawq", q, 3) == HAWQConfig(q, seed=3)
    assert load_params(yaml.safe_load((ROOT / "params.yaml").read_text())).baselines.config("hawq").probes == 1  # quick


def test_params_yaml_loads_with_every_method():
    """The quick profile runs every method but the learned rivals (AdaRound: about 37 minutes per
    MiniLM encoding at the paper's 10,000 steps; BRECQ, and BayesQ + BRECQ; LSQ, LSQ+, PACT, DoReFa, Bit-Split; OCS,
    three expand ratios of GPTQ's variants), ZeroQ (its distillation, the slowest quick row on a
    2-core Xeon) and BayesQ's own variant rows (distilled, K-FAC, paper-literal: 8.1 minutes of a cold
    run, and `make ablations` has them); the full profile runs all of them."""
    raw = yaml.safe_load((Path(__file__).parents[1] / "params.yaml").read_text())
    p = load_params(raw)
    full_only = {Method.ADAROUND, Method.BRECQ, Method.LSQ, Method.LSQ_PLUS, Method.PACT, Method.DOREFA,
                 Method.BIT_SPLIT, Method.OCS, Method.BAYESQ_BRECQ, Method.ZEROQ,
                 Method.BAYESQ_DISTILL, Method.BAYESQ_EF, Method.BAYESQ_PAPER}
    assert set(p.methods) == set(Method) - full_only and p.baselines.config("hawq").probes >= 1
    assert set(load_params({**raw, "profile": "full"}).methods) == set(Method)


def test_from_mapping_removed_key_names_the_replacement():
    with pytest.raises(ValueError, match=r"calibration.fisher_scale was removed: .*posterior.n_data"):
        from_mapping(CalibrationConfig, {"images": 10, "fisher_scale": "train"}, "calibration")


def test_quant_config_rejects_unknown_objective_and_cost_terms():
    with pytest.raises(ValueError, match="objective"):
        QuantConfig(objective="posterior")
    with pytest.raises(ValueError, match="cost_terms"):
        QuantConfig(cost_terms="prior")


def test_calibration_selection_parses_and_names_the_choices():
    assert CalibrationConfig().selection == SelectionInputs.HELD_OUT
    assert from_mapping(CalibrationConfig, {"selection": "calibration"}, "calibration").selection == "calibration"
    with pytest.raises(ValueError, match=r"calibration\.selection.*held-out.*calibration"):
        CalibrationConfig(selection="heldout")
    assert from_mapping(CalibrationConfig, {"selection_images": 300}, "calibration").selection_images == 300
    for key in ("selection_images", "selection_sentences"):
        with pytest.raises(ValueError, match=rf"calibration\.{key}"):
            from_mapping(CalibrationConfig, {key: 0}, "calibration")


# ---- the declarative validator (bayesq.settings.validate) --------------------------------------------

def _raises(exact: str):
    return pytest.raises(ValueError, match="^" + re.escape(exact) + "$")


def test_validate_coerces_enum_fields_from_their_strings():
    q = QuantConfig(codebook="lloyd", rounding="nearest", unit="tensor")
    assert (q.codebook, q.rounding, q.unit) == (Codebook.LLOYD, Rounding.NEAREST, AllocationUnit.TENSOR)
    assert type(q.codebook) is Codebook
    assert from_mapping(QuantConfig, {"proxy": "mc-kl"}, "quant").proxy is Proxy.MC_KL
    r = RobustnessConfig(methods=["gptq", "awq"])  # tuple[Method, ...]: each member
    assert r.methods == (Method.GPTQ, Method.AWQ)


def test_validate_bad_enum_value_names_field_and_choices():
    with _raises("quant.codebook = 'lloyds': choose from "
                 "['uniform', 'uniform-fixed', 'lloyd', 'lloyd-uniform', 'mulaw', 'vq'] or a codebook whose fit "
                 "is registered (bayesq.books.register_fit)"):
        QuantConfig(codebook="lloyds")
    with pytest.raises(ValueError, match=r"^robustness\.methods = \('gptq', 'magic'\): choose from \['bayesq', "):
        RobustnessConfig(methods=("gptq", "magic"))


@pytest.mark.parametrize("cls, key, section", [
    (PosteriorConfig, "auto_damping", "posterior"), (QuantConfig, "refit", "quant"),
    (AllocationConfig, "latency", "allocation"), (DistillConfig, "accept", "distill"),
])
def test_validate_bool_field_given_one_fails(cls, key, section):
    with _raises(f"{section}.{key} = 1: must be true or false"):
        cls(**{key: 1})


def test_validate_range_rules_name_field_value_and_why():
    with _raises("posterior.kfac_decay = 1.5: EMA decay must be in (0, 1]"):
        PosteriorConfig(kfac_decay=1.5)
    assert PosteriorConfig(kfac_decay=1.0).kfac_decay == 1.0  # the closed end
    with _raises("allocation.hw_tolerance = 1.0: must be in [0, 1)"):
        AllocationConfig(hw_tolerance=1.0)
    assert AllocationConfig(hw_tolerance=0.0).hw_tolerance == 0.0
    with _raises("posterior.probes = 0: must be >= 1 (Rademacher probes per batch)"):
        PosteriorConfig(probes=0)
    with _raises("posterior.damping = nan: must be > 0 (it is the prior precision)"):
        PosteriorConfig(damping=float("nan"))
    with _raises("quant.group_size = '64': must be >= 1"):  # a string where a number belongs
        QuantConfig(group_size="64")
    with _raises("quant.cd_passes = True: must be an integer >= 0 (0: error-feedback codes as they are)"):
        QuantConfig(cd_passes=True)
    with _raises("quant.vq_dim = 3: choose 2, 4 or 8 weights per vector"):
        QuantConfig(vq_dim=3)
    with _raises("robustness.corruptions = ['snow_storm']: choose from " + str(list(CORRUPTIONS))):
        RobustnessConfig(corruptions=("fog", "snow_storm"))  # the offending members only


def test_validate_converts_valid_values():
    assert QuantConfig(bits=[2.0, 4]).bits == (2, 4)
    assert RobustnessConfig(budgets=[3]).budgets == (3.0,)
    floors = {"fc*": 4}
    assert AllocationConfig(floors=floors).floors == floors and AllocationConfig(floors=floors).floors is not floors


def test_posterior_curvature_share_outside_unit_interval_names_field():
    with _raises("posterior.curvature_share = 0.0: share of the calibration batches must be in (0, 1]"):
        PosteriorConfig(curvature_share=0.0)


def test_validate_cross_field_rules_name_field():
    with _raises("quant.rounding = 'error-feedback': error feedback needs uniform grids; codebook is 'lloyd': "
                 "set quant.rounding: nearest"):
        QuantConfig(codebook="lloyd")
    with _raises("posterior.var_min = 1.0: need 0 < var_min < var_max = 0.5"):
        PosteriorConfig(var_min=1.0, var_max=0.5)
    with _raises("allocation.latency = True: latency-aware density works with allocator greedy, not 'dp'"):
        AllocationConfig(latency=True, allocator="dp")
    with _raises("quant.proxy = 'mc-output': the layer-output proxy needs K-FAC factors: "
                 "set posterior.curvature: kfac or lowrank"):
        BayesQConfig(quant=QuantConfig(proxy="mc-output"))


@dataclass(frozen=True)
class _Toy:
    ratio: float = setting(0.5, within("(0, 1]", "a share"))
    mode: Rounding = Rounding.NEAREST
    flag: bool = False
    sizes: tuple[int, ...] = setting((1, 2), ascending("[1, 2]"), convert=tuple)

    def __post_init__(self) -> None:
        validate(self, "toy", lambda: [(self.flag or self.ratio < 1, "toy.ratio", self.ratio, "1 needs flag")])


def test_validate_on_a_hand_made_dataclass():
    assert _Toy(mode="error-feedback", sizes=[1, 3]) == _Toy(mode=Rounding.ERROR_FEEDBACK, sizes=(1, 3))
    for kwargs, message in [
        ({"ratio": 0}, "toy.ratio = 0: must be in (0, 1] (a share)"),
        ({"mode": "round"}, "toy.mode = 'round': choose from ['nearest', 'error-feedback']"),
        ({"flag": "yes"}, "toy.flag = 'yes': must be true or false"),
        ({"sizes": [2, 2]}, "toy.sizes = [2, 2]: must be strictly ascending, e.g. [1, 2]"),
        ({"ratio": 1.0}, "toy.ratio = 1.0: 1 needs flag"),
    ]:
        with _raises(message):
            _Toy(**kwargs)
    assert _Toy(ratio=1.0, flag=True).ratio == 1.0
