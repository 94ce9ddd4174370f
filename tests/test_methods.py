from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import bayesq
from bayesq.baselines.aciq import ACIQConfig
from bayesq.baselines.activations import input_stats
from bayesq.baselines.adaround import AdaRoundConfig
from bayesq.baselines.anneal import AnnealConfig
from bayesq.baselines.awq import AWQConfig
from bayesq.baselines.bitsplit import BitSplitConfig
from bayesq.baselines.blockwise import BlockwiseConfig
from bayesq.baselines.brecq import BayesQBRECQConfig, BRECQConfig
from bayesq.baselines.dorefa import DoReFaConfig
from bayesq.baselines.gptq import GPTQConfig, gptq_select
from bayesq.baselines.hawq import HAWQConfig
from bayesq.baselines.lsq import LSQConfig
from bayesq.baselines.ocs import OCSConfig
from bayesq.baselines.rtn import RTNConfig
from bayesq.baselines.smoothquant import SmoothQuantConfig
from bayesq.baselines.zeroq import ZeroQConfig
from bayesq.blocks import quantizable_layers
from bayesq.config import BayesQConfig, DistillConfig, Granularity, QuantConfig
from bayesq.context import KnownOutputs
from bayesq.evaluation import reference_log_probs
from bayesq.methods import Inputs, quantize_with, register, registered
from flows.methods import Method

Q = QuantConfig(group_size=32, unit_groups=2)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 6 * 6, 32),
                         nn.ReLU(), nn.Linear(32, 10))


def _batches(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 3, 6, 6, generator=g) for _ in range(n)]


CONFIGS = [
    RTNConfig(Granularity.CHANNEL, Q), RTNConfig(Granularity.GROUP, Q), ACIQConfig(quant=Q),
    HAWQConfig(quant=Q, probes=2), GPTQConfig(Q, select=False), GPTQConfig(Q, group_sizes=(32,)),
    AWQConfig(Q, select=False, grid=4), AWQConfig(Q, group_sizes=(32,), grid=4),
    BayesQConfig(quant=Q, distill=DistillConfig(max_budget=0)),
    AdaRoundConfig(Q, group_sizes=(32,), iters=30, progress=False),
    BRECQConfig(Q, group_sizes=(32,), iters=10, progress=False), BRECQConfig(Q, select=False, iters=10, progress=False),
    BayesQBRECQConfig(BayesQConfig(quant=Q, distill=DistillConfig(max_budget=0)), BRECQConfig(iters=10, progress=False)),
    LSQConfig(Q, group_sizes=(32,), iters=30, progress=False),
    LSQConfig(Q, select=False, offset=True, iters=30, progress=False),
    LSQConfig(Q, select=False, gradient="pact", iters=30, progress=False),
    DoReFaConfig(Q, group_sizes=(32,), iters=30, progress=False),
    BitSplitConfig(Q, group_sizes=(32,), progress=False),
    OCSConfig(Q, group_sizes=(32,), expand_ratios=(0.05, 0.1)), OCSConfig(Q, select=False),
    ZeroQConfig(Q, iters=20, progress=False),
    BlockwiseConfig("uniform", Q), BlockwiseConfig("lloyd", Q),
    SmoothQuantConfig(Q, select=False), SmoothQuantConfig(Q, group_sizes=(32,), alpha=0.75),
    AnnealConfig(Q, steps=10, progress=False),
]


def test_registry_covers_every_method_config():
    assert {type(c) for c in CONFIGS} == set(registered())


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{type(c).__name__}")
def test_quantize_with_every_method_meets_the_budget_and_leaves_the_model(config):
    model, batches = _model(), _batches()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = quantize_with(model, config, 4.0, Inputs(calibration=batches, selection=_batches(2, seed=2)))
    assert out.result.average_bits <= 4.0
    assert set(out.result.weights) == set(quantizable_layers(model))
    assert out.result.model(batches[0]).shape == (8, 10)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_gptq_method_vs_gptq_select():
    """The handler is gptq_select on the given statistics (bias correction offered: the default, as
    the pipeline's row), and says it read them."""
    model, batches, sel = _model(), _batches(), _batches(2, seed=2)
    stats = input_stats(model, batches, quantizable_layers(model))
    out = quantize_with(model, GPTQConfig(Q, group_sizes=(32,)), 3.0, Inputs(calibration=batches, selection=sel,
                                                                             stats=stats))
    want = gptq_select(model, stats, batches, 3.0, Q, group_sizes=(32,), selection=sel, bias_correction=True)
    assert out.details["variant"] == want.variant and out.details["variant_kl"] == want.kl
    assert out.read == {"stats"}
    for name, qw in want.result.weights.items():
        assert torch.equal(out.result.weights[name].codes, qw.codes)
    assert quantize_with(model, GPTQConfig(Q, group_sizes=(32,)), 3.0, Inputs(calibration=batches)).read == set()


