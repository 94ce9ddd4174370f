import pytest
import torch

from bayesq.harness.corruptions import (
    CONTRAST_FACTOR,
    CORRUPTIONS,
    FAMILIES,
    GAUSSIAN_NOISE_STD,
    IMPULSE_NOISE_AMOUNT,
    corrupt,
    corruption_errors_to_mce,
)

NOISY = ("gaussian_noise", "shot_noise", "impulse_noise", "fog")


def _smooth_batch() -> torch.Tensor:
    """8 smooth 28x28 uint8 images (gradients blended with soft disks), values in [40, 215]."""
    t = torch.linspace(0.0, 1.0, 28, dtype=torch.float64)
    yy, xx = torch.meshgrid(t, t, indexing="ij")
    images = []
    for k in range(8):
        grad = [xx, yy, (xx + yy) / 2, 1 - xx][k % 4]
        cy, cx, r = 0.3 + 0.05 * k, 0.7 - 0.05 * k, 0.2 + 0.02 * k
        disk = torch.sigmoid((r - ((yy - cy) ** 2 + (xx - cx) ** 2).sqrt()) * 28 / 1.5)
        img = 0.5 * grad + 0.5 * disk if k % 2 else disk
        images.append(40 + 175 * img)
    return torch.stack(images).round().to(torch.uint8)


def _mean_abs_change(out: torch.Tensor, clean: torch.Tensor) -> float:
    return float((out.to(torch.float64) - clean.to(torch.float64)).abs().mean())


def test_constants_families_cover_corruptions_in_order():
    assert CORRUPTIONS == tuple(n for names in FAMILIES.values() for n in names)
    assert len(CORRUPTIONS) == 10
    assert set(FAMILIES) == {"noise", "blur", "weather", "digital"}


@pytest.mark.parametrize("name", CORRUPTIONS)
@pytest.mark.parametrize("shape", [(3, 28, 28), (2, 3, 28, 28), (2, 2, 20, 24)])
def test_corrupt_preserves_shape_and_dtype(name, shape):
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    out = corrupt(images, name, 3, seed=1)
    assert out.shape == images.shape
    assert out.dtype == torch.uint8


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_corrupt_same_seed_identical(name):
    images = _smooth_batch()
    state = torch.get_rng_state()
    a = corrupt(images, name, 4, seed=7)
    b = corrupt(images, name, 4, seed=7)
    assert torch.equal(a, b)
    assert torch.equal(state, torch.get_rng_state())  # global RNG untouched


@pytest.mark.parametrize("name", NOISY)
def test_corrupt_different_seed_differs_for_noise(name):
    images = _smooth_batch()
    assert not torch.equal(corrupt(images, name, 3, seed=0), corrupt(images, name, 3, seed=1))


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_corrupt_change_non_decreasing_in_severity(name):
    clean = _smooth_batch()
    changes = [_mean_abs_change(corrupt(clean, name, s, seed=3), clean) for s in range(1, 6)]
    assert changes[0] > 0.0, changes
    for lo, hi in zip(changes, changes[1:]):
        assert hi >= lo, changes


def test_corrupt_gray_equals_single_channel_layout():
    images = _smooth_batch()
    for name in CORRUPTIONS:
        gray = corrupt(images, name, 2, seed=5)
        chan = corrupt(images[:, None], name, 2, seed=5)
        assert torch.equal(gray, chan[:, 0]), name


@pytest.mark.parametrize("severity", [1, 3])
def test_gaussian_noise_std_matches_constant(severity):
    images = torch.full((8, 28, 28), 128, dtype=torch.uint8)
    out = corrupt(images, "gaussian_noise", severity, seed=0)
    diff = (out.to(torch.float64) - images.to(torch.float64)) / 255.0
    assert float(diff.std()) == pytest.approx(GAUSSIAN_NOISE_STD[severity - 1], rel=0.05)


def test_brightness_matches_hand_computed():
    images = torch.tensor([[[0, 100], [200, 250]]], dtype=torch.uint8)
    out = corrupt(images, "brightness", 2, seed=0)  # + 0.2 * 255 = + 51, clipped at 255
    assert out.tolist() == [[[51, 151], [251, 255]]]


