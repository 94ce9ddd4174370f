"""The baselines' variant selection: exact costs, feasible variants, the calibration-KL choice."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from nets import AttentionModel, TokenModel
from torch import nn

from bayesq.baselines.activations import InputStats, input_stats
from bayesq.baselines.rtn import rtn_quantize
from bayesq.baselines.select import (
    UniformVariant, check_feasible, encoding_config, given_allocation, layouts, select_best, stats_correction,
    uniform_bits, uniform_variants,
)
from bayesq.blocks import quantizable_layers
from bayesq.config import Granularity, QuantConfig
from bayesq.context import FPOutputs, KnownOutputs
from bayesq.evaluation import mean_kl, reference_log_probs
from bayesq.expected_loss import LossTable
from bayesq.export import read_export, save_export
from bayesq.result import Allocation, QuantizationResult
from bayesq.selection import selection_looks
from bayesq.storage import grid_bits
from flows.params import load_params

CFG = QuantConfig(group_size=16, unit_groups=2)
GROUP_SIZES = (8, 16, 32, 64)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 24), nn.ReLU(), nn.Linear(24, 5)).double()


def _batches(seed=1, n=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 20, generator=g, dtype=torch.float64) for _ in range(n)]


def brute_uniform(model, budget, bits, group_sizes, scale_bits=16, extra=0):
    """b -> (layout, total bits) of the first group size (ascending, then per-channel) whose
    codes + one fp16 scale and b-bit zero-point per group (+ ``extra``) fit ``budget``."""
    ws = [m.weight for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    n = sum(w.numel() for w in ws)
    out = {}
    for b in bits:
        for g in [*sorted(group_sizes), None]:
            total = extra + sum(grid_bits(w.numel(), w.shape[0] if g is None else math.ceil(w.numel() / g), b,
                                          scale_bits) for w in ws)
            if total <= budget * n:
                out[b] = (g, total)
                break
    return out


def variant_name(b, g):
    return f"uniform-{b}-{'channel' if g is None else f'g{g}'}"


def explicit_kl(fp, q, batches):
    """Mean over examples of KL(softmax(fp) || softmax(q)), via torch's kl_div on all inputs at once."""
    x = torch.cat(batches)
    with torch.no_grad():
        return float(F.kl_div(F.log_softmax(q(x), -1), F.log_softmax(fp(x), -1), log_target=True,
                              reduction="batchmean"))


@pytest.mark.parametrize("budget", [2.3, 2.6, 3.0, 3.3, 3.5, 4.0, 4.7])
def test_uniform_variants_smallest_feasible_group_size_vs_brute_force(budget):
    model = _model()
    layers = quantizable_layers(model)
    got = uniform_variants(layers, budget, CFG, GROUP_SIZES)
    want = brute_uniform(model, budget, CFG.bits, GROUP_SIZES)
    assert [v.name for v in got] == [variant_name(b, g) for b, (g, _) in want.items()]
    for v in got:
        assert uniform_bits(layers, v, CFG) == want[v.bits][1] <= budget * 600  # 600 weights


def test_uniform_variant_quantised_at_its_exact_cost():
    model = _model()
    layers = quantizable_layers(model)
    for v in (UniformVariant(3, 8), UniformVariant(2, None)):
        res = rtn_quantize(model, v.granularity, 9.0, v.config(CFG))
        assert res.allocation.total_bits == uniform_bits(layers, v, CFG)
        assert all(set(b) == {v.bits} for b in res.allocation.unit_bits.values())
        assert encoding_config(res, CFG).bits == (v.bits,)
    assert layouts([64, 16, 16]) == [16, 64, None]


def test_select_best_returns_least_calibration_kl():
    model, batches = _model(), _batches()
    budgets = {"b3.3": 3.3, "b3.6": 3.6, "b4.5": 4.5, "b8": 8.0}
    cands = {k: (lambda b=b: rtn_quantize(model, Granularity.GROUP, b, CFG)) for k, b in budgets.items()}
    choice = select_best(cands, model, FPOutputs(model, batches))
    want = {k: explicit_kl(model, build().model, batches) for k, build in cands.items()}
    assert set(choice.kl) == set(want)
    for k in want:
        assert choice.kl[k] == pytest.approx(want[k], rel=1e-9, abs=1e-15)
    assert len(set(want.values())) == len(want)  # distinct, so the argmin is unambiguous
    assert choice.variant == min(want, key=want.get)
    assert choice.result.average_bits == choice.avg_bits[choice.variant] <= budgets[choice.variant]
    assert explicit_kl(model, choice.result.model, batches) == pytest.approx(want[choice.variant], rel=1e-9)


