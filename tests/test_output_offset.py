import copy

import numpy as np
import pytest
import torch
from nets import TinyCausalLM, lm_batches
from scipy.optimize import minimize
from torch import nn

from bayesq.config import BayesQConfig, DistillConfig, QuantConfig
from bayesq.context import FPOutputs, KnownOutputs
from bayesq.evaluation import predict, reference_log_probs
from bayesq.output_offset import SHRINK, fit_output_offset, logit_offset, mean_kl, output_layer
from bayesq.quantize import quantize_model


def _logits(n=60, c=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    fp = 2.0 * torch.randn(n, c, generator=g, dtype=torch.float64)
    q = fp + 0.4 * torch.randn(n, c, generator=g, dtype=torch.float64) + torch.linspace(-0.5, 0.7, c, dtype=torch.float64)
    return fp, q


def _net(seed=0, bias=True):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3, bias=bias)).double().eval()


def _batches(n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 6, generator=g, dtype=torch.float64) for _ in range(n)]


def test_logit_offset_vs_scipy_minimize():
    """The L-BFGS fit of (1) against scipy's BFGS on the same objective (a sum-zero offset), and
    the optimum's defining property: the mean predicted distributions agree."""
    fp, q = _logits()
    c = logit_offset(fp, q)

    def f(x):
        return float(mean_kl(fp, q, torch.as_tensor(x)))

    ref = minimize(f, np.zeros(4), method="BFGS", options={"gtol": 1e-12}).x
    ref = ref - ref.mean()
    np.testing.assert_allclose(c.numpy(), ref, atol=1e-6)
    assert abs(float(c.sum())) < 1e-12
    torch.testing.assert_close(torch.softmax(q + c, -1).mean(0), torch.softmax(fp, -1).mean(0), rtol=0, atol=1e-8)
    assert mean_kl(fp, q, c) < mean_kl(fp, q, torch.zeros(4, dtype=torch.float64))


def test_logit_offset_recovers_a_constant_shift():
    fp, _ = _logits(c=3)
    shift = torch.tensor([0.3, -0.5, 0.2], dtype=torch.float64)
    c = logit_offset(fp, fp - shift)
    torch.testing.assert_close(c, shift - shift.mean(), rtol=0, atol=1e-7)
    assert float(mean_kl(fp, fp - shift, c)) < 1e-12


def test_logit_offset_binary_vs_grid_search():
    """C = 2: (1) is a function of the margin offset alone; a fine grid finds the same minimum."""
    fp, q = _logits(c=2, seed=3)
    c = logit_offset(fp, q)
    grid = torch.linspace(-2, 2, 40001, dtype=torch.float64)
    losses = torch.stack([mean_kl(fp, q, torch.stack([-d / 2, d / 2])) for d in grid])
    assert abs(float(c[1] - c[0]) - float(grid[losses.argmin()])) < 2e-4


def test_logit_offset_bad_input_errors():
    fp, q = _logits()
    with pytest.raises(ValueError, match=r"\(N, C\)"):
        logit_offset(fp, q[:, :3])
    with pytest.raises(ValueError, match="non-finite"):
        logit_offset(fp, torch.where(q > 3, torch.nan, q))


def test_output_layer_finds_the_head_or_says_why_not():
    x = _batches(1)[0]
    assert output_layer(_net(), x) == ("2", "")
    name, why = output_layer(_net(bias=False), x)
    assert name is None and "2 has no bias" in why

    class Scaled(nn.Module):  # a head that transforms the last Linear's output
        def __init__(self):
            super().__init__()
            self.net = _net()

        def forward(self, x):
            return 2 * self.net(x)

    name, why = output_layer(Scaled(), x)
    assert name is None and "transforms it further" in why

    class Dict(nn.Module):  # logits in a dict, as a Hugging Face model returns them
        def __init__(self):
            super().__init__()
            self.body, self.classifier = nn.Linear(6, 5), nn.Linear(5, 2)

        def forward(self, x):
            return {"logits": self.classifier(torch.relu(self.body(x)))}

    assert output_layer(Dict().double(), x) == ("classifier", "")
    lm = TinyCausalLM()
    name, why = output_layer(lm, lm_batches([[5, 7]])[0])
    assert name is None and "not one row of class logits" in why