def test_contrast_matches_hand_computed_per_image_mean():
    images = torch.tensor([[[0, 100], [200, 100]], [[10, 10], [30, 30]]], dtype=torch.uint8)
    out = corrupt(images, "contrast", 1, seed=0)  # (x - mean) * 0.4 + mean, means 100 and 20
    assert CONTRAST_FACTOR[0] == 0.4
    assert out.tolist() == [[[60, 100], [140, 100]], [[16, 16], [24, 24]]]


def test_pixelate_half_equals_block_means_upsampled():
    images = torch.arange(16, dtype=torch.float64).reshape(1, 4, 4).mul(13).add(7).to(torch.uint8)
    out = corrupt(images, "pixelate", 2, seed=0)  # factor 0.5
    x = images.to(torch.float64)[0]
    blocks = x.reshape(2, 2, 2, 2).mean(dim=(1, 3))
    expected = blocks.repeat_interleave(2, 0).repeat_interleave(2, 1)
    assert (out[0].to(torch.float64) - expected).abs().max() <= 0.5 + 1e-9


@pytest.mark.parametrize("severity", [1, 4])
def test_impulse_noise_fraction_close_to_amount(severity):
    images = torch.full((4, 64, 64), 128, dtype=torch.uint8)
    out = corrupt(images, "impulse_noise", severity, seed=2)
    hit = (out == 0) | (out == 255)
    amount = IMPULSE_NOISE_AMOUNT[severity - 1]
    assert float(hit.to(torch.float64).mean()) == pytest.approx(amount, abs=0.01)
    salt_share = float((out == 255).to(torch.float64).sum() / hit.to(torch.float64).sum())
    assert salt_share == pytest.approx(0.5, abs=0.1)
    assert torch.equal(out[~hit], images[~hit])


def test_corrupt_unknown_name_raises_with_valid_names():
    with pytest.raises(ValueError, match="unknown corruption.*gaussian_noise.*jpeg_compression"):
        corrupt(_smooth_batch(), "motion_blur", 1)


@pytest.mark.parametrize("severity", [0, 6, 2.5, True])
def test_corrupt_bad_severity_raises_range(severity):
    with pytest.raises(ValueError, match=r"1\.\.5"):
        corrupt(_smooth_batch(), "fog", severity)


@pytest.mark.parametrize(
    "images",
    [
        torch.zeros(2, 28, 28, dtype=torch.float32),
        torch.zeros(28, 28, dtype=torch.uint8),
        torch.zeros(1, 1, 1, 28, 28, dtype=torch.uint8),
    ],
)
def test_corrupt_bad_input_raises_expected_layout(images):
    with pytest.raises(ValueError, match=r"uint8.*\(N, H, W\) or \(N, C, H, W\)"):
        corrupt(images, "brightness", 1)


def test_mce_matches_hand_computed_two_corruptions():
    errors = {"a": [0.2, 0.4], "b": [0.5, 0.5]}
    reference = {"a": [0.4, 0.6], "b": [0.5, 1.5], "unused": [1.0]}
    mce, ce = corruption_errors_to_mce(errors, reference)
    assert ce == pytest.approx({"a": 0.6, "b": 0.5}, abs=1e-12)  # 0.6 / 1.0, 1.0 / 2.0
    assert mce == pytest.approx(0.55, abs=1e-12)
    assert list(ce) == ["a", "b"]


@pytest.mark.parametrize(
    "errors, reference, words",
    [
        ({"a": [0.1]}, {"b": [0.1]}, "'a' is missing from reference"),
        ({"a": [0.1, 0.2]}, {"a": [0.1]}, "'a'.*lengths must match"),
        ({"a": [0.1, 0.2]}, {"a": [0.0, 0.0]}, "'a'.*sum to 0"),
        ({}, {"a": [0.1]}, "empty"),
    ],
)
def test_mce_invalid_inputs_raise(errors, reference, words):
    with pytest.raises(ValueError, match=words):
        corruption_errors_to_mce(errors, reference)
