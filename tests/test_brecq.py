"""BRECQ's block reconstruction (bayesq/baselines/brecq.py): the units it cuts a network into,
the replay of a unit's captured inputs, the soft weight against the stored encoding, and its
rounding against the brute-force optimum of a tiny block."""

import itertools

import pytest
import torch
from torch import nn

from bayesq.assignment import allocate
from bayesq.baselines.activations import InputStats, input_stats
from bayesq.baselines.brecq import (
    BayesQBRECQConfig, BRECQConfig, SoftWeight, bayesq_brecq, block_modules, brecq_codes, capture, element_grid,
    first_tensor, reconstruct_unit, reconstruction_error, reconstruction_units, with_codes
)
from bayesq.baselines.gptq import LayerRounding, gptq_codes, gptq_table
from bayesq.baselines.lsq import nearest_rows
from bayesq.blocks import layer_blocks, quantizable_layers
from bayesq.canonical import canonical
from bayesq.config import BayesQConfig, DistillConfig, QuantConfig
from bayesq.harness.architectures import build, example_batches
from bayesq.output_offset import fit_output_offset
from bayesq.quantize import quantize_model
from bayesq.result import quantized_copy


class Residual(nn.Module):
    """``x + W2 relu(W1 x)``: a block whose two layers interact through the ReLU."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class SE(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(c, c), nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.fc2(torch.relu(self.fc1(x))))


def _net(d: int = 4) -> nn.Module:
    """stem, a stage of two residual blocks, one block with a squeeze-excitation inside, head."""
    inner = nn.Sequential(nn.Linear(d, d), SE(d), nn.Linear(d, d))
    return nn.Sequential(nn.Linear(d, d), nn.Sequential(Residual(d, 2 * d), Residual(d, 2 * d)), inner,
                         nn.Linear(d, 3)).double()


def test_block_modules_repeated_blocks_not_inner_parts():
    net = _net()
    layers = quantizable_layers(net)
    # 1.0 / 1.1: the residual blocks; 2 holds 4 layers and a sibling (1) holds several: a block;
    # its squeeze-excitation (2.1) has no sibling with two layers: not a block of its own
    assert block_modules(net, list(layers)) == ["1.0", "1.1", "2"]


def test_reconstruction_units_cover_every_layer_once_in_forward_order():
    net = _net()
    layers = list(quantizable_layers(net))
    units = reconstruction_units(net, layers, torch.randn(2, 4, dtype=torch.float64))
    assert [u.name for u in units] == ["0", "1.0", "1.1", "2", "3"]
    assert sorted(n for u in units for n in u.layers) == sorted(layers)


@pytest.mark.parametrize("family", ["resnet18", "efficientnet_b0", "bert", "gpt2-lm", "t5"])
def test_capture_replayed_inputs_give_the_captured_output(family):
    """A unit called on its captured (args, kwargs) returns the output captured in the same pass
    (masks, position biases and the language model's cache handled as replayed)."""
    model = build(family)
    batches = example_batches(family)
    with canonical(model) as m:
        units = reconstruction_units(m, list(quantizable_layers(m)), batches[0])
        unit = [u for u in units if len(u.layers) > 1][1].name  # a block after the first
        ins = capture(m, unit, batches, inputs=True)
        outs = capture(m, unit, batches, inputs=False)
        with torch.no_grad():
            for (args, kwargs), out in zip(ins, outs):
                torch.testing.assert_close(first_tensor(m.get_submodule(unit)(*args, **kwargs)), out)


def _encodings(model: nn.Module, batches, bits: int = 2, group: int = 4):
    """(layers, each layer's min/max grid encoding at ``bits`` with nearest codes)."""
    cfg = QuantConfig(bits=(bits,), group_size=group, unit_groups=1)
    layers = quantizable_layers(model)
    stats = input_stats(model, batches, layers)
    table = gptq_table(layers, stats, layer_blocks(layers, cfg.group_size, cfg.unit_groups), cfg)
    nearest = LayerRounding("nearest", InputStats.output_mse_metric, nearest_rows)
    return layers, gptq_codes(layers, stats, table, allocate(table, 32.0), True, 0.01, rounding=nearest)


def test_soft_weight_at_decided_logits_is_the_stored_encoding():
    """With every logit far from 0 the soft weight is the dequantised encoding of its hard codes
    (mixed widths, a 4-d convolution weight, dead groups)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 5)).double()
    with torch.no_grad():
        model[0].weight[1] = 0.0  # a dead output channel: scale 0, zero-point code
    batches = [torch.randn(8, 3, 6, 6, dtype=torch.float64) for _ in range(2)]
    layers, enc = _encodings(model, batches, bits=3)
    for name, qw in enc.items():
        soft = SoftWeight(layers[name].weight, qw)
        with torch.no_grad():
            soft.logits.copy_(torch.where(torch.rand_like(soft.logits) < 0.5, -30.0, 30.0))
        codes = soft.codes()
        torch.testing.assert_close(soft.weight().detach(), with_codes(qw, codes).dequantize().reshape(soft.shape))
        down, up = (torch.minimum((soft.low + k).clamp(min=0), soft.maxq.double()).long() for k in (0, 1))
        live = soft.live
        assert bool(((codes == down) | (codes == up))[live].all())  # the code below or above, clipped to the grid


def test_reconstruction_error_leaves_padded_positions_out():
    out, target = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    expected = ((out - target)[mask] ** 2).mean()
    torch.testing.assert_close(reconstruction_error(out, target, mask), expected)
    torch.testing.assert_close(reconstruction_error(out, target, None), ((out - target) ** 2).mean())


def test_reconstruct_unit_vs_brute_force_rounding():
    """On a residual block of 12 weights at 2 bits, BRECQ's codes (each weight's code below or
    above it, learned jointly over both layers) reach the least block-output error among all
    2^12 up/down choices within 5 %, and beat nearest rounding."""
    torch.manual_seed(3)
    d, h = 2, 3
    block = Residual(d, h).double().eval()
    x = [torch.randn(16, d, dtype=torch.float64) for _ in range(2)]
    layers, enc = _encodings(block, x, bits=2, group=4)
    with torch.no_grad():
        targets = [block(b) for b in x]
    soft = {n: SoftWeight(layers[n].weight, enc[n]) for n in layers}
    cfg = BRECQConfig(iters=3000, lr=1e-2, progress=False)
    codes = reconstruct_unit(block, soft, [((b,), {}) for b in x], targets, [None, None], cfg)

    def error(choice: dict[str, torch.Tensor]) -> float:
        w = {f"{n}.weight": with_codes(enc[n], c).dequantize().reshape(layers[n].weight.shape) for n, c in choice.items()}
        return sum(float(reconstruction_error(torch.func.functional_call(block, w, (b,)), t, None))
                   for b, t in zip(x, targets))

    names = list(layers)
    sizes = [layers[n].weight.numel() for n in names]
    low = {n: soft[n].low.long() for n in names}
    best = float("inf")
    for bits in itertools.product((0, 1), repeat=sum(sizes)):
        flat, choice, at = torch.tensor(bits), {}, 0
        for n, k in zip(names, sizes):
            choice[n] = torch.minimum((low[n] + flat[at:at + k].reshape(low[n].shape)).clamp(min=0),
                                      soft[n].maxq.long())
            at += k
        best = min(best, error(choice))
    nearest = error({n: element_grid(enc[n])[3].long() for n in names})  # the encodings hold nearest codes
    got = error(codes)
    assert got <= 1.05 * best
    assert got < nearest


def _residual_net() -> tuple[nn.Module, list[torch.Tensor], list[torch.Tensor]]:
    """(a stem, two residual blocks and a head; calibration batches; held-out selection batches)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), Residual(16, 32), Residual(16, 32), nn.Linear(16, 3)).eval()
    g = torch.Generator().manual_seed(1)
    cal, sel = ([torch.randn(8, 8, generator=g) for _ in range(k)] for k in (3, 2))
    return net, cal, sel