def test_fit_output_offset_vs_fit_on_predictions():
    """The offset of a perturbed copy is ``SHRINK`` times :func:`logit_offset` of both models'
    logits; applying it lowers the calibration KL to ``kl_after``; neither model is changed by the fit."""
    model, batches = _net(), _batches()
    qmodel = copy.deepcopy(model)
    with torch.no_grad():
        qmodel[0].bias.add_(0.3)
        qmodel[2].weight.mul_(0.9)
    before = [p.clone() for p in qmodel.parameters()]
    off = fit_output_offset(model, qmodel, batches)
    assert all(torch.equal(a, b) for a, b in zip(before, qmodel.parameters()))
    x = torch.cat(batches)
    with torch.no_grad():
        fp, q = model(x), qmodel(x)
    full = logit_offset(fp.float(), q.float())  # float32 logits
    assert SHRINK == 0.5
    torch.testing.assert_close(off.shift, SHRINK * full, rtol=0, atol=1e-12)
    torch.testing.assert_close(fit_output_offset(model, qmodel, batches, shrink=1.0).shift, full, rtol=0, atol=1e-12)
    assert off.layer == "2" and off.kl_after < off.kl_before
    off.apply(qmodel)
    with torch.no_grad():
        assert float(mean_kl(fp, qmodel(x), torch.zeros(3, dtype=torch.float64))) == pytest.approx(off.kl_after, abs=1e-9)
    with pytest.raises(ValueError, match="output_offset: false"):
        fit_output_offset(model, qmodel, [])
    with pytest.raises(ValueError, match=r"shrink .* in \[0, 1\]"):
        fit_output_offset(model, qmodel, batches, shrink=1.5)


def test_half_offset_vs_full_fit_when_the_served_shift_is_a_third_of_calibrations():
    """The reason for ``SHRINK``: the quantised copy shifts the logits by ``s`` on calibration
    inputs and by ``s / 3`` on the inputs it serves (``t = 1/3`` of the module docstring). The
    full fit ``c* = -s`` then raises the served KL above no offset (``t < 1/2``), half of it
    lowers it (``t >= 1/4``), as the quadratic model says: served KL ratio to no offset
    ``1 + ((shrink - t)^2 - t^2) / t^2`` for small shifts."""
    g = torch.Generator().manual_seed(5)
    calibration, served = (3.0 * torch.randn(4000, 3, generator=g, dtype=torch.float64) for _ in range(2))
    s = torch.tensor([0.06, -0.04, -0.02], dtype=torch.float64)
    c = logit_offset(calibration, calibration + s)
    torch.testing.assert_close(c, -s, rtol=0, atol=1e-7)
    zero = torch.zeros(3, dtype=torch.float64)
    none, full, half = (float(mean_kl(served, served + s / 3, o)) for o in (zero, c, SHRINK * c))
    assert full > none > half
    for shrink, got in ((1.0, full), (SHRINK, half)):  # second order in the shift: within a few per cent
        assert got / none == pytest.approx(1 + ((shrink - 1 / 3) ** 2 - (1 / 3) ** 2) / (1 / 3) ** 2, rel=0.05)


def test_fit_output_offset_skipped_without_a_bias():
    model = _net(bias=False)
    off = fit_output_offset(model, copy.deepcopy(model), _batches())
    assert off.layer is None and off.shift is None and "no bias" in off.skipped


