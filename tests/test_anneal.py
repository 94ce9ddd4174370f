import itertools
from dataclasses import replace

import pytest
import torch
from torch import nn

from bayesq.baselines.activations import input_stats
from bayesq.baselines.anneal import AnnealConfig, UnitOutputs, anneal_search, layer_encodings
from bayesq.baselines.gptq import gptq_quantize
from bayesq.blocks import quantizable_layers
from bayesq.canonical import canonical
from bayesq.config import Granularity, QuantConfig
from bayesq.evaluation import kl_per_input, reference_log_probs
from bayesq.harness.architectures import build, example_batches
from bayesq.methods import Inputs, quantize_with
from bayesq.result import quantized_copy
from bayesq.storage import budget_bits

Q = QuantConfig(bits=(2, 3, 4, 8), group_size=32, unit_groups=1)


def _model_and_inputs(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)).double()
    g = torch.Generator().manual_seed(seed + 1)
    return model, [torch.randn(32, 32, generator=g, dtype=torch.float64) for _ in range(3)]


def test_layer_encodings_equal_gptq_at_one_width():
    """Each layer's encoding at a width is GPTQ's with every layer at that width: a layer's codes
    do not depend on the other layers' widths."""
    model, cal = _model_and_inputs()
    layers = quantizable_layers(model)
    stats = input_stats(model, cal, layers)
    _, enc = layer_encodings(layers, stats, Q)
    for b in Q.bits:
        one = gptq_quantize(model, stats, Granularity.GROUP, 9.0, replace(Q, bits=(b,)))
        for name in layers:
            assert torch.equal(enc[b][name].dequantize(), one.weights[name].dequantize())


def test_anneal_search_vs_brute_force_over_every_assignment():
    """The middle layer's pre-activations x10 saturate its tanh: its output error matters less
    to the network than GPTQ's layer proxy says, so the proxy's start is not the optimum."""
    model, cal = _model_and_inputs()
    with torch.no_grad():
        model[2].weight.mul_(10)
    layers = quantizable_layers(model)
    stats = input_stats(model, cal, layers)
    table, enc = layer_encodings(layers, stats, Q)
    budget = 4.0
    names = [t.blocks.name for t in table.layers]
    cost = {(t.blocks.name, b): int(t.unit_cost[0, j]) for t in table.layers for j, b in enumerate(t.bits)}
    limit = budget_bits(budget, table.n_weights)
    ref = reference_log_probs(model, cal)
    energies = {}
    for combo in itertools.product(Q.bits, repeat=len(names)):  # 64 assignments, every feasible one scored
        if sum(cost[n, b] for n, b in zip(names, combo)) <= limit:
            qmodel = quantized_copy(model, {n: enc[b][n] for n, b in zip(names, combo)})
            energies[combo] = float(kl_per_input(ref, qmodel, cal).mean())
    optimum = min(energies.values())
    trace = anneal_search(model, table, enc, cal, budget, steps=300, t_start=0.5, seed=0)
    best = tuple(trace.best[n] for n in names)
    assert best in energies and trace.best_kl == pytest.approx(energies[best], rel=1e-12)
    assert trace.best_kl == pytest.approx(optimum, rel=1e-12)  # the search reaches the global optimum
    start = tuple(trace.start[n] for n in names)
    assert trace.start_kl == pytest.approx(energies[start], rel=1e-12)
    assert optimum < energies[start]  # the proxy's start is not already optimal: the test can fail
    assert 0 < trace.accepted <= trace.steps


def test_anneal_method_meets_the_budget_and_reports_the_search():
    model, cal = _model_and_inputs()
    sel = _model_and_inputs(seed=5)[1]
    out = quantize_with(model, AnnealConfig(Q, steps=40, progress=False), 4.0, Inputs(calibration=cal, selection=sel))
    assert out.result.average_bits <= 4.0
    kinds = {"annealed", "start", "annealed+bc", "start+bc"}  # bias correction offered by default
    assert set(out.details["variant_kl"]) == kinds and out.details["variant"] in kinds
    assert out.details["search_kl"] <= out.details["start_kl"]
    for name, q in out.result.weights.items():  # one width per layer
        assert len(set(out.result.allocation.unit_bits[name])) == 1
        assert torch.equal(out.result.model.get_submodule(name).weight, q.dequantize().to(torch.float64))


@pytest.mark.parametrize("kwargs, match", [({"steps": -1}, "AnnealConfig.steps"), ({"search_inputs": 0}, "search_inputs"),
                                           ({"t_start": 0.001, "t_end": 0.01}, "t_start >= t_end")])
def test_anneal_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AnnealConfig(**kwargs)


def test_anneal_names_an_infeasible_budget():
    model, cal = _model_and_inputs()
    with pytest.raises(ValueError, match="infeasible"):
        quantize_with(model, AnnealConfig(Q, steps=2, progress=False), 2.0, Inputs(calibration=cal))


def _searches(model, batches, budget=4.0, skip=()):
    """The annealing search's trace with outputs reused and with full passes (the same encodings)."""
    with canonical(model) as m:
        layers = {n: x for n, x in quantizable_layers(m).items() if not n.startswith(skip)}
        table, enc = layer_encodings(layers, input_stats(m, batches, layers), Q)
        return [anneal_search(m, table, enc, batches, budget, steps=30, t_start=0.5, seed=3, reuse=reuse)
                for reuse in (True, False)]


@pytest.mark.parametrize("family", ["resnet18", "efficientnet_b0", "vit", "bert", "gpt2-lm", "t5",
                                    "transformer-encoder"])
def test_anneal_search_reusing_unit_outputs_vs_full_passes(family):
    """Proposals run from their first changed unit give the energies of full passes bit for bit:
    the same trace (every accept / reject decision, the best and start energies). GPT-2's head is
    tied to its token embedding, which is read before the first block: a change of it runs in full."""
    model = build(family).double()
    with torch.no_grad():  # a zero-initialised head (ViT's) gives every assignment the same logits
        for w in model.parameters():
            if w.dim() >= 2 and not w.any():
                w.normal_(0, 0.1)
    batches = [b.double() if torch.is_tensor(b) else b for b in example_batches(family, n_batches=2)]
    skip = ("layer2", "layer3", "layer4") if family == "resnet18" else ()  # its real width: the first stage only
    fast, full = _searches(model, batches, skip=skip)
    assert fast == full
    assert fast.accepted > 0 and fast.best_kl < fast.start_kl  # moves were accepted: kept outputs were replaced


class _Twice(nn.Module):
    """The same block called twice per pass: its second call's input comes after itself."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
                                     for _ in range(2)])
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        for _ in range(2):
            for b in self.blocks:
                x = b(x)
        return self.head(x)


def test_unit_outputs_run_full_passes_when_a_unit_is_called_twice():
    torch.manual_seed(0)
    model = _Twice().double()
    batches = [torch.randn(16, 16, dtype=torch.float64) for _ in range(2)]
    fast, full = _searches(model, batches)
    assert fast == full and fast.accepted > 0
    work = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).double()
    outputs = UnitOutputs(work, ["0", "1"])
    with outputs.pass_from(0):
        work(torch.randn(2, 4, dtype=torch.float64))
        work(torch.randn(2, 4, dtype=torch.float64))
    assert outputs.active  # once per pass: reuse
    twice = UnitOutputs(model, ["blocks.0", "blocks.1", "head"])
    with twice.pass_from(0):
        model(batches[0])
    assert not twice.active  # twice per pass: no reuse
