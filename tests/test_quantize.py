import math

import pytest
import torch
from nets import AttentionModel
from torch import nn

from bayesq import BayesQConfig, QuantConfig, quantize_model
from bayesq.baselines.rtn import rtn_quantize
from bayesq.config import DistillConfig, Granularity
from bayesq.context import FPOutputs, KnownOutputs
from bayesq.quantize import fit_posterior
from bayesq.settings import replace


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1, groups=32),
        nn.ReLU(), nn.Flatten(), nn.Linear(32 * 6 * 6, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def _calibration(n_batches=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 3, 6, 6, generator=g) for _ in range(n_batches)]


CFG = QuantConfig(group_size=32, unit_groups=2)


@pytest.mark.parametrize("budget", [3.0, 3.5, 4.0])
def test_quantize_model_lands_within_budget(budget):
    res = quantize_model(_model(), _calibration(), BayesQConfig(budget=budget, quant=CFG), progress=False)
    assert budget - 0.02 <= res.average_bits <= budget
    assert res.allocation.total_bits <= res.allocation.budget_bits


def test_quantize_model_weights_rebuilt_from_codes_only():
    model = _model()
    res = quantize_model(model, _calibration(), BayesQConfig(budget=3.0, quant=CFG), progress=False)
    qmods = dict(res.model.named_modules())
    for name, qw in res.weights.items():
        w_hat = torch.zeros(qw.codes.shape, dtype=torch.float64)
        for b, grids in qw.books.items():
            sel = qw.group_bits == b
            w_hat[sel] = grids.scale[:, None] * (qw.codes[sel].double() - grids.zero[:, None])
        rebuilt = w_hat.reshape(-1)[: qw.blocks.numel].reshape(qw.blocks.shape)
        assert torch.equal(qmods[name].weight.detach().double(), rebuilt.float().double())
        assert not torch.equal(qmods[name].weight, dict(model.named_modules())[name].weight)
        levels = 2 ** qw.group_bits
        assert ((qw.codes >= 0) & (qw.codes < levels[:, None])).all()


def test_quantize_model_accounting_matches_storage_formula():
    res = quantize_model(_model(), _calibration(), BayesQConfig(budget=3.5, quant=CFG), progress=False)
    total = 0
    for qw in res.weights.values():
        lb = qw.blocks
        for u, (s, e) in enumerate(lb.unit_group_ranges()):
            b = res.allocation.unit_bits[lb.name][u]
            n = min(e * lb.group_size, lb.numel) - s * lb.group_size
            total += n * b + (e - s) * (16 + b) + 2
    assert total == res.allocation.total_bits


def test_bayesq_beats_rtn_on_its_own_objective():
    # The deployed objective 0.5 sum h (Q(mu) - mu)^2 (h: the data curvature) is what BayesQ
    # minimises; RTN's allocation and grids, costed by the same formula from the dequantised
    # weights at the same budget and layout, must not do better (distillation is off).
    # Nearest rounding: the codes the table's entries are of (error feedback changes them).
    model = _model()
    q = replace(CFG, rounding="nearest")
    res = quantize_model(model, _calibration(), BayesQConfig(budget=3.0, quant=q, distill=DistillConfig(max_budget=0)),
                         progress=False, keep_posterior=True)
    rtn = rtn_quantize(model, Granularity.GROUP, 3.0, CFG)
    assert rtn.allocation.total_bits <= res.allocation.budget_bits
    post = res.posterior

    def expected(weights):
        return sum(0.5 * (post.data_precision(n) * (w.dequantize().double() - post.mean[n]).pow(2)).sum().item()
                   for n, w in weights.items())

    assert expected(res.weights) < expected(rtn.weights)
    assert expected(res.weights) == pytest.approx(
        sum(t.unit_loss.gather(1, torch.tensor([t.bits.index(b) for b in res.allocation.unit_bits[t.blocks.name]])[:, None]).sum().item()
            for t in res.table.layers), rel=1e-6)


def test_quantize_model_infeasible_budget_names_minimum():
    with pytest.raises(ValueError, match=r"infeasible: the cheapest encoding .* needs 2\.\d+ bits"):
        quantize_model(_model(), _calibration(), BayesQConfig(budget=2.0, quant=CFG), progress=False)


def test_quantize_model_empty_calibration_raises():
    with pytest.raises(ValueError, match="empty calibration set"):
        quantize_model(_model(), [], BayesQConfig(quant=CFG), progress=False)


def test_quantize_model_nan_weights_raise_naming_layer():
    model = _model()
    with torch.no_grad():
        model[5].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="layer '5' has 1 non-finite"):
        quantize_model(model, _calibration(), BayesQConfig(quant=CFG), progress=False)


class _DictOut(nn.Module):
    """Returns {"logits": ...} and carries a BatchNorm, like many user models."""

    def __init__(self):
        super().__init__()
        self.body = _model()
        self.norm = nn.BatchNorm1d(10)

    def forward(self, x):
        return {"logits": self.norm(self.body(x))}