def test_bayesq_method_reports_the_reference_read_only_when_it_scores_with_it():
    """BayesQ reads a given reference (the FP log-probabilities on the selection inputs) when it
    scores two grid candidates or fits the output offset on the held-out inputs; with one
    candidate and no offset it reads nothing, and says so."""
    model, batches, sel = _model(), _batches(), _batches(2, seed=2)
    given = Inputs(calibration=batches, selection=sel, known=KnownOutputs(reference_log_probs(model, sel)))
    off = DistillConfig(max_budget=0)
    assert "log_probs" in quantize_with(model, BayesQConfig(quant=Q, distill=off), 3.0, given).read
    alone = replace(Q, select_grids=False, output_offset=False)
    out = quantize_with(model, BayesQConfig(quant=alone, distill=off), 3.0, given)
    assert out.result.selection_kl == {} and out.read == set()
    offset = quantize_with(model, BayesQConfig(quant=replace(alone, output_offset=True), distill=off), 3.0, given)
    assert offset.result.output_offset.fitted and "log_probs" in offset.read


def _progress(config, on: bool):
    """``config`` with every progress switch it has set to ``on`` (BayesQ + BRECQ: both parts')."""
    if isinstance(config, BayesQBRECQConfig):
        return replace(config, bayesq=replace(config.bayesq, progress=on), brecq=replace(config.brecq, progress=on))
    return replace(config, progress=on)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{type(c).__name__}")
def test_quantize_with_every_method_shows_progress_unless_switched_off(config, capsys):
    """Every method's config has a progress switch, on by default (a user of ``quantize_with`` on a
    large model sees each step move, not minutes of silence), and off it prints nothing."""
    assert all(c.default is True for c in _progress_fields(type(config)))
    model, batches, sel = _model(), _batches(), _batches(2, seed=2)
    capsys.readouterr()
    quantize_with(model, _progress(config, False), 4.0, Inputs(calibration=batches, selection=sel))
    assert capsys.readouterr().err == ""
    quantize_with(model, _progress(config, True), 4.0, Inputs(calibration=batches, selection=sel))
    assert "it/s" in capsys.readouterr().err


def _progress_fields(cls) -> list:
    from dataclasses import fields

    own = [f for f in fields(cls) if f.name == "progress"]
    parts = [f for f in fields(cls) if f.name in ("bayesq", "brecq")]
    assert own or parts, f"{cls.__name__} has no progress switch"
    return own + [g for f in parts for g in _progress_fields(type(f.default_factory()))]


def test_gptq_method_shows_each_step(capsys):
    """GPTQ's bars name its steps: the statistics pass, the variants (the one under way as the
    postfix), the layers each encodes and the scoring passes."""
    model, batches, sel = _model(), _batches(), _batches(2, seed=2)
    capsys.readouterr()
    quantize_with(model, GPTQConfig(Q, group_sizes=(32,), bias_correction=True), 4.0,
                  Inputs(calibration=batches, selection=sel))
    err = capsys.readouterr().err
    for step in ("layer-input statistics", "variants", "uniform-3-g32]", "grids and rounding errors",
                 "encode (error-feedback)", "FP on the scored inputs", "selection KL (uniform-3-g32+bc)"):
        assert step in err, step


def test_quantize_with_an_unregistered_config_names_the_registered_ones():
    class Unknown:
        pass

    with pytest.raises(TypeError, match="no quantisation method is registered for Unknown: pass one of .*GPTQConfig"):
        quantize_with(_model(), Unknown(), 3.0)


def test_quantize_with_no_calibration_names_the_method():
    with pytest.raises(ValueError, match="GPTQ reads calibration inputs"):
        quantize_with(_model(), GPTQConfig(Q), 3.0, Inputs())
    with pytest.raises(ValueError, match="HAWQ reads calibration inputs"):
        quantize_with(_model(), HAWQConfig(Q), 3.0, Inputs(calibration=[]))


def test_register_refuses_a_second_handler_for_one_config():
    with pytest.raises(ValueError, match="GPTQConfig already has a handler"):
        register(GPTQConfig)(lambda model, config, budget, inputs: None)