def test_select_best_drops_resolved_worse_after_first_look_vs_scoring_all():
    # 1,024 inputs: a first look of 256; b3.3 is far worse than b8 and is dropped there, b8 again
    # (the same encoding: not resolved worse) is scored on every input and loses the tie
    model, batches = _model(), _batches(n=128)
    budgets = {"b8": 8.0, "b3.3": 3.3, "b8-again": 8.0}
    cands = {k: (lambda b=b: rtn_quantize(model, Granularity.GROUP, b, CFG)) for k, b in budgets.items()}
    choice = select_best(cands, model, FPOutputs(model, batches))
    first = selection_looks(batches)
    assert 0 < first < len(batches)
    full = {k: explicit_kl(model, build().model, batches) for k, build in cands.items()}
    assert choice.inputs == {"b8": 1024, "b3.3": 8 * first, "b8-again": 1024}
    assert choice.kl["b3.3"] == pytest.approx(explicit_kl(model, cands["b3.3"]().model, batches[:first]), rel=1e-9)
    assert full["b3.3"] > full["b8"]
    for k in ("b8", "b8-again"):
        assert choice.kl[k] == pytest.approx(full[k], rel=1e-9, abs=1e-15)
    assert choice.variant == "b8"


def test_select_best_given_reference_vs_its_own_fp_pass():
    from bayesq.evaluation import reference_log_probs

    model, batches = _model(), _batches()
    cands = {k: (lambda b=b: rtn_quantize(model, Granularity.GROUP, b, CFG)) for k, b in {"a": 3.3, "b": 4.5}.items()}
    own = select_best(cands, model, FPOutputs(model, batches))
    given = select_best(cands, model, FPOutputs(model, batches, known=KnownOutputs(reference_log_probs(model, batches))))
    assert given.variant == own.variant and given.kl == own.kl
    other = select_best(cands, model, FPOutputs(model, batches,
                                                known=KnownOutputs(reference_log_probs(model, batches[::-1]))))
    assert all(other.kl[k] != own.kl[k] for k in own.kl)  # the given reference is the one scored against


def _corrected_by_hand(fp, q, batches):
    """Copy of ``q`` whose Linear biases absorb (W - Q) abar, abar the mean input of each layer on
    ``batches`` computed directly from the FP model's activations (float64)."""
    x = torch.cat(batches)
    with torch.no_grad():
        inputs = [x, torch.relu(fp[0](x))]  # what fp[0] and fp[2] read
        out = copy.deepcopy(q)
        for i, a in zip((0, 2), inputs):
            out[i].bias += (fp[i].weight - q[i].weight) @ a.mean(0)
    return out


def test_select_best_with_correction_scores_both_forms_vs_hand_corrected():
    model, batches = _model(), _batches()
    budgets = {"b3.3": 3.3, "b4.5": 4.5}
    cands = {k: (lambda b=b: rtn_quantize(model, Granularity.GROUP, b, CFG)) for k, b in budgets.items()}
    stats = input_stats(model, batches, quantizable_layers(model))
    choice = select_best(cands, model, FPOutputs(model, batches), stats_correction(model, stats, batches))
    want = {}
    for k, build in cands.items():
        q = build().model
        want[k] = explicit_kl(model, q, batches)
        want[f"{k}+bc"] = explicit_kl(model, _corrected_by_hand(model, q, batches), batches)
    assert set(choice.kl) == set(want)
    for k in want:
        assert choice.kl[k] == pytest.approx(want[k], rel=1e-9, abs=1e-15)
    assert want["b3.3+bc"] < want["b3.3"]  # the correction helps here, so the test can tell the forms apart
    assert choice.variant == min(want, key=want.get)
    if choice.variant.endswith("+bc"):
        assert choice.result.correction is not None
        assert explicit_kl(model, choice.result.model, batches) == pytest.approx(want[choice.variant], rel=1e-9)
    # the candidate's own result is not corrected in place
    plain = select_best(cands, model, FPOutputs(model, batches))
    assert set(plain.kl) == set(budgets) and plain.result.correction is None


