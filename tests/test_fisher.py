import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bayesq.blocks import quantizable_layers
from bayesq.curvature.fisher import fisher_diagonal
from nets import SamePadConv, TokenModel


def _cnn():
    return nn.Sequential(
        SamePadConv(2, 4, 2, stride=2), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1, groups=2), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1, groups=4, dilation=1), nn.Flatten(),
        nn.Linear(4 * 3 * 3, 3),
    ).double()


def _reference(model, layers, batches, label_samples, seed):
    """Per-example loop with the same sampled labels (generator replayed in the same order)."""
    gen = torch.Generator().manual_seed(seed)
    ref = {n: torch.zeros_like(m.weight) for n, m in layers.items()}
    for batch in batches:
        out = model(**batch) if isinstance(batch, dict) else model(batch)
        probs = torch.softmax(out.detach().double(), -1)
        for _ in range(label_samples):
            y = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            for i in range(len(y)):
                item = {k: v[i:i + 1] for k, v in batch.items()} if isinstance(batch, dict) else batch[i:i + 1]
                o = model(**item) if isinstance(item, dict) else model(item)
                grads = torch.autograd.grad(F.cross_entropy(o, y[i:i + 1]), [m.weight for m in layers.values()])
                for (n, _), g in zip(layers.items(), grads):
                    ref[n] += g.pow(2) / label_samples
    return ref


@pytest.mark.parametrize("label_samples", [1, 3])
def test_fisher_diagonal_vs_per_example_autograd_cnn(label_samples):
    torch.manual_seed(0)
    model = _cnn().eval()
    layers = quantizable_layers(model)
    batches = [torch.randn(4, 2, 6, 6, dtype=torch.float64) for _ in range(2)]
    got, n = fisher_diagonal(model, batches, layers, label_samples=label_samples, seed=3, progress=False)
    ref = _reference(model, layers, batches, label_samples, 3)
    assert n == 8
    for name in layers:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("conv", [dict(padding=1, padding_mode="reflect"), dict(padding=1, padding_mode="circular"),
                                  dict(padding=2, padding_mode="replicate", dilation=2),
                                  dict(padding="same", dilation=2), dict(padding="same", padding_mode="reflect")])
def test_fisher_diagonal_vs_per_example_autograd_padding_modes(conv):
    """Padding modes other than zeros and ``padding="same"``: the patches are padded as the
    convolution pads them (before: zero-padded, 62-73 % off; "same" raised)."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, **conv), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3)).double()
    model(torch.zeros(1, 2, 6, 6, dtype=torch.float64))  # materialise the lazy layer
    model.eval()
    layers = quantizable_layers(model)
    batches = [torch.randn(4, 2, 6, 6, dtype=torch.float64)]
    got, _ = fisher_diagonal(model, batches, layers, seed=2, progress=False)
    ref = _reference(model, layers, batches, 1, 2)
    for name in layers:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12)


def test_fisher_diagonal_vs_per_example_autograd_tokens():
    torch.manual_seed(1)
    model = TokenModel().double().eval()
    layers = quantizable_layers(model)
    batches = [{"input_ids": torch.randn(3, 4, 5, dtype=torch.float64),
                "mask": (torch.rand(3, 4) > 0.3).double()}]
    got, _ = fisher_diagonal(model, batches, layers, seed=5, progress=False)
    ref = _reference(model, layers, batches, 1, 5)
    for name in layers:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12)


def test_fisher_diagonal_float32_model_vs_float64():
    """A float32 model squares and sums each batch in float32 (accumulating in float64): the
    diagonal matches the float64 model's to float32 accuracy, and comes back in float64."""
    torch.manual_seed(2)
    model = _cnn().eval()
    layers = quantizable_layers(model)
    batches = [torch.randn(32, 2, 6, 6, dtype=torch.float64) for _ in range(2)]
    ref, _ = fisher_diagonal(model, batches, layers, seed=4, progress=False)
    model32 = model.float()
    got, _ = fisher_diagonal(model32, [b.float() for b in batches], quantizable_layers(model32), seed=4,
                             progress=False)
    for name in layers:
        assert got[name].dtype == torch.float64
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-9 * float(ref[name].max()))


def test_fisher_diagonal_empty_calibration_raises():
    model = _cnn()
    with pytest.raises(ValueError, match="empty calibration set"):
        fisher_diagonal(model, [], quantizable_layers(model), progress=False)


def test_fisher_diagonal_restores_model_state():
    model = _cnn().train()
    for p in model.parameters():
        p.requires_grad_(False)
    fisher_diagonal(model, [torch.randn(2, 2, 6, 6, dtype=torch.float64)], quantizable_layers(model), progress=False)
    assert model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())


def test_fisher_diagonal_leaves_existing_grads_and_sets_no_other():
    model = _cnn()
    head = model[-1]
    head.weight.grad = torch.full_like(head.weight, 7.0)  # the user's own gradient
    fisher_diagonal(model, [torch.randn(2, 2, 6, 6, dtype=torch.float64)], quantizable_layers(model), progress=False)
    assert torch.equal(head.weight.grad, torch.full_like(head.weight, 7.0))
    assert all(p.grad is None for p in model.parameters() if p is not head.weight)