def test_pipeline_runs_every_baseline_through_the_registry():
    from flows.methods import BASELINES, ENTRY, BaselineSettings

    bayesq_rows = {Method.BAYESQ, Method.BAYESQ_EF, Method.BAYESQ_DISTILL, Method.BAYESQ_PAPER, Method.BAYESQ_BRECQ}
    assert set(BASELINES) == {m for m in Method if ENTRY[m].config is not None} == set(Method) - bayesq_rows
    for m in BASELINES:
        assert type(BaselineSettings().config(m, Q, 0)) in registered()
    assert bayesq.quantize_with is quantize_with


def test_pipeline_method_tables_all_derive_from_the_registry_entries():
    """Every table the pipeline keeps per method is read off flows.methods.METHODS: one entry is all
    a baseline needs besides its module (the CLI's choices, labels, configs, sources, groups, the
    paired report's columns)."""
    from flows.methods import (
        BASELINES, BYO_METHODS, ENTRY, GROUPS, METHOD_LABEL, METHOD_SOURCES, METHODS, Method as FlowMethod, group,
    )
    from flows.report.paired import PAIRED_BASELINES, PAIRED_METHODS

    names = [e.name for e in METHODS]
    assert len(set(names)) == len(names) and [m.value for m in FlowMethod] == names == list(BYO_METHODS)
    assert METHOD_LABEL == {e.name: e.label for e in METHODS} and all(METHOD_LABEL.values())
    assert set(METHOD_SOURCES) <= set(FlowMethod) and all((Path(__file__).parents[1] / f).exists() for fs in METHOD_SOURCES.values() for f in fs)
    assert PAIRED_METHODS == tuple(m.value for m in group("bayesq"))
    assert PAIRED_BASELINES == tuple(m.value for m in BASELINES) == tuple(n for n in names if n not in PAIRED_METHODS)
    assert all(ENTRY[m].groups <= set(GROUPS) for m in FlowMethod)
    assert not set(group("data-free")) & set(group("calibrated"))
    with pytest.raises(ValueError, match="unknown method group 'grids'"):
        group("grids")


def test_bayesq_brecq_row_config_is_bayesq_rows_and_brecq_rows_schedule():
    from flows.configs import method_config
    from flows.params import load_params

    p = load_params({"baselines": {"brecq": {"iters": 123, "lam": 0.02}}})
    (cfg, quant), (bq, bq_quant) = method_config("bayesq-brecq", p, 3.0, 5), method_config("bayesq", p, 3.0, 5)
    brecq, _ = method_config("brecq", p, 3.0, 5)
    assert cfg.bayesq == bq and quant == bq_quant
    assert (cfg.brecq.iters, cfg.brecq.lam, cfg.brecq.seed) == (brecq.iters, brecq.lam, brecq.seed) == (123, 0.02, 5)


@pytest.mark.parametrize("config", [GPTQConfig(Q), AWQConfig(Q, grid=4), RTNConfig(Granularity.GROUP, Q),
                                    HAWQConfig(quant=Q, probes=2), LSQConfig(Q, offset=True, iters=20, progress=False)],
                         ids=lambda c: type(c).__name__)
def test_quantize_with_baselines_on_a_causal_language_model(config):
    """GPTQ / AWQ / LSQ+ (their variants scored per input on the token-mean KL), RTN and HAWQ on a causal
    LM's (B, T, V) logits, calibrated on padded input_ids / attention_mask dicts: within the
    budget, every Linear quantised, finite logits, the model left as it came."""
    from nets import TinyCausalLM, lm_batches

    torch.manual_seed(0)
    model = TinyCausalLM(vocab=29, d=32, hidden=64).eval()
    cal = lm_batches([[5, 9, 3, 7], [8, 2, 6, 4], [9, 9, 1, 5]], vocab=29)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = quantize_with(model, config, 4.0, Inputs(calibration=cal, selection=lm_batches([[4, 7, 2]], 29, seed=1)))
    assert out.result.average_bits <= 4.0 and set(out.result.weights) == set(quantizable_layers(model))
    with torch.no_grad():
        z = out.result.model(**cal[0])["logits"]
    assert z.shape == (*cal[0]["input_ids"].shape, 29) and bool(torch.isfinite(z).all())
    kls = out.details.get("variant_kl", {})
    assert all(v >= 0 and v == v for v in kls.values())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