def test_select_best_kept_plain_form_stays_uncorrected_int64_codes():
    """A correction fitted on other inputs hurts: a plain form wins and comes back as built (its
    model not corrected by its own +bc form's scoring, its codes as the encoder gave them)."""
    model, batches = _model(), _batches()
    cands = {k: (lambda b=b: rtn_quantize(model, Granularity.GROUP, b, CFG)) for k, b in {"a": 3.3, "b": 4.5}.items()}
    skewed = [5.0 * x + 3.0 for x in batches]
    bad = stats_correction(model, input_stats(model, skewed, quantizable_layers(model)), skewed)
    choice = select_best(cands, model, FPOutputs(model, batches), bad)
    want = {k: explicit_kl(model, build().model, batches) for k, build in cands.items()}
    assert not choice.variant.endswith("+bc") and choice.kl[choice.variant] < choice.kl[choice.variant + "+bc"]
    assert explicit_kl(model, choice.result.model, batches) == pytest.approx(want[choice.variant], rel=1e-12)
    assert choice.result.correction is None
    assert all(w.codes.dtype == torch.uint8 for w in choice.result.weights.values())
    built = cands[choice.variant]()
    assert all(torch.equal(built.weights[n].codes, w.codes) for n, w in choice.result.weights.items())


def test_select_best_holds_one_candidate_model_at_a_time():
    """While a candidate is built, no earlier candidate's model is alive (the best one so far is
    kept as its weights); the kept model is made again and scores as the chosen one did."""
    import gc
    import weakref

    model, batches = _model(), _batches()
    alive = []

    def build(b):
        gc.collect()
        assert [r for r in alive if r() is not None] == []
        res = rtn_quantize(model, Granularity.GROUP, b, CFG)
        alive.append(weakref.ref(res.model))
        return res

    stats = input_stats(model, batches, quantizable_layers(model))
    cands = {k: (lambda b=b: build(b)) for k, b in {"a": 4.5, "b": 3.3, "c": 4.0}.items()}
    choice = select_best(cands, model, FPOutputs(model, batches), stats_correction(model, stats, batches))
    assert len(alive) == 3 and choice.variant.split("+")[0] == "a"  # the best was built first
    assert explicit_kl(model, choice.result.model, batches) == pytest.approx(choice.kl[choice.variant], rel=1e-9)


def test_stats_correction_without_means_names_the_fix():
    model, batches = _model(), _batches()
    stats = input_stats(model, batches, quantizable_layers(model))
    no_mean = {n: InputStats(s.H, s.abs_mean, s.n) for n, s in stats.items()}
    with pytest.raises(ValueError, match="no mean input.*input_stats"):
        stats_correction(model, no_mean, batches)
    with pytest.raises(ValueError, match="empty calibration set"):
        stats_correction(model, stats, [])


def _stub(model):
    return QuantizationResult(model, {}, Allocation({}, 10, 5, 10), LossTable(()))


def test_select_best_nan_never_wins_and_ties_keep_first():
    model, batches = _model(), _batches()

    class Nan(nn.Module):
        def forward(self, x):
            return torch.full((x.shape[0], 5), float("nan"), dtype=torch.float64)

    choice = select_best({"nan": lambda: _stub(Nan()), "same": lambda: _stub(model),
                          "same2": lambda: _stub(model)}, model, FPOutputs(model, batches))
    assert choice.variant == "same" and choice.kl["same"] == 0.0 and math.isnan(choice.kl["nan"])


def test_mean_kl_dict_batches_vs_explicit():
    torch.manual_seed(0)
    fp = TokenModel().double()
    q = TokenModel().double()
    g = torch.Generator().manual_seed(3)
    batches = [{"input_ids": torch.randn(4, 3, 5, generator=g, dtype=torch.float64),
                "mask": torch.ones(4, 3, dtype=torch.float64)} for _ in range(2)]
    got = mean_kl(reference_log_probs(fp, batches), q, batches)
    with torch.no_grad():
        p = torch.cat([F.softmax(fp(**b), -1) for b in batches])
        lq = torch.cat([F.log_softmax(q(**b), -1) for b in batches])
    assert got == pytest.approx(float((p * (p.log() - lq)).sum(1).mean()), rel=1e-10)
    assert mean_kl(reference_log_probs(fp, batches), fp, batches) == 0.0