def test_quantize_model_output_offset_only_moves_the_output_bias():
    """BayesQ with and without ``quant.output_offset``: the same codes; the models differ only in
    the output layer's bias, by the offset fitted on the calibration inputs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5)).double()
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(16, 32, generator=g, dtype=torch.float64) for _ in range(4)]
    runs = {}
    for on in (True, False):
        cfg = BayesQConfig(budget=3.0, quant=QuantConfig(group_size=32, unit_groups=2, output_offset=on),
                           distill=DistillConfig(max_budget=0))
        runs[on] = quantize_model(model, batches, cfg, progress=False)
    with_, without = runs[True], runs[False]
    assert without.output_offset is None and with_.output_offset.layer == "4"
    for name, qw in with_.weights.items():
        assert torch.equal(qw.codes, without.weights[name].codes)
    a, b = with_.model.state_dict(), without.model.state_dict()
    for key in a:
        if key == "4.bias":
            torch.testing.assert_close(a[key] - b[key], with_.output_offset.shift, rtol=0, atol=1e-12)
        else:
            assert torch.equal(a[key], b[key]), key
    assert with_.output_offset.kl_after <= with_.output_offset.kl_before


def test_fit_output_offset_selection_vs_fit_on_all_batches():
    """Selection inputs join the fit: the offset equals the fit on the calibration and selection
    batches as one set, with the selection logits computed or given (log-probabilities serve as
    logits); given logits of the wrong count are refused."""
    model, cal, sel = _net(), _batches(), _batches(n=3, seed=5)
    qmodel = copy.deepcopy(model)
    with torch.no_grad():
        qmodel[2].weight.mul_(0.8)
        qmodel[0].bias.add_(0.2)
    whole = fit_output_offset(model, qmodel, cal + sel)
    split = fit_output_offset(model, qmodel, cal, selection=sel)
    torch.testing.assert_close(split.shift, whole.shift, rtol=0, atol=1e-12)
    assert split.inputs == whole.inputs == 56 and split.kl_before == pytest.approx(whole.kl_before, abs=1e-12)
    with torch.no_grad():
        fp_lp = [torch.log_softmax(model(b), -1) for b in sel]
        q_lp = [torch.log_softmax(qmodel(b), -1) + 5.0 for b in sel]  # a per-row constant changes nothing
    given = fit_output_offset(model, qmodel, cal, selection=sel, scored_q=q_lp,
                              fp=FPOutputs(model, sel, cal, held_out=True, known=KnownOutputs(fp_lp)))
    torch.testing.assert_close(given.shift, whole.shift, rtol=0, atol=1e-6)  # float32 logits vs float64 log-probs
    assert (whole.shift - fit_output_offset(model, qmodel, cal).shift).abs().max() > 1e-4
    with pytest.raises(ValueError, match="16 rows for 24 selection inputs"):
        fit_output_offset(model, qmodel, cal, selection=sel, scored_q=q_lp[:2])


def test_fit_output_offset_given_calibration_logits_vs_forward_pass():
    """The FP logits on the calibration batches given per batch (as predict gives them) give the
    offset of the forward pass bit for bit; other logits are read (the offset moves); a wrong
    row count is refused."""
    model, cal, sel = _net(), _batches(), _batches(n=3, seed=5)
    qmodel = copy.deepcopy(model)
    with torch.no_grad():
        qmodel[2].weight.mul_(0.8)
    fp = [predict(model, [b]) for b in cal]
    want = fit_output_offset(model, qmodel, cal, selection=sel)
    got = fit_output_offset(model, qmodel, cal, selection=sel,
                            fp=FPOutputs(model, sel, cal, held_out=True, known=KnownOutputs(logits=fp)))
    assert torch.equal(got.shift, want.shift) and got.inputs == want.inputs == 56
    moved = fit_output_offset(model, qmodel, cal, fp=FPOutputs(model, cal, cal, known=KnownOutputs(
        logits=[z + torch.tensor([0.0, 1.0, -1.0]) for z in fp])))
    assert (moved.shift - fit_output_offset(model, qmodel, cal).shift).abs().max() > 0.1
    with pytest.raises(ValueError, match="24 rows for 32 calibration inputs"):
        fit_output_offset(model, qmodel, cal, fp=FPOutputs(model, cal, cal, known=KnownOutputs(logits=fp[:3])))


def test_quantize_model_one_fp_pass_over_the_selection_inputs():
    """The grid selection and the offset's fit share one FP pass over the held-out inputs; with
    the FP outputs given (``known``), none, and the same model bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 5)).double()
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(16, 32, generator=g, dtype=torch.float64) for _ in range(3)]
    held = [torch.randn(16, 32, generator=g, dtype=torch.float64) for _ in range(2)]
    cfg = BayesQConfig(budget=3.0, quant=QuantConfig(group_size=32, unit_groups=2), distill=DistillConfig(max_budget=0))
    seen = []
    hook = model.register_forward_hook(lambda m, i, o: seen.append((m is model, i[0])))
    try:
        def fp_calls(on):
            return sum(top and any(x is b for b in on) for top, x in seen)
        res = quantize_model(model, batches, cfg, progress=False, selection=held)
        assert len(res.selection_kl) == 2 and fp_calls(held) == len(held)  # two grids scored, one FP pass
        seen.clear()
        ref = reference_log_probs(model, held)
        fp = [predict(model, [b]) for b in batches]
        seen.clear()
        given = quantize_model(model, batches, cfg, progress=False, selection=held, known=KnownOutputs(ref, fp))
    finally:
        hook.remove()
    assert fp_calls(held) == 0
    assert torch.equal(given.output_offset.shift, res.output_offset.shift)
    assert all(torch.equal(given.model.state_dict()[k], v) for k, v in res.model.state_dict().items())