def test_bayesq_brecq_vs_brecq_codes_on_bayesq_encoding():
    """BayesQ + BRECQ is BayesQ's result (the same grid candidate, allocation, grids and bits)
    with each layer's codes those of :func:`brecq_codes` run on BayesQ's encoding, and without
    BayesQ's bias correction: the quantised model's biases are the FP model's (the output layer's
    plus the output offset fitted on the re-rounded model over the calibration and selection
    inputs) and its weights the new codes decoded."""
    net, cal, sel = _residual_net()
    bq = BayesQConfig(quant=QuantConfig(group_size=32, unit_groups=2), distill=DistillConfig(max_budget=0))
    cfg = BayesQBRECQConfig(bq, BRECQConfig(iters=30, progress=False))
    res = bayesq_brecq(net, cal, cfg, 3.0, selection=sel)
    base = quantize_model(net, cal, bq, selection=sel, progress=False)
    layers = quantizable_layers(net)
    want = brecq_codes(net, layers, dict(base.weights), cal, cfg.brecq)
    assert res.correction is None and base.correction.targets  # BayesQ's own result is corrected
    fp_biases = {n: p for n, p in net.named_parameters() if n.endswith("bias")}
    assert any(not torch.equal(p, fp_biases[n]) for n, p in base.model.named_parameters() if n in fp_biases)
    assert res.encoding == base.encoding and res.allocation.unit_bits == base.allocation.unit_bits
    assert res.allocation.total_bits == base.allocation.total_bits and res.average_bits <= 3.0
    for n, m in layers.items():
        got, ref, old = res.weights[n], want[n], base.weights[n]
        assert torch.equal(got.codes, ref.codes) and torch.equal(got.group_bits, old.group_bits)
        for b, book in old.books.items():
            assert torch.equal(got.books[b].scale, book.scale) and torch.equal(got.books[b].zero, book.zero)
        q = res.model.get_submodule(n)
        fp_bias = m.bias
        if n == res.output_offset.layer:
            fp_bias = m.bias + res.output_offset.shift.to(m.bias.dtype)
            rebuilt = quantized_copy(net, res.weights)
            assert torch.equal(res.output_offset.shift, fit_output_offset(net, rebuilt, cal, selection=sel).shift)
        assert (q.bias is None) == (m.bias is None) and (m.bias is None or torch.equal(q.bias, fp_bias))
        assert torch.equal(q.weight, ref.dequantize().reshape(m.weight.shape).to(m.weight.dtype))
    assert any(not torch.equal(res.weights[n].codes, base.weights[n].codes) for n in layers)  # rounded again