def test_select_best_bad_input_raises():
    model = _model()
    with pytest.raises(ValueError, match="no candidate"):
        select_best({}, model, FPOutputs(model, _batches()))
    with pytest.raises(ValueError, match="empty calibration"):
        select_best({"a": lambda: _stub(model)}, model, FPOutputs(model, []))
    with pytest.raises(ValueError, match=r"infeasible for GPTQ: its cheapest variant needs 2\.1000"):
        check_feasible({}, "GPTQ", 2.0, 2.1)


def test_given_allocation_costs_and_errors():
    model = _model()
    ref = rtn_quantize(model, Granularity.GROUP, 3.5, CFG)
    alloc = given_allocation(ref.table, ref.allocation.unit_bits, 3.5)
    assert (alloc.unit_bits, alloc.total_bits, alloc.budget_bits) == (
        ref.allocation.unit_bits, ref.allocation.total_bits, ref.allocation.budget_bits)
    assert alloc.expected_loss == pytest.approx(ref.allocation.expected_loss, rel=1e-12)
    bits = dict(ref.allocation.unit_bits)
    with pytest.raises(ValueError, match="above the budget"):
        given_allocation(ref.table, bits, 3.0)
    with pytest.raises(ValueError, match="units"):
        given_allocation(ref.table, {**bits, "0": bits["0"][:-1]}, 3.5)
    with pytest.raises(ValueError, match=r"bit-widths \[5\]"):
        given_allocation(ref.table, {**bits, "2": (5,) * len(bits["2"])}, 9.0)


def test_baselines_config_select_and_group_sizes():
    cfg = load_params({}).baselines.config("gptq")
    assert cfg.select is True and cfg.group_sizes == (32, 64, 128, 256)
    p = load_params({"baselines": {"gptq": {"group_sizes": [16, 64], "select": False}}})
    assert p.baselines.config("gptq").group_sizes == (16, 64) and p.baselines.config("gptq").select is False
    assert p.baselines.config("awq").select is True  # one method's section only
    for value in ([], [0, 32], [64, 32], [32, 32], [32.0], "64"):
        with pytest.raises(ValueError, match="baselines.awq: AWQConfig.group_sizes"):
            load_params({"baselines": {"awq": {"group_sizes": value}}})
    with pytest.raises(ValueError, match="baselines.gptq: GPTQConfig.select"):
        load_params({"baselines": {"gptq": {"select": "yes"}}})


@pytest.mark.parametrize("variant", [UniformVariant(3, 8), UniformVariant(2, None)])
def test_encoding_config_exports_exactly_the_accounted_bits(tmp_path, variant):
    model = _model()
    res = rtn_quantize(model, variant.granularity, 9.0, variant.config(CFG))
    path = tmp_path / "q.safetensors"
    info = save_export(path, res.model, res.weights, encoding_config(res, CFG), res.allocation.total_bits)
    assert res.allocation.total_bits <= info.payload_bits < res.allocation.total_bits + 8 * 3 * 2
    for n, q in read_export(path).weights.items():
        assert torch.equal(q.dequantize(), res.weights[n].dequantize())
    with pytest.raises(ValueError, match="accounts"):  # CFG's 4-width bit set would add unit headers
        save_export(tmp_path / "bad.safetensors", res.model, res.weights, CFG, res.allocation.total_bits)


# ---- every baseline: exclusion and the accounting of every weight -------------------------------

BUDGET = 4.0  # group 16: scales and zero-points alone cost about a bit per weight


def _baseline_runs(model, batches, exclude):
    from bayesq.baselines.aciq import aciq_quantize
    from bayesq.baselines.awq import awq_quantize, awq_select
    from bayesq.baselines.gptq import gptq_quantize, gptq_select
    from bayesq.baselines.hawq import hawq_quantize, hessian_traces

    stats = input_stats(model, batches, quantizable_layers(model, tuple(exclude)))
    return {
        "rtn": lambda: rtn_quantize(model, Granularity.GROUP, BUDGET, CFG, exclude=exclude),
        "aciq": lambda: aciq_quantize(model, BUDGET, CFG, exclude=exclude),
        "gptq": lambda: gptq_quantize(model, stats, Granularity.GROUP, BUDGET, CFG, exclude=exclude),
        "gptq_select": lambda: gptq_select(model, stats, batches, BUDGET, CFG, group_sizes=GROUP_SIZES,
                                           bias_correction=True, exclude=exclude).result,
        "awq": lambda: awq_quantize(model, stats, BUDGET, CFG, exclude=exclude),
        "awq_select": lambda: awq_select(model, stats, batches, BUDGET, CFG, group_sizes=GROUP_SIZES,
                                         exclude=exclude).result,
        "hawq": lambda: hawq_quantize(model, hessian_traces(model, batches, probes=2, exclude=exclude), BUDGET, CFG,
                                      exclude=exclude),
    }