def test_quantize_model_offset_fitted_on_calibration_and_selection():
    """With held-out selection inputs, BayesQ's offset is the fit on both input sets of the same
    model without its offset."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 5)).double()
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(16, 32, generator=g, dtype=torch.float64) for _ in range(3)]
    held = [torch.randn(16, 32, generator=g, dtype=torch.float64) for _ in range(2)]
    runs = {}
    for on in (True, False):
        cfg = BayesQConfig(budget=3.0, quant=QuantConfig(group_size=32, unit_groups=2, output_offset=on),
                           distill=DistillConfig(max_budget=0))
        runs[on] = quantize_model(model, batches, cfg, progress=False, selection=held)
    off = runs[True].output_offset
    want = fit_output_offset(model, runs[False].model, batches + held)
    assert off.inputs == 80 and off.layer == "2"
    torch.testing.assert_close(off.shift, want.shift, rtol=0, atol=1e-9)


def test_fit_output_offset_reports_kl_at_least_zero_when_a_shift_is_undone():
    """The given FP logits are three times the model's plus a per-class shift, the quantised
    copy's output layer three times the model's: the offset undoes the shift up to rounding, and
    the float64 sum of the KL's terms then rounds to about -3e-18 on this draw. A KL (>= 0) is
    reported as 0 or more, with the shift recovered."""
    model, batches = _net(31), _batches(seed=31)
    shift = torch.tensor([0.3, -0.5, 0.2], dtype=torch.float64)
    qmodel = copy.deepcopy(model)
    with torch.no_grad():
        qmodel[2].weight.mul_(3)
        qmodel[2].bias.mul_(3)
    fp = [model(x).detach() * 3 + shift for x in batches]
    off = fit_output_offset(model, qmodel, batches, fp=FPOutputs(model, batches, batches, known=KnownOutputs(logits=fp)),
                            shrink=1.0)
    torch.testing.assert_close(off.shift, shift - shift.mean(), rtol=0, atol=1e-7)
    assert off.kl_before > 0.01 and 0.0 <= off.kl_after < 1e-12
    assert off.fitted and not fit_output_offset(_net(bias=False), _net(bias=False), batches).fitted
