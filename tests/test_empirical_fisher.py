"""Empirical Fisher diagonal (given or argmax labels) vs a per-example autograd loop."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bayesq.blocks import quantizable_layers
from bayesq.curvature.fisher import empirical_fisher_diagonal
from nets import TokenModel


pytestmark = pytest.mark.usefixtures("one_thread")


def _cnn():
    return nn.Sequential(
        nn.Conv2d(2, 4, 2, stride=2), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1, groups=2), nn.Tanh(), nn.Flatten(),
        nn.Linear(4 * 3 * 3, 3),
    ).double()


def _item(batch, i):
    return {k: v[i:i + 1] for k, v in batch.items()} if isinstance(batch, dict) else batch[i:i + 1]


def _call(model, batch):
    return model(**batch) if isinstance(batch, dict) else model(batch)


def _reference(model, layers, batches, labels):
    """sum_n g_n(y_n)^2 from one autograd call per example; labels=None -> argmax labels."""
    ref = {n: torch.zeros_like(m.weight) for n, m in layers.items()}
    weights = [m.weight for m in layers.values()]
    for b, batch in enumerate(batches):
        n = len(batch["mask"]) if isinstance(batch, dict) else len(batch)
        for i in range(n):
            out = _call(model, _item(batch, i))  # (1, C)
            y = out.detach().argmax(-1) if labels is None else labels[b][i:i + 1]
            for name, g in zip(layers, torch.autograd.grad(F.cross_entropy(out, y), weights)):
                ref[name] += g.pow(2)
    return ref


def _cnn_setup():
    torch.manual_seed(0)
    model = _cnn().eval()
    batches = [torch.randn(4, 2, 6, 6, dtype=torch.float64) for _ in range(2)]
    return model, quantizable_layers(model), batches


@pytest.mark.parametrize("given", [True, False])
def test_empirical_fisher_vs_per_example_autograd_cnn(given):
    model, layers, batches = _cnn_setup()
    labels = [torch.randint(0, 3, (4,), generator=torch.Generator().manual_seed(b)) for b in range(2)] if given else None
    got, n = empirical_fisher_diagonal(model, batches, layers, labels=labels, progress=False)
    ref = _reference(model, layers, batches, labels)
    assert n == 8
    for name in layers:
        assert got[name].dtype == torch.float64
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12)


def test_empirical_fisher_vs_per_example_autograd_tokens():
    torch.manual_seed(1)
    model = TokenModel().double().eval()
    layers = quantizable_layers(model)
    batches = [{"input_ids": torch.randn(3, 4, 5, dtype=torch.float64),
                "mask": (torch.rand(3, 4) > 0.3).double()} for _ in range(2)]
    got, n = empirical_fisher_diagonal(model, batches, layers, progress=False)
    ref = _reference(model, layers, batches, None)
    assert n == 6
    for name in layers:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12)


def test_empirical_fisher_labels_accept_generator():
    model, layers, batches = _cnn_setup()
    labels = [torch.tensor([0, 1, 2, 0]), torch.tensor([2, 2, 1, 0])]
    from_list, _ = empirical_fisher_diagonal(model, batches, layers, labels=labels, progress=False)
    from_gen, _ = empirical_fisher_diagonal(model, batches, layers, labels=iter(labels), progress=False)
    assert all(torch.equal(from_list[n], from_gen[n]) for n in layers)


@pytest.mark.parametrize("labels, match", [
    ([torch.tensor([0, 1, 2, 0])], "fewer entries than batches"),
    ([torch.tensor([0, 1, 2, 0])] * 3, "more entries than batches"),
    ([torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2])], r"labels\[0\] has shape \(3,\)"),
    ([torch.zeros(4), torch.zeros(4)], r"labels\[0\] must be an integer tensor"),
    ([torch.tensor([0, 1, 2, 0]), torch.tensor([0, 3, 1, 1])], r"labels\[1\] holds class indices outside \[0, 3\)"),
])
def test_empirical_fisher_bad_labels_raise(labels, match):
    model, layers, batches = _cnn_setup()
    with pytest.raises(ValueError, match=match):
        empirical_fisher_diagonal(model, batches, layers, labels=labels, progress=False)


def test_empirical_fisher_empty_calibration_raises():
    model, layers, _ = _cnn_setup()
    with pytest.raises(ValueError, match="empty calibration set"):
        empirical_fisher_diagonal(model, [], layers, progress=False)


def test_empirical_fisher_restores_model_state():
    model, layers, batches = _cnn_setup()
    model.train()
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError):  # restored even when the pass fails midway
        empirical_fisher_diagonal(model, batches, layers, labels=[torch.tensor([0, 1, 2, 0])], progress=False)
    with torch.no_grad():  # the pass enables grad itself
        got, _ = empirical_fisher_diagonal(model, batches, layers, progress=False)
    assert all(got[n].abs().sum() > 0 for n in layers)
    assert model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