def test_brecq_encoding_drops_the_scored_logits_of_the_model_it_rounds_again():
    """The selection's logits of BayesQ's kept candidate stand for a forward pass of that model
    only: the re-rounded encoding carries none, so the output offset's fit runs the new model."""
    from bayesq.baselines.brecq import brecq_encoding
    from bayesq.quantize import fit_posterior
    from bayesq.selection import encode_best
    from bayesq.tables import build_table

    net, cal, sel = _residual_net()
    q = QuantConfig(group_size=32, unit_groups=2)
    post = fit_posterior(net, cal, BayesQConfig(quant=q), progress=False)
    table = build_table(post, layer_blocks(quantizable_layers(net), 32, 2), q, model=net, calibration=cal,
                        progress=False)
    enc = encode_best(net, post, table, q, 3.0, calibration=cal, selection=sel)
    assert enc.scored_logits is not None and sum(len(z) for z in enc.scored_logits) == 16
    again = brecq_encoding(net, enc, cal, BRECQConfig(iters=5, progress=False))
    assert again.scored_logits is None and again.name == enc.name


def test_bayesq_brecq_rejects_distillation_and_missing_calibration():
    net, cal, sel = _residual_net()
    distilled = BayesQBRECQConfig(BayesQConfig(distill=DistillConfig(max_budget=3.5)), BRECQConfig(iters=5))
    with pytest.raises(ValueError, match="distill.max_budget below 3.0"):
        bayesq_brecq(net, cal, distilled, 3.0)
    with pytest.raises(ValueError, match="calibration batches"):
        bayesq_brecq(net, [], BayesQBRECQConfig(brecq=BRECQConfig(iters=5)), 3.0)


def test_brecq_config_rejects_bad_settings():
    with pytest.raises(ValueError, match="brecq.iters"):
        BRECQConfig(iters=0)
    with pytest.raises(ValueError, match="brecq.warmup"):
        BRECQConfig(warmup=1.0)
    with pytest.raises(ValueError, match="lam >= 0"):
        BRECQConfig(lam=-1.0)