@pytest.mark.parametrize("method", ["rtn", "aciq", "gptq", "gptq_select", "awq", "awq_select", "hawq"])
def test_baselines_exclude_lists_every_other_weight(method):
    model = AttentionModel().double().eval()
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 40, (8, 5), generator=g) for _ in range(3)]
    res = _baseline_runs(model, batches, ["attn*"])[method]()
    assert set(res.weights) == {"fc", "head"}
    assert set(res.unquantized) == {"emb.weight", "attn.in_proj_weight", "attn.out_proj.weight"}
    assert "matches exclude" in res.unquantized["attn.out_proj.weight"]
    n_all = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    fp_bits = 64 * (n_all - res.allocation.n_weights)  # float64 model: 64 bits per kept weight
    assert res.average_bits_all == pytest.approx((res.allocation.total_bits + fp_bits) / n_all, rel=1e-12)
    assert res.average_bits <= BUDGET
    x = batches[0]
    assert torch.equal(res.model.attn.in_proj_weight, model.attn.in_proj_weight)
    assert torch.isfinite(res.model(x)).all()


def test_input_stats_unseen_layer_names_exclude():
    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.unused = nn.Linear(4, 3), nn.Linear(5, 5)  # unused: never called in forward

        def forward(self, x):
            return self.fc(x)

    model, x = WithUnused().double().eval(), torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"'unused'.*exclude="):
        input_stats(model, [x])
    assert set(input_stats(model, [x], exclude=["unused"])) == {"fc"}


def test_baseline_layouts_and_costs_under_the_onnxruntime_target():
    """Under a deployment target a baseline's layouts are the target's (the block sizes it runs,
    no per-channel grid; groups row-aligned, one unit per row) and a layout costs what the file
    stores: the sum of the per-row MatMulNBits costs, no row index for one width; an RTN encoding
    there exports as MatMulNBits with those bytes, to the bit."""
    from bayesq.baselines.rtn import rtn_blocks
    from bayesq.blocks import layer_blocks
    from bayesq.config import AllocationUnit
    from bayesq.targets import matmulnbits_unit_cost_bits

    q = QuantConfig(unit=AllocationUnit.CHANNEL).for_target("onnxruntime", block=16)
    assert layouts([8, 16, 32, 48], q) == [16, 32]
    model = _model()
    layers = quantizable_layers(model)
    blocks = rtn_blocks(layer_blocks(layers, q.group_size, q.unit_groups), Granularity.CHANNEL, q)
    assert all(lb.row_aligned and lb.group_size == 16 and lb.unit_groups == lb.groups_per_row for lb in blocks)
    per_layer = QuantConfig().for_target("onnxruntime", block=16)  # the target's default: one unit per layer
    blocks = rtn_blocks(layer_blocks(layers, 16, per_layer.unit_groups), Granularity.CHANNEL, per_layer)
    assert all(lb.row_aligned and lb.n_units == 1 and lb.unit_rows == lb.shape[0] for lb in blocks)
    v = UniformVariant(4, 16)
    want = sum(m.weight.shape[0] * matmulnbits_unit_cost_bits(-(-m.weight.shape[1] // 16), 4, 16, 1)
               for m in layers.values())
    assert uniform_bits(layers, v, q) == want
    res = rtn_quantize(model, Granularity.GROUP, 12.0, v.config(q))  # 20- and 24-weight rows padded to 32
    assert res.allocation.total_bits == want
    pytest.importorskip("onnxruntime")
    import tempfile

    from bayesq.onnx_export import export_onnx

    with tempfile.TemporaryDirectory() as tmp:
        ex = export_onnx(res.model.float(), res.weights, torch.randn(2, 20), f"{tmp}/m.onnx")
    assert set(ex.quantized) == set(layers) and ex.quantized_bits == want
