import pytest
import torch
from torch import nn

from bayesq import BayesQConfig, QuantConfig, quantize_model
from bayesq import quantize as quantize_module
from bayesq.methods import Inputs, quantize_with
from bayesq.settings import replace
from bayesq.stage_cache import MemoryCache, cached, fingerprint

CFG = QuantConfig(group_size=32, unit_groups=2)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 6 * 6, 64),
                         nn.ReLU(), nn.Linear(64, 10))


def _batches(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 3, 6, 6, generator=g) for _ in range(n)]


def _same(a, b):
    """Every quantised weight and every encoded layer's codes equal, element for element."""
    assert a.weights.keys() == b.weights.keys()
    for name in a.weights:
        assert torch.equal(a.weights[name].codes, b.weights[name].codes)
    for (n1, p1), (n2, p2) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    assert a.allocation.total_bits == b.allocation.total_bits and a.selection_kl == b.selection_kl


def test_quantize_model_from_the_cache_vs_without(monkeypatch):
    """A second budget reads the curvature pass the first one kept (the pass runs once) and gives
    the same tensors as a run without a cache; the selection and the offset read the kept logits."""
    calls = []
    real = quantize_module.posterior_and_stats
    monkeypatch.setattr(quantize_module, "posterior_and_stats", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache, model, cal, sel = MemoryCache(), _model(), _batches(), _batches(2, seed=2)
    for budget in (3.0, 4.0, 3.0):
        cfg = BayesQConfig(budget=budget, quant=CFG)
        with_cache = quantize_model(model, cal, cfg, progress=False, selection=sel, cache=cache)
        without = quantize_model(model, cal, cfg, progress=False, selection=sel)
        _same(with_cache, without)
    assert len(calls) == 1 + 3  # the cached pass once, then every run without the cache
    assert len(cache.items) == 1


def test_quantize_with_passes_the_cache_to_bayesq():
    cache, model, cal = MemoryCache(), _model(), _batches()
    cfg = BayesQConfig(budget=3.0, quant=CFG, progress=False)
    first = quantize_with(model, cfg, 3.0, Inputs(calibration=cal, cache=cache)).result
    again = quantize_with(model, cfg, 4.0, Inputs(calibration=cal, cache=cache)).result
    _same(again, quantize_model(model, cal, BayesQConfig(budget=4.0, quant=CFG), progress=False))
    assert len(cache.items) == 1 and first.average_bits <= 3.0


def test_fingerprint_changes_with_every_input_the_pass_reads():
    model, cal, cfg = _model(), _batches(), BayesQConfig(quant=CFG)
    key = fingerprint(model, cal, cfg.posterior, cfg.quant, 0)
    assert key == fingerprint(_model(), _batches(), BayesQConfig(quant=CFG).posterior, CFG, 0)  # equal values
    other = _model()
    with torch.no_grad():
        other[0].weight[0, 0, 0, 0] += 1e-7  # one weight
    changed = [fingerprint(other, cal, cfg.posterior, cfg.quant, 0),
               fingerprint(model, _batches(seed=5), cfg.posterior, cfg.quant, 0),
               fingerprint(model, [c.double() for c in cal], cfg.posterior, cfg.quant, 0),  # dtype
               fingerprint(model, cal, replace(cfg.posterior, damping=2 * cfg.posterior.damping), cfg.quant, 0),
               fingerprint(model, cal, cfg.posterior, QuantConfig(group_size=64, unit_groups=2), 0),
               fingerprint(model, cal, cfg.posterior, cfg.quant, 1)]
    assert len({key, *changed}) == 1 + len(changed)
    with pytest.raises(TypeError, match="cannot fingerprint a object"):
        fingerprint(object())


def test_memory_cache_hands_out_copies():
    cache, made = MemoryCache(), []
    value = cached(cache, "s", lambda: "k", lambda: made.append(1) or {"t": torch.zeros(2)})
    value["t"] += 1  # the caller changes what it got
    again = cached(cache, "s", lambda: "k", lambda: made.append(1) or {"t": torch.ones(2)})
    assert made == [1] and torch.equal(again["t"], torch.zeros(2))
    assert cached(None, "s", lambda: 1 / 0, lambda: 7) == 7  # no cache: no key computed


def test_memory_cache_drops_the_least_recently_used_beyond_max_items():
    cache = MemoryCache(max_items=2)
    for k in "abc":
        cache.put("s", k, k)
        if k == "b":
            assert cache.get("s", "a") == "a"  # a used after b: b goes first
    assert cache.get("s", "b") is None and cache.get("s", "a") == "a" and cache.get("s", "c") == "c"
