"""The peak-memory estimate against hand counts, and the clear error before any work."""

import sys

import pytest
import torch
from torch import nn

from bayesq import memory
from bayesq.blocks import quantizable_layers
from bayesq.config import BayesQConfig
from bayesq.quantize import quantize_model
from tests.nets import TinyCausalLM


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 5)).eval()


def test_estimate_vs_hand_count():
    """Weights: BYTES_PER_WEIGHT each; input moments: BYTES_PER_MOMENT per element of each layer's
    d_in x d_in; activations per input: 2x every module's output bytes (the two Linear, the ReLU and the Sequential's own
    output) on the first batch over its size; no per-token term for (B, C) logits; a pass holds
    the whole batch when it fits in PASS_BYTES."""
    model, x = _net(), torch.randn(7, 12, generator=torch.Generator().manual_seed(1))
    est = memory.estimate(model, quantizable_layers(model), [x, x[:2]])
    outputs = 7 * (32 + 32 + 5 + 5) * 4
    assert est.n_weights == 12 * 32 + 32 * 5 and est.weights == memory.BYTES_PER_WEIGHT * est.n_weights
    assert est.n_moments == 12**2 + 32**2 and est.moments == memory.BYTES_PER_MOMENT * est.n_moments
    assert est.activations == int(2 * outputs / 7) and est.logits == 0 and est.batch == 7
    assert est.pass_inputs == 7 and est.total == est.weights + est.moments + 7 * est.activations


def test_estimate_moments_of_grouped_convolutions():
    model = nn.Sequential(nn.Conv2d(4, 8, 3, groups=2), nn.Conv2d(8, 8, 1)).eval()
    est = memory.estimate(model, quantizable_layers(model), [torch.randn(2, 4, 6, 6)])
    assert est.n_moments == 2 * (2 * 9) ** 2 + 8**2  # two groups of 2 x 3 x 3 inputs, then 8 inputs


def test_pass_inputs_whole_batch_or_most_that_fit_in_a_part(monkeypatch):
    est = memory.MemoryEstimate(weights=0, activations=300, logits=100, n_weights=1, batch=8)
    monkeypatch.setattr(memory, "PART_BYTES", 1600)
    for budget, want in [(10**6, 8), (3200, 8), (3199, 4), (0, 4)]:
        monkeypatch.setattr(memory, "PASS_BYTES", budget)
        assert est.pass_inputs == want, budget
    monkeypatch.setattr(memory, "PASS_BYTES", 0)
    for part, want in [(10**6, 8), (1599, 3), (399, 1), (0, 1)]:
        monkeypatch.setattr(memory, "PART_BYTES", part)
        assert est.pass_inputs == want, part
        assert est.total == want * 400
        assert f"pass over {want} input" in est.describe()


def test_estimate_per_token_logits_term():
    model = TinyCausalLM()
    ids = torch.randint(0, 23, (3, 6), generator=torch.Generator().manual_seed(2))
    est = memory.estimate(model, quantizable_layers(model), [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}])
    vocab = model(ids)["logits"].shape[-1]
    assert est.logits == int(7.5 * 8 * 3 * 6 * vocab / 3)  # per input


def test_estimate_leaves_model_and_generators_alone():
    model, x = _net(), torch.randn(4, 12)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    memory.estimate(model, quantizable_layers(model), [x])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert not any(m._forward_hooks for m in model.modules())


def test_quantize_model_too_little_memory_is_clear(monkeypatch):
    """Before any work: the error names the estimate, its terms and the fixes; the model is as it was."""
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2**10)
    model, x = _net(), torch.randn(16, 12, generator=torch.Generator().manual_seed(3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(memory.InsufficientMemoryError, match=r"needs about .* GiB .* 544 weights to quantise.*"
                       r"only 0\.00 GiB is free.*shorter inputs.*exclude=.*check_memory=False"):
        quantize_model(model, [x], BayesQConfig(), progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    out = quantize_model(model, [x], BayesQConfig(), progress=False, check_memory=False)
    assert out.average_bits <= BayesQConfig().budget


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/meminfo")
def test_available_bytes_cpu_reads_meminfo_and_data_limit():
    free = memory.available_bytes(torch.device("cpu"))
    meminfo = open("/proc/meminfo").read()
    avail = int(next(line for line in meminfo.splitlines() if line.startswith("MemAvailable:")).split()[1]) * 1024
    assert 0 < free <= avail * 1.5  # read a moment apart
    assert memory.available_bytes(torch.device("meta")) is None


def test_quantize_model_splits_the_curvature_pass_as_estimated(monkeypatch):
    """A pass budget of two inputs' activations: the posterior is fitted on parts of at most two
    inputs (the same curvature up to float rounding, float64 model), and fit_posterior splits alike."""
    from bayesq.quantize import fit_posterior

    model, x = _net().double(), torch.randn(7, 12, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    whole = quantize_model(model, [x], BayesQConfig(), progress=False, keep_posterior=True)
    per = memory.estimate(model, quantizable_layers(model), [x]).activations
    monkeypatch.setattr(memory, "PASS_BYTES", 2 * per)
    monkeypatch.setattr(memory, "PART_BYTES", 2 * per)
    seen = []  # inputs of every forward pass with gradients (the curvature pass's)
    hook = model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]) if torch.is_grad_enabled()
                                           else None)
    split = quantize_model(model, [x], BayesQConfig(), progress=False, keep_posterior=True)
    post = fit_posterior(model, [x], BayesQConfig(), progress=False)
    hook.remove()
    assert seen == [2, 2, 2, 1, 2, 2, 2, 1]
    for k, v in whole.posterior.curvature.items():
        assert torch.allclose(split.posterior.curvature[k], v, rtol=1e-12, atol=0)
        assert torch.equal(post.curvature[k], split.posterior.curvature[k])


def test_lazy_map_makes_each_value_on_access():
    """Values are made on every read and not kept; unknown names raise KeyError; order kept."""
    made = []
    lazy = memory.LazyMap(["b", "a"], lambda n: made.append(n) or torch.full((2,), float(len(made))))
    assert list(lazy) == ["b", "a"] and len(lazy) == 2 and "a" in lazy and "c" not in lazy
    assert float(lazy["a"][0]) == 1.0 and float(lazy["a"][0]) == 2.0 and made == ["a", "a"]
    with pytest.raises(KeyError):
        lazy["c"]