def test_quantize_model_leaves_the_users_model_as_it_came():
    """Train mode, frozen and trainable weights and their .grad survive; float64 (inputs,
    labels) batches and a dict output are read; the quantised copy matches the tensor-batch run."""
    model = _DictOut().train()
    model.body[0].weight.requires_grad_(False)
    model(_calibration(1)[0])["logits"].sum().backward()
    before = {n: (p.requires_grad, None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
    cfg = BayesQConfig(budget=3.0, quant=CFG)
    labelled = [(b.double(), torch.zeros(len(b), dtype=torch.long)) for b in _calibration()]
    res = quantize_model(model, labelled, cfg, progress=False)
    assert model.training and all(m.training for m in model.modules())
    for n, p in model.named_parameters():
        assert p.requires_grad == before[n][0]
        assert (p.grad is None) == (before[n][1] is None) and (p.grad is None or torch.equal(p.grad, before[n][1]))
    model.eval()
    again = quantize_model(model, _calibration(), cfg, progress=False)  # the float32 tensor batches themselves
    assert res.allocation.unit_bits == again.allocation.unit_bits


def test_quantize_model_non_finite_inputs_and_buffers_named():
    bad = _calibration()
    bad[1][0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="calibration batch 1 holds 1 NaN/Inf"):
        quantize_model(_model(), bad, BayesQConfig(quant=CFG), progress=False)
    model = _DictOut().eval()
    model.norm.running_var[3] = float("nan")
    with pytest.raises(ValueError, match="'norm.running_var' has 1 non-finite"):
        quantize_model(model, _calibration(), BayesQConfig(quant=CFG), progress=False)


def test_quantize_model_unreadable_output_names_its_type():
    class Text(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return "label"

    with pytest.raises(TypeError, match="the model returned a str"):
        quantize_model(Text(), [torch.randn(2, 4)], BayesQConfig(quant=CFG), progress=False)


def test_quantize_model_budget_that_does_not_bind_warns_and_says_so():
    with pytest.warns(UserWarning, match="budget of 9.0 bits/weight does not bind: every unit at its widest"):
        res = quantize_model(_model(), _calibration(), BayesQConfig(budget=9.0, quant=CFG), progress=False)
    assert not res.allocation.binding and res.allocation.average_bits < 9.0


def test_rtn_single_width_slack_budget_records_without_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one width per unit (a baseline's uniform variant): nothing to trade
        res = rtn_quantize(_model(), Granularity.GROUP, 6.0, replace(CFG, bits=(3,)))
    assert not res.allocation.binding
    assert quantize_model(_model(), _calibration(), BayesQConfig(budget=4.0, quant=CFG), progress=False).allocation.binding


def test_quantize_model_exclude_globs_and_every_weight_accounted():
    model = AttentionModel().eval()
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 40, (8, 5), generator=g) for _ in range(3)]
    res = quantize_model(model, batches, BayesQConfig(budget=3.0, quant=CFG), progress=False, exclude=["attn*"])
    assert set(res.weights) == {"fc", "head"}
    assert set(res.unquantized) == {"emb.weight", "attn.in_proj_weight", "attn.out_proj.weight"}
    assert res.unquantized["emb.weight"].startswith("embedding")
    assert "matches exclude" in res.unquantized["attn.out_proj.weight"]
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    n_all = sum(p.numel() for p in matrices)
    fp_bits = 32 * (n_all - res.allocation.n_weights)
    assert res.allocation.n_weights == model.fc.weight.numel() + model.head.weight.numel()
    assert res.average_bits_all == pytest.approx((res.allocation.total_bits + fp_bits) / n_all, rel=1e-12)
    assert res.average_bits <= 3.0 < res.average_bits_all
    post = fit_posterior(model, batches, BayesQConfig(quant=CFG), progress=False, exclude=["attn*"])
    assert set(post.mean) == {"fc", "head"}  # the excluded module never ran as a module: nothing to fit
    again = quantize_model(model, batches, BayesQConfig(budget=3.0, quant=CFG), progress=False, exclude=["attn*"],
                           posterior=post)
    assert all(torch.equal(again.weights[k].dequantize(), res.weights[k].dequantize()) for k in res.weights)


def test_quantize_model_unsupported_layer_raises():
    model = nn.Sequential(nn.Conv3d(3, 4, 3), nn.Flatten(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="unsupported layer '0' \\(Conv3d\\).*exclude"):
        quantize_model(model, [torch.randn(2, 3, 3, 3, 3)], BayesQConfig(), progress=False)


@pytest.mark.parametrize("granularity", list(Granularity))
def test_rtn_quantize_within_budget(granularity):
    res = rtn_quantize(_model(), granularity, 4.0, CFG)
    assert res.average_bits <= 4.0
    if granularity != Granularity.TENSOR:  # per-tensor units are whole layers: coarse steps
        assert res.average_bits >= 4.0 - 0.02


# ---- every option of the method, end to end ---------------------------------------------------

from bayesq.config import (
    AllocationConfig, AllocationUnit, Allocator, Codebook, Curvature, PosteriorConfig, Proxy, Rounding, Whitening,
)
from bayesq.grids import UniformGrids
from bayesq.levels import LevelTables
from bayesq.vq import VQBook  # noqa: E402

BIG = QuantConfig(group_size=32, unit_groups=8)
VARIANTS = {
    **{f"curvature={c.value}": dict(posterior=PosteriorConfig(curvature=c)) for c in Curvature},
    **{f"codebook={c.value}": dict(quant=QuantConfig(group_size=32, unit_groups=8, codebook=c, rounding="nearest"))
       for c in Codebook if c != Codebook.VQ},
    **{f"unit={u.value}": dict(quant=QuantConfig(group_size=32, unit_groups=8, unit=u)) for u in AllocationUnit},
    **{f"whitening={w.value}": dict(quant=QuantConfig(group_size=32, unit_groups=8, whitening=w)) for w in Whitening},
    **{f"allocator={a.value}": dict(allocation=AllocationConfig(allocator=a)) for a in Allocator if a != Allocator.DP},
    "allocator=dp,unit=tensor": dict(quant=QuantConfig(group_size=32, unit_groups=8, unit="tensor"),
                                     allocation=AllocationConfig(allocator="dp")),
    "rounding=error-feedback,kfac": dict(posterior=PosteriorConfig(curvature="kfac"),
                                         quant=QuantConfig(group_size=32, unit_groups=8, rounding="error-feedback")),
    "feedback_table": dict(quant=QuantConfig(group_size=32, unit_groups=8, feedback_table=True)),
    "feedback_table,kfac": dict(posterior=PosteriorConfig(curvature="kfac"),
                                quant=QuantConfig(group_size=32, unit_groups=8, feedback_table=True)),
    "cd_passes,minmax,no-refit": dict(quant=QuantConfig(group_size=32, unit_groups=8, cd_passes=2, min_range_ratio=1.0,
                                                         refit=False, feedback_table=True)),
    "rounding=nearest": dict(quant=QuantConfig(group_size=32, unit_groups=8, rounding="nearest")),
    "proxy=mc-kl": dict(quant=QuantConfig(group_size=32, unit_groups=8, proxy="mc-kl", mc_examples=8,
                                          mc_top_fraction=0.5)),
    "proxy=mc-output": dict(posterior=PosteriorConfig(curvature="kfac"),
                            quant=QuantConfig(group_size=32, unit_groups=8, proxy="mc-output", mc_top_fraction=0.5)),
    "codebook=vq": dict(quant=QuantConfig(group_size=32, unit_groups=8, unit="tensor", codebook="vq", vq_dim=2, rounding="nearest")),
    "floors": dict(allocation=AllocationConfig(floors={"7": 8, "0": 4})),
    "latency": dict(allocation=AllocationConfig(latency=True)),
    "penalty": dict(allocation=AllocationConfig(penalty=0.5)),
}


def _recount_bits(weights, quant: QuantConfig) -> int:
    """Storage of the encoded layers from the stored codebooks alone (independent of the tables)."""
    total, header = 0, 2  # four candidate bit-widths
    for qw in weights.values():
        lb = qw.blocks
        sizes = lb.group_sizes()
        for s, e in lb.unit_group_ranges():
            b = int(qw.group_bits[s])
            assert (qw.group_bits[s:e] == b).all()  # one bit-width per unit
            n, g = int(sizes[s:e].sum()), e - s
            book = qw.books[b]
            if isinstance(book, VQBook):
                d = book.dim
                total += -(-n // d) * b * d + 2 ** (b * d) * d * 16
            elif isinstance(book, UniformGrids):
                total += n * b + g * (16 + b)
            elif quant.codebook == Codebook.MULAW:
                total += n * b + g * 16
            else:
                k = int((qw.group_bits[:s] == b).sum())  # the unit's first row among the width-b groups
                assert isinstance(book, LevelTables) and len(set(book.row[k:k + g].tolist())) == 1  # one LUT per unit
                total += n * b + 2**b * 16
            total += header
    return total


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_quantize_model_every_option_within_budget_and_accounted(variant):
    kw = dict(VARIANTS[variant])
    kw.setdefault("quant", BIG)
    model = _model()
    # distillation (on at 3.5 bits) runs on every option, shortened: it must keep codes and bits
    res = quantize_model(model, _calibration(), BayesQConfig(budget=3.5, distill=DistillConfig(max_budget=3.5, steps=20),
                                                             **kw),
                         progress=False)
    assert res.allocation.total_bits <= res.allocation.budget_bits
    assert _recount_bits(res.weights, kw["quant"]) == res.allocation.total_bits
    floors = kw.get("allocation", AllocationConfig()).floors
    qmods = dict(res.model.named_modules())
    for name, qw in res.weights.items():
        per_code = torch.tensor([qw.books[int(b)].dim if isinstance(qw.books[int(b)], VQBook) else 1
                                 for b in qw.group_bits])  # weights per code
        assert ((qw.codes >= 0) & (qw.codes < 2 ** (qw.group_bits * per_code)[:, None])).all()
        assert torch.equal(qmods[name].weight.detach(), qw.dequantize().float())
        assert min(res.allocation.unit_bits[name]) >= floors.get(name, 0)
    if variant == "penalty":
        assert res.average_bits < 3.4  # the regularised allocation stops short of the budget


def test_error_feedback_lowers_kfac_cost_vs_nearest_rounding():
    # Same table and allocation; error feedback is the sequential (greedy) minimiser of the
    # deployed data cost tr(D A D^T) per row for the fixed grids (A: the undamped K-FAC input
    # factor): not optimal per layer, but it must not lose more than a hair anywhere and must
    # win clearly overall.
    model = _model()
    cfg = BayesQConfig(budget=3.0, posterior=PosteriorConfig(curvature="kfac"), quant=BIG)
    res = quantize_model(model, _calibration(), cfg, progress=False, keep_posterior=True)
    from bayesq.curvature.kfac import kfac_whitened_cost
    from bayesq.rounding import ef_column_metric, encode

    weights = {n: m.weight for n, m in dict(model.named_modules()).items() if n in res.weights}
    near = encode(res.table, res.allocation, weights, rounding=Rounding.NEAREST)
    ef = encode(res.table, res.allocation, weights, posterior=res.posterior, rounding=Rounding.ERROR_FEEDBACK,
                column_metric=ef_column_metric(res.posterior, replace(BIG, rounding="error-feedback")))
    totals = {"near": 0.0, "ef": 0.0}
    for name, A in res.posterior.input_moment.items():
        w = res.posterior.mean[name]
        eye = torch.eye(w.shape[0], dtype=torch.float64)
        cost = {k: float(kfac_whitened_cost((q[name].dequantize() - w).reshape(w.shape[0], -1), A, eye))
                for k, q in (("near", near), ("ef", ef))}
        assert cost["ef"] <= cost["near"] * 1.01, name
        for k in totals:
            totals[k] += cost[k]
    assert totals["ef"] < 0.95 * totals["near"]


def test_quantize_model_vq_and_error_feedback_need_their_settings():
    with pytest.raises(ValueError, match="error feedback needs uniform grids; codebook is 'lloyd': set quant.rounding: nearest"):
        QuantConfig(codebook="lloyd")  # error feedback is the default
    with pytest.raises(ValueError, match="mc-output.*K-FAC factors"):
        BayesQConfig(quant=QuantConfig(proxy="mc-output"))
    with pytest.raises(ValueError, match="set quant.unit: tensor"):
        QuantConfig(codebook="vq", rounding="nearest")
    with pytest.raises(ValueError, match="mc_samples = 7.*even number"):
        QuantConfig(mc_samples=7)
    with pytest.raises(ValueError, match="latency-aware density works with allocator greedy"):
        AllocationConfig(latency=True, allocator="dp")
    with pytest.raises(ValueError, match="allocation.floors"):
        AllocationConfig(floors={"fc": 0})


def test_quantize_model_pca_needs_calibration_data_and_floor_beyond_candidates_is_clear():
    from bayesq.assignment import allocate
    from bayesq.blocks import layer_blocks, quantizable_layers
    from bayesq.quantize import fit_posterior
    from bayesq.tables import build_table

    model = _model()
    post = fit_posterior(model, _calibration(), BayesQConfig(), progress=False)
    blocks = layer_blocks(quantizable_layers(model), 32, 8)
    with pytest.raises(ValueError, match="pass model= and calibration="):
        build_table(post, blocks, QuantConfig(group_size=32, unit_groups=8, whitening="pca"), progress=False)
    table = build_table(post, blocks, BIG, progress=False, model=model, calibration=_calibration())
    with pytest.raises(ValueError, match="asks layer '7' for at least 16 bits but the candidates are \\[2, 3, 4, 8\\]"):
        allocate(table, 3.0, AllocationConfig(floors={"7": 16}))


def test_loss_reduction_curve_vs_hand_computed_greedy_sequence():
    # One layer, two units of 10 weights, candidates 2/3/4 bits costing exactly 10 b bits (no
    # scales; a hand-made table). Densities: unit 0: 2->3 gains 6, 3->4 gains 2; unit 1: 2->3
    # gains 3, 3->4 gains 1 (per 10 bits). Greedy order: u0 (6), u1 (3), u0 (2), u1 (1).
    from bayesq.assignment import loss_reduction_curve, min_bits
    from bayesq.blocks import LayerBlocks
    from bayesq.expected_loss import LayerTable, LossTable

    loss = torch.tensor([[10.0, 4.0, 2.0], [5.0, 2.0, 1.0]], dtype=torch.float64)
    cost = torch.tensor([[20, 30, 40], [20, 30, 40]], dtype=torch.int64)
    lb = LayerBlocks("l", (20,), 10, 1)
    table = LossTable((LayerTable(lb, (2, 3, 4), loss, cost, (), torch.zeros_like(loss)),))
    assert min_bits(table) == 40
    # at 4 bits/weight (80 bits) everything is taken: total drop 15 - 3 = 12; spending 20% of
    # the 40 extra bits (8) buys nothing yet, 40% (16 bits) buys u0 2->3 (6 of 12), 60% (24)
    # also u1 2->3 (9 of 12), 80% (32) also u0 3->4 (11 of 12)
    curve = loss_reduction_curve(table, 4.0, fractions=(0.2, 0.4, 0.6, 0.8, 1.0))
    assert curve == pytest.approx({0.2: 0.0, 0.4: 0.5, 0.6: 0.75, 0.8: 11 / 12, 1.0: 1.0})


def test_grid_candidates_add_minmax_only_to_searched_error_feedback_grids():
    from bayesq.tables import grid_candidates

    both = grid_candidates(QuantConfig())
    assert list(both) == ["searched", "minmax"]
    assert both["minmax"].min_range_ratio == 1.0 and not both["minmax"].refit and not both["minmax"].select_grids
    assert list(grid_candidates(QuantConfig(rounding="nearest"))) == ["searched"]
    assert list(grid_candidates(QuantConfig(min_range_ratio=1.0))) == ["minmax"]
    assert list(grid_candidates(QuantConfig(select_grids=False))) == ["searched"]


def test_grid_candidates_other_range_search_instead_of_minmax_when_scored_held_out():
    from bayesq.tables import grid_candidates

    held = grid_candidates(QuantConfig(), held_out=True)
    assert list(held) == ["searched", "searched-plain"]
    assert held["searched-plain"] == replace(QuantConfig(), feedback_search=False)
    plain = grid_candidates(QuantConfig(feedback_search=False), held_out=True)
    assert list(plain) == ["searched", "searched-gained"]
    assert list(grid_candidates(QuantConfig(feedback_table=False), held_out=True)) == ["searched", "minmax"]
    assert list(grid_candidates(QuantConfig(select_grids=False), held_out=True)) == ["searched"]


@pytest.mark.parametrize("held_out,n_batches", [(False, 2), (True, 2), (True, 16)])  # 16 x 40 inputs: two looks
def test_encode_best_keeps_anchor_unless_resolved_vs_building_each_candidate(held_out, n_batches):
    from bayesq.assignment import allocate
    from bayesq.baselines.activations import input_stats
    from bayesq.blocks import layer_blocks, quantizable_layers
    from bayesq.comparison import kl_per_example, paired_difference
    from bayesq.evaluation import predict
    from bayesq.quantize import fit_posterior
    from bayesq.result import quantized_copy
    from bayesq.rounding import bias_correction, ef_column_metric, encode
    from bayesq.selection import encode_best
    from bayesq.tables import build_table, grid_candidates

    torch.manual_seed(0)
    model, batches = _model(), _calibration()
    q = QuantConfig(group_size=32, unit_groups=8)
    post = fit_posterior(model, batches, BayesQConfig(quant=q), progress=False)
    blocks = layer_blocks(quantizable_layers(model), 32, 8)
    metric = ef_column_metric(post, q, model, batches)
    correction = bias_correction(model, input_stats(model, batches, quantizable_layers(model)), batches)
    weights = {n: m.weight for n, m in quantizable_layers(model).items()}
    g = torch.Generator().manual_seed(2)
    size = 40 if n_batches > 2 else 8
    selection = [torch.randn(size, 3, 6, 6, generator=g) for _ in range(n_batches)] if held_out else None
    scored = selection or batches
    fp, per, codes = predict(model, scored).double(), {}, {}
    cands = grid_candidates(q, held_out=held_out)
    anchor = "searched" if held_out else "minmax"  # min/max when built, else q's own grids
    assert len(cands) == 2 and anchor in cands
    for name, cq in cands.items():
        t = build_table(post, blocks, cq, model=model, calibration=batches, progress=False, column_metric=metric)
        qw = encode(t, allocate(t, 3.0), weights, posterior=post, rounding=cq.rounding, column_metric=metric,
                    act_order=cq.act_order, refit=cq.refit, cd_passes=cq.cd_passes)
        per[name] = kl_per_example(fp, predict(quantized_copy(model, qw, correction), scored).double())
        codes[name] = qw
    # the rule by hand: the anchor unless the other's paired 95 % interval against it lies below zero,
    # first on the first look's inputs (>= 256 of 640: 7 batches), where one resolved worse stops
    first = 280 if n_batches > 2 else len(per[anchor])
    early = {k: paired_difference(v[:first], per[anchor][:first]) for k, v in per.items() if k != anchor}
    if early and all(d.ci_low > 0 for d in early.values()) and first < len(per[anchor]):
        per = {k: v[:first] for k, v in per.items()}
    kl = {k: float(v.mean()) for k, v in per.items()}
    margin = {k: paired_difference(v, per[anchor]) for k, v in per.items() if k != anchor}
    admitted = {k: kl[k] for k, d in margin.items() if d.ci_high < 0}
    want = min(admitted, key=admitted.get) if admitted else anchor
    table = build_table(post, blocks, q, model=model, calibration=batches, progress=False, column_metric=metric)
    enc = encode_best(model, post, table, q, 3.0, calibration=batches, column_metric=metric, selection=selection)
    assert dict(enc.selection_kl) == pytest.approx(kl, rel=1e-6)
    assert dict(enc.selection_inputs) == {k: len(v) for k, v in per.items()}
    assert enc.name == want
    assert set(enc.selection_margin) == set(margin)
    for k, d in margin.items():
        assert enc.selection_margin[k] == pytest.approx((d.ci_low, d.ci_high), rel=1e-6, abs=1e-12)
    for name, qw in enc.weights.items():
        assert torch.equal(qw.codes, codes[enc.name][name].codes)
    res = quantize_model(model, batches, BayesQConfig(budget=3.0, quant=q, distill=DistillConfig(max_budget=0)),
                         posterior=post, progress=False, selection=selection)
    assert res.encoding == enc.name and dict(res.selection_kl) == pytest.approx(kl, rel=1e-6)
    if held_out:
        with pytest.raises(ValueError, match="selection= is empty"):
            encode_best(model, post, table, q, 3.0, calibration=batches, selection=[])


@pytest.mark.parametrize("layout", ["group", "channel"])
def test_encode_row_chunks_vs_whole_layer(monkeypatch, capsys, layout):
    """Error feedback, coordinate descent and the refit row chunk by row chunk (a layer larger than
    ENCODE_ROW_ELEMENTS): the same codes and scales as the whole layer at once. The first layer's
    rows hold whole groups (its refit's normal equations are built chunk by chunk), the last one's
    do not (refitted whole)."""
    import bayesq.rounding as rd
    from bayesq.assignment import allocate
    from bayesq.blocks import layer_blocks, quantizable_layers
    from bayesq.quantize import fit_posterior
    from bayesq.rounding import ef_column_metric, encode
    from bayesq.tables import build_table

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 37), nn.ReLU(), nn.Linear(37, 5)).double().eval()
    batches = [torch.randn(16, 48, dtype=torch.float64) for _ in range(3)]
    q = QuantConfig(group_size=16, unit_groups=2, unit=layout)
    post = fit_posterior(model, batches, BayesQConfig(quant=q), progress=False)
    blocks = layer_blocks(quantizable_layers(model), 16, 2, layout)
    metric = ef_column_metric(post, q, model, batches)
    table = build_table(post, blocks, q, model=model, calibration=batches, progress=False, column_metric=metric)
    alloc = allocate(table, 4.0)
    weights = {n: m.weight for n, m in quantizable_layers(model).items()}
    opts = dict(rounding=q.rounding, column_metric=metric, act_order=True, refit=True, cd_passes=2)
    whole = encode(table, alloc, weights, **opts)
    plain = encode(table, alloc, weights, **{**opts, "refit": False})
    assert not torch.equal(whole["0"].dequantize(), plain["0"].dequantize())  # the refit moved scales
    monkeypatch.setattr(rd, "ENCODE_ROW_ELEMENTS", 3 * 48)
    assert len(rd.row_chunks(37, 48, metric["0"])) == 13
    chunked = encode(table, alloc, weights, **opts, progress=True)
    assert "0/13" in capsys.readouterr().err  # the chunked layer shows its own bar over its 13 chunks
    for name, qw in whole.items():
        assert torch.equal(chunked[name].codes, qw.codes), name
        assert torch.equal(chunked[name].dequantize(), qw.dequantize()), name


@pytest.mark.parametrize("chunk", [None, 2 * 16 * 1152])  # the 64-row Linear in 4 chunks
def test_encode_layer_candidates_vs_one_call_each(monkeypatch, chunk):
    """Two candidates' rows stacked in one rounding call (a dense and a depthwise convolution,
    whose rows are stacked group by group, and Linear layers, also row chunk by row chunk): the
    codes and scales of encoding each candidate on its own."""
    import bayesq.rounding as rd
    from bayesq.assignment import allocate
    from bayesq.blocks import layer_blocks, quantizable_layers
    from bayesq.quantize import fit_posterior
    from bayesq.rounding import ef_column_metric, encode_layer, encode_layer_candidates
    from bayesq.tables import build_table, grid_candidates

    model, batches = _model().double(), [b.double() for b in _calibration()]
    q = QuantConfig(group_size=16, unit_groups=2)
    post = fit_posterior(model, batches, BayesQConfig(quant=q), progress=False)
    layers = quantizable_layers(model)
    blocks = layer_blocks(layers, 16, 2)
    metric = ef_column_metric(post, q, model, batches)
    tables = [build_table(post, blocks, cq, model=model, calibration=batches, progress=False, column_metric=metric)
              for cq in grid_candidates(q, held_out=True).values()]
    allocs = [allocate(tables[0], 3.5), allocate(tables[1], 4.0)]
    if chunk:
        monkeypatch.setattr(rd, "ENCODE_ROW_ELEMENTS", chunk)
        assert len(rd.row_chunks(64, 1152, metric["5"], copies=2)) == 4
    opts = dict(rounding=q.rounding, act_order=True, refit=True, cd_passes=2)
    for name, layer in layers.items():
        parts = [(t.layer(name), a.unit_bits[name]) for t, a in zip(tables, allocs)]
        both = encode_layer_candidates(parts, layer.weight, metric[name], **opts)
        for (t, bits), got in zip(parts, both):
            alone = encode_layer(t, bits, layer.weight, metric[name], **opts)
            assert torch.equal(got.codes, alone.codes), name
            assert torch.equal(got.dequantize(), alone.dequantize()), name
    assert not torch.equal(both[0].codes, both[1].codes)  # the candidates differ: stacking has something to mix up


def test_encode_best_given_stats_vs_its_own_statistics_pass():
    from bayesq.baselines.activations import input_stats
    from bayesq.blocks import layer_blocks, quantizable_layers
    from bayesq.quantize import fit_posterior
    from bayesq.selection import encode_best
    from bayesq.tables import build_table

    torch.manual_seed(0)
    model, batches = _model(), _calibration()
    q = QuantConfig(group_size=32, unit_groups=8)
    post = fit_posterior(model, batches, BayesQConfig(quant=q), progress=False)
    table = build_table(post, layer_blocks(quantizable_layers(model), 32, 8), q, model=model, calibration=batches,
                        progress=False)
    stats = input_stats(model, batches, quantizable_layers(model))
    own = encode_best(model, post, table, q, 3.0, calibration=batches)
    given = encode_best(model, post, table, q, 3.0, calibration=batches, stats=stats)
    assert given.name == own.name and dict(given.selection_kl) == dict(own.selection_kl)
    for name, qw in own.weights.items():
        assert torch.equal(given.weights[name].codes, qw.codes)
    some = {k: v for k, v in list(stats.items())[1:]}
    with pytest.raises(ValueError, match="input statistics given lack layers"):
        encode_best(model, post, table, q, 3.0, calibration=batches, stats=some)


def test_quantize_model_returns_the_posterior_only_when_asked():
    from bayesq.quantize import fit_posterior

    torch.manual_seed(0)
    model, batches = _model(), _calibration()
    cfg = BayesQConfig(budget=3.0, quant=CFG)
    plain = quantize_model(model, batches, cfg, progress=False)
    kept = quantize_model(model, batches, cfg, progress=False, keep_posterior=True)
    assert plain.posterior is None
    fitted = fit_posterior(model, batches, cfg, progress=False)
    assert set(kept.posterior.curvature) == set(plain.weights)
    for name, h in fitted.curvature.items():
        assert torch.equal(kept.posterior.curvature[name], h)
    for name, qw in plain.weights.items():  # the same encoding either way
        assert torch.equal(kept.weights[name].codes, qw.codes)


def test_encode_candidates_consuming_the_metric_vs_encode_best():
    # quantize_model's two steps (the metric released layer by layer, then the selection) keep the
    # same candidate with the same codes and selection KL as encode_best, and free every moment
    from bayesq.blocks import layer_blocks, quantizable_layers
    from bayesq.quantize import fit_posterior
    from bayesq.rounding import ef_column_metric
    from bayesq.selection import encode_best, encode_candidates, select_encoding
    from bayesq.tables import build_table

    torch.manual_seed(0)
    model, batches = _model(), _calibration()
    held = _calibration(2)
    q = QuantConfig(group_size=32, unit_groups=8)
    post = fit_posterior(model, batches, BayesQConfig(quant=q), progress=False)
    table = build_table(post, layer_blocks(quantizable_layers(model), 32, 8), q, model=model, calibration=batches,
                        progress=False)
    whole = encode_best(model, post, table, q, 3.0, calibration=batches, selection=held,
                        column_metric=ef_column_metric(post, q, model, batches))
    metric = ef_column_metric(post, q, model, batches)
    assert len(metric) == len(table.layers)
    cands = encode_candidates(model, post, table, q, 3.0, calibration=batches, selection=held, column_metric=metric,
                              consume_metric=True)
    assert len(metric) == 0 and list(metric) == []  # every layer's moment released
    with pytest.raises(KeyError):
        metric[table.layers[0].blocks.name]
    split = select_encoding(model, cands)
    assert len(whole.selection_kl) == 2 and split.name == whole.name
    assert dict(split.selection_kl) == dict(whole.selection_kl)
    for name, qw in whole.weights.items():
        assert torch.equal(split.weights[name].codes, qw.codes)
        assert all(torch.equal(split.weights[name].books[b].scale, book.scale) for b, book in qw.books.items())


def _fitted_with_held_out():
    """(model, calibration, held-out batches, q, posterior, blocks, table) of the small CNN."""
    from bayesq.blocks import layer_blocks, quantizable_layers
    from bayesq.quantize import fit_posterior
    from bayesq.tables import build_table

    torch.manual_seed(0)
    model, batches = _model(), _calibration()
    g = torch.Generator().manual_seed(5)
    held = [torch.randn(16, 3, 6, 6, generator=g) for _ in range(2)]
    q = QuantConfig(group_size=32, unit_groups=8)
    post = fit_posterior(model, batches, BayesQConfig(quant=q), progress=False)
    blocks = layer_blocks(quantizable_layers(model), 32, 8)
    return model, batches, held, q, post, blocks, build_table(post, blocks, q, model=model, calibration=batches,
                                                              progress=False)


def test_encode_best_given_reference_vs_its_own_fp_pass():
    from bayesq.evaluation import reference_log_probs
    from bayesq.selection import encode_best

    model, batches, held, q, post, _, table = _fitted_with_held_out()
    own = encode_best(model, post, table, q, 3.0, calibration=batches, selection=held)
    given = encode_best(model, post, table, q, 3.0, calibration=batches, selection=held,
                        known=KnownOutputs(reference_log_probs(model, held)))
    assert len(own.selection_kl) > 1 and given.name == own.name
    assert dict(given.selection_kl) == dict(own.selection_kl)
    # the given reference is the one scored against: log-probs of other inputs move every KL
    other = encode_best(model, post, table, q, 3.0, calibration=batches, selection=held,
                        known=KnownOutputs(reference_log_probs(model, held[::-1])))
    assert all(other.selection_kl[k] != own.selection_kl[k] for k in own.selection_kl)


def test_encode_best_given_candidate_tables_vs_building_them():
    from bayesq.selection import encode_best
    from bayesq.tables import candidate_tables, grid_candidates

    model, batches, held, q, post, blocks, table = _fitted_with_held_out()
    tables = candidate_tables(post, blocks, q, model=model, calibration=batches)
    assert set(tables) == set(grid_candidates(q, held_out=True)) - {"searched"} == {"searched-plain"}
    for held_out in (None, held):  # without selection inputs min/max is the second candidate, built there
        own = encode_best(model, post, table, q, 3.0, calibration=batches, selection=held_out)
        given = encode_best(model, post, table, q, 3.0, calibration=batches, selection=held_out, tables=tables)
        assert given.name == own.name and dict(given.selection_kl) == dict(own.selection_kl)
        assert set(own.selection_kl) == ({"searched", "minmax"} if held_out is None else {"searched", "searched-plain"})
        for name, qw in own.weights.items():
            assert torch.equal(given.weights[name].codes, qw.codes)
    # the given tables are the ones allocated from: the searched table given as the other search's
    other = encode_best(model, post, table, q, 3.0, calibration=batches, selection=held,
                        tables={"searched-plain": table})
    assert other.selection_kl["searched-plain"] == other.selection_kl["searched"]
    assert own.selection_kl["searched-plain"] != own.selection_kl["searched"]


def test_encode_best_selection_without_calibration_names_the_fix():
    from bayesq.blocks import layer_blocks, quantizable_layers
    from bayesq.quantize import fit_posterior
    from bayesq.selection import encode_best
    from bayesq.tables import build_table

    model, batches = _model(), _calibration()
    q = QuantConfig(group_size=32, unit_groups=8)
    post = fit_posterior(model, batches, BayesQConfig(quant=q), progress=False)
    table = build_table(post, layer_blocks(quantizable_layers(model), 32, 8), q, model=model, calibration=batches,
                        progress=False)
    for empty in (None, []):
        with pytest.raises(ValueError, match="pass calibration= batches, or set quant.select_grids: false"):
            encode_best(model, post, table, q, 3.0, calibration=empty)


def test_quantize_model_progress_names_every_step(capsys):
    cfg = BayesQConfig(budget=3.0, quant=CFG, distill=DistillConfig(max_budget=0))
    quantize_model(_model(), _calibration(), cfg, progress=True, selection=_calibration(2))
    err = capsys.readouterr().err
    steps = ["fisher", "layer-input statistics", "loss table", "encode (error-feedback, 2 candidates)",
             "FP on the selection inputs", "selection KL (searched)", "selection KL (searched-plain)"]
    assert [s for s in steps if s not in err] == []


@pytest.mark.parametrize("held_out", [True, False])
def test_quantize_model_offset_reads_the_selection_scores_and_the_curvature_pass_vs_forward_passes(
        monkeypatch, held_out):
    """The output offset's fit reads the kept candidate's scored logits and the FP reference
    instead of running either model again on the scored inputs (the held-out ones, else the
    calibration ones), and the FP model's logits on the calibration inputs from the curvature
    pass (without held-out inputs, the selection's reference too): the offset fitted by forward
    passes of both models, bit for bit. The FP model runs over the calibration inputs once."""
    import copy

    import bayesq.context as ctx
    import bayesq.output_offset as oo
    from bayesq.evaluation import reference_log_probs
    from bayesq.result import quantized_copy

    model, cal = _model().double(), [b.double() for b in _calibration()]
    sel = [b.double() for b in _calibration(2)[::-1]] if held_out else None
    cfg = BayesQConfig(budget=3.0, quant=CFG, distill=DistillConfig(max_budget=0))
    seen, predict, refs, ref = [], oo.predict, [], ctx.reference_log_probs
    monkeypatch.setattr(oo, "predict", lambda m, batches, desc=None: seen.append(m is model) or predict(m, batches))
    monkeypatch.setattr(ctx, "reference_log_probs", lambda m, batches, desc=None: refs.append(len(batches))
                        or ref(m, batches))
    res = quantize_model(model, cal, cfg, progress=False, selection=sel)
    monkeypatch.setattr(oo, "predict", predict)
    assert len(res.selection_kl) == 2 and res.output_offset.fitted
    assert seen == ([False] if held_out else [])  # the quantised model on the calibration inputs only
    assert refs == ([len(sel)] if held_out else [])  # the FP model on the held-out inputs only
    qmodel = quantized_copy(model, res.weights, res.correction)
    fp = reference_log_probs(model, sel or cal)  # the selection's reference
    known = KnownOutputs(fp) if held_out else KnownOutputs(logits=fp)
    want = oo.fit_output_offset(model, copy.deepcopy(qmodel), cal, selection=sel,
                                fp=ctx.FPOutputs(model, sel or cal, cal, held_out=held_out, known=known))
    assert torch.equal(res.output_offset.shift, want.shift)
    assert res.output_offset.inputs == want.inputs == 8 * (5 if held_out else 3)
    assert res.output_offset.shift.abs().max() > 1e-6  # an offset that moved, so the comparison can fail
    want.apply(qmodel)
    with torch.no_grad():
        assert torch.equal(res.model(cal[0]), qmodel(cal[0]))


def test_quantize_model_channels_last_vs_contiguous():
    cfg = BayesQConfig(budget=3.0, quant=CFG, distill=DistillConfig(max_budget=0))
    plain = quantize_model(_model().double(), [b.double() for b in _calibration()], cfg, progress=False)
    last_model = _model().double().to(memory_format=torch.channels_last)
    assert last_model[0].weight.is_contiguous(memory_format=torch.channels_last)
    last = quantize_model(last_model, [b.double() for b in _calibration()], cfg, progress=False)
    assert plain.allocation.unit_bits == last.allocation.unit_bits
    for name, qw in plain.weights.items():
        assert torch.equal(qw.codes, last.weights[name].codes), name
        assert torch.allclose(qw.dequantize(), last.weights[name].dequantize(), rtol=0, atol=1e-12), name


class _QKV(nn.Module):
    """Three Linear layers reading one token tensor (q / k / v), a depthwise conv, a head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1, groups=4, padding_mode="reflect")
        self.q, self.k, self.v = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        t = self.conv(x).flatten(2).transpose(1, 2)  # (B, 25, 4) tokens
        att = torch.softmax(self.q(t) @ self.k(t).transpose(1, 2), -1)
        return self.head((att @ self.v(t)).mean(1))


@pytest.mark.parametrize("curvature", ["fisher", "empirical-fisher", "kfac"])
def test_posterior_and_stats_vs_posterior_then_statistics_pass(curvature):
    """One Fisher pass gives the posterior and the same layer-input statistics as
    input_stats' own forward pass (K-FAC: the second pass is run)."""
    from bayesq.baselines.activations import input_stats
    from bayesq.blocks import quantizable_layers
    from bayesq.config import PosteriorConfig
    from bayesq.posterior import fit_posterior as fit
    from bayesq.quantize import posterior_and_stats

    torch.manual_seed(0)
    model = _QKV().double().eval()
    g = torch.Generator().manual_seed(4)
    batches = [torch.randn(6, 4, 5, 5, generator=g, dtype=torch.float64) for _ in range(3)]
    layers = quantizable_layers(model)
    cfg = PosteriorConfig(curvature=curvature)
    post, stats = posterior_and_stats(model, batches, layers, cfg, QuantConfig(), seed=3, progress=False)
    ref_post = fit(model, batches, layers, cfg, seed=3, progress=False)
    ref = input_stats(model, batches, layers)
    assert set(stats) == set(ref) == set(layers)
    for name in layers:
        torch.testing.assert_close(post.variance[name], ref_post.variance[name], rtol=0, atol=0)
        for field in ("H", "mean"):
            torch.testing.assert_close(getattr(stats[name], field), getattr(ref[name], field), rtol=1e-12, atol=1e-15)
        assert stats[name].abs_mean is None  # AWQ's; BayesQ does not read it
        assert stats[name].n == ref[name].n == 18
    _, none = posterior_and_stats(model, batches, layers, cfg, QuantConfig(bias_correction=False, rounding="nearest"),
                                  progress=False)
    assert none is None
    if curvature != "kfac":
        with pytest.raises(ValueError, match="on_rows needs a Fisher curvature pass"):
            fit(model, batches, layers, PosteriorConfig(curvature="hutchinson-ggn"), on_rows=lambda n, r: None)


def test_library_stages_in_order_vs_quantize_model():
    """fit_posterior -> build_table -> encode_best -> assemble, called one by one (as the
    pipeline's cached tasks do), give quantize_model's model and codes."""
    from bayesq.blocks import layer_blocks, quantizable_layers
    from bayesq.evaluation import reference_log_probs
    from bayesq.quantize import assemble, fit_posterior
    from bayesq.selection import encode_best
    from bayesq.tables import build_table

    model, batches = _model(), _calibration()
    q = QuantConfig(group_size=32, unit_groups=8)
    cfg = BayesQConfig(budget=3.0, quant=q, distill=DistillConfig(max_budget=0))
    whole = quantize_model(model, batches, cfg, progress=False)
    post = fit_posterior(model, batches, cfg, progress=False)
    table = build_table(post, layer_blocks(quantizable_layers(model), 32, 8), q, model=model, calibration=batches,
                        progress=False)
    enc = encode_best(model, post, table, q, 3.0, calibration=batches)
    # scored on the calibration inputs: the offset's fit reads the selection's outputs there
    fp = FPOutputs(model, batches, batches, known=KnownOutputs(logits=reference_log_probs(model, batches)))
    qmodel, weights, distilled, offset = assemble(model, enc, post, batches, cfg.distill, 3.0, fp=fp)
    assert distilled is None and enc.name == whole.encoding
    assert offset.layer is not None and torch.equal(offset.shift, whole.output_offset.shift)
    for name, qw in whole.weights.items():
        assert torch.equal(weights[name].codes, qw.codes)
    x = batches[0]
    with torch.no_grad():
        torch.testing.assert_close(qmodel(x), whole.model(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="distillation needs the posterior"):
        assemble(model, enc, None, batches, DistillConfig(max_budget=3.5), 3.0)


@pytest.mark.parametrize("rounding", ["error-feedback", "nearest"])
def test_quantize_model_causal_language_model_default_config(rounding):
    """A causal LM returning (B, T, V) logits, calibrated on padded input_ids / attention_mask
    dicts: BayesQ's default config (3 bits; error-feedback rounding, or nearest)
    with held-out selection inputs (error feedback) runs, lands within the budget, scores its grid candidates
    per input and gives finite logits; padding appended to the calibration changes nothing."""
    from nets import TinyCausalLM, lm_batches, with_padding

    torch.manual_seed(0)
    model = TinyCausalLM(vocab=29, d=32, hidden=64).eval()
    cal = lm_batches([[5, 9, 3, 7], [8, 2, 6, 4], [9, 9, 1, 5]], vocab=29)
    sel = lm_batches([[4, 7, 2, 9], [6, 3, 8, 5]], vocab=29, seed=1)
    cfg = BayesQConfig(quant=QuantConfig(rounding=rounding))
    res = quantize_model(model, cal, cfg, progress=False, selection=sel)
    assert res.average_bits <= cfg.budget
    assert set(res.weights) == {"mix", "fc1", "fc2", "head"}
    assert len(res.selection_kl) > 1 or rounding == "nearest"  # error feedback: grid candidates scored
    assert all(math.isfinite(v) and v >= 0 for v in res.selection_kl.values())
    with torch.no_grad():
        z = res.model(**cal[0])["logits"]
    assert z.shape == (*cal[0]["input_ids"].shape, 29) and bool(torch.isfinite(z).all())
    again = quantize_model(model, with_padding(cal, 2), cfg, progress=False, selection=with_padding(sel, 2))
    for name, qw in res.weights.items():
        assert torch.equal(again.weights[name].codes, qw.codes), name


def test_encode_best_layer_by_layer_vs_encode_of_the_kept_candidate():
    """encode_best encodes every candidate layer by layer (one metric and factor held at a time):
    the kept codes and books are exactly encode()'s of the kept table and allocation."""
    from bayesq.rounding import ef_column_metric, encode
    from bayesq.selection import encode_best

    model, batches, held, q, post, _, table = _fitted_with_held_out()
    metric = ef_column_metric(post, q, model, batches)
    for selection in (None, held):
        enc = encode_best(model, post, table, q, 3.0, calibration=batches, column_metric=metric, selection=selection)
        cq = enc.quant
        weights = {n: model.get_submodule(n).weight for n in enc.weights}
        want = encode(enc.table, enc.allocation, weights, rounding=cq.rounding, column_metric=metric,
                      act_order=cq.act_order, refit=cq.refit, scale_bits=cq.scale_bits, cd_passes=cq.cd_passes)
        assert set(want) == set(enc.weights)
        for name, qw in want.items():
            assert enc.weights[name].codes.dtype == torch.uint8  # 3-bit codes: one byte each
            assert torch.equal(enc.weights[name].codes, qw.codes), name
            assert torch.equal(enc.weights[name].dequantize(), qw.dequantize()), name
