"""ImageNet-C-style image corruptions and the mean Corruption Error (mCE).

Re-implements, in pure PyTorch, ten of the fifteen corruptions of ImageNet-C
(Hendrycks & Dietterich, "Benchmarking Neural Network Robustness to Common
Corruptions and Perturbations", ICLR 2019), each at five severities, so that a
classifier (e.g. a quantized Fashion-MNIST model) can be evaluated under
distribution shift without extra dependencies.

Families (``FAMILIES``):

* noise:   gaussian_noise, shot_noise, impulse_noise
* blur:    gaussian_blur, defocus_blur
* weather: fog, brightness
* digital: contrast, pixelate, jpeg_compression

Severity constants are ImageNet-C's wherever the constant is an intensity or a
ratio (noise std, photon count, salt-and-pepper amount, brightness shift,
contrast factor, pixelation factor, JPEG quality).  Where a constant is a size
in pixels (blur sigma, defocus disk radius, fog field size) it is adapted to
small 28x28 images: ImageNet-C's values divided by 224 / 28 = 8 would give
sub-pixel kernels that barely alter a 28-pixel image, so the blur constants
follow CIFAR-10-C's (32-pixel images) Gaussian-blur sigmas, extended so that
severity 5 visibly smears a Fashion-MNIST garment, and fog uses CIFAR-10-C's
(strength, decay) pairs with a plasma field of the next power of two >= the
image side (32 for 28x28).  Deviations from the reference implementation:

* brightness adds the shift to every channel's intensity (for grey images this
  is exactly ImageNet-C's "add to HSV value"; for colour images it is the usual
  approximation);
* defocus blur uses an anti-aliased (area-coverage) disk kernel instead of a
  binary disk followed by a Gaussian "alias blur";
* blurs pad by edge replication (skimage's ``mode="nearest"``);
* outputs are rounded to the nearest uint8 level rather than truncated.

Images are uint8, shaped (N, H, W) (grey) or (N, C, H, W); every corruption
works in float32 on [0, 1], acts on each channel alike (random fields are shared
across the channels of one image) and clips back to [0, 255].  Randomness comes
from a ``torch.Generator`` seeded by ``seed``: the same arguments always give
the same output and the global RNG state is never touched.

mean Corruption Error (Hendrycks & Dietterich, eq. 1): with E^f_{s,c} the top-1
error of classifier f on corruption c at severity s and a reference classifier
(AlexNet in the paper, e.g. the full-precision model here),

    CE^f_c = (sum_{s=1}^{5} E^f_{s,c}) / (sum_{s=1}^{5} E^ref_{s,c}),
    mCE^f  = mean_c CE^f_c.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.io import ImageReadMode, decode_jpeg, encode_jpeg

# --- severity constants (index = severity - 1) --------------------------------

GAUSSIAN_NOISE_STD: tuple[float, ...] = (0.08, 0.12, 0.18, 0.26, 0.38)
"""Std of additive N(0, std^2) noise on [0, 1] intensities (ImageNet-C)."""
SHOT_NOISE_PHOTONS: tuple[float, ...] = (60.0, 25.0, 12.0, 5.0, 3.0)
"""Photon count: out = Poisson(x * photons) / photons (ImageNet-C)."""
IMPULSE_NOISE_AMOUNT: tuple[float, ...] = (0.03, 0.06, 0.09, 0.17, 0.27)
"""Fraction of pixels replaced by salt (1) or pepper (0), half each (ImageNet-C)."""
GAUSSIAN_BLUR_SIGMA: tuple[float, ...] = (0.4, 0.6, 0.8, 1.0, 1.3)
"""Gaussian kernel std in pixels (CIFAR-10-C's 0.4-0.8 range, extended; 28x28 scale)."""
DEFOCUS_BLUR_RADIUS: tuple[float, ...] = (0.7, 1.0, 1.5, 2.0, 2.5)
"""Disk kernel radius in pixels (28x28 scale; severity 5 ~ a 5x5 neighbourhood)."""
FOG_PARAMS: tuple[tuple[float, float], ...] = (
    (0.2, 3.0),
    (0.5, 3.0),
    (0.75, 2.5),
    (1.0, 2.0),
    (1.5, 1.75),
)
"""(strength a, plasma wibble decay) pairs (CIFAR-10-C): out = (x + a fog) max / (max + a)."""
BRIGHTNESS_SHIFT: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5)
"""Shift added to [0, 1] intensity (ImageNet-C's HSV-value shift)."""
CONTRAST_FACTOR: tuple[float, ...] = (0.4, 0.3, 0.2, 0.1, 0.05)
"""out = (x - mean) * factor + mean, mean over each image channel (ImageNet-C)."""
PIXELATE_FACTOR: tuple[float, ...] = (0.6, 0.5, 0.4, 0.3, 0.25)
"""Box-downsample to floor(side * factor), centre-aligned nearest upsample back (ImageNet-C)."""
JPEG_QUALITY: tuple[int, ...] = (25, 18, 15, 10, 7)
"""JPEG encoder quality (ImageNet-C)."""

FAMILIES: dict[str, tuple[str, ...]] = {
    "noise": ("gaussian_noise", "shot_noise", "impulse_noise"),
    "blur": ("gaussian_blur", "defocus_blur"),
    "weather": ("fog", "brightness"),
    "digital": ("contrast", "pixelate", "jpeg_compression"),
}
CORRUPTIONS: tuple[str, ...] = tuple(name for names in FAMILIES.values() for name in names)

_Corruption = Callable[[Tensor, int, torch.Generator], Tensor]


# --- helpers -------------------------------------------------------------------


def _check_images(images: Tensor) -> None:
    """Raise ValueError unless ``images`` is uint8 shaped (N, H, W) or (N, C, H, W)."""
    if not isinstance(images, Tensor) or images.dtype != torch.uint8 or images.ndim not in (3, 4):
        got = (
            f"{images.dtype} tensor of shape {tuple(images.shape)}"
            if isinstance(images, Tensor)
            else type(images).__name__
        )
        raise ValueError(f"expected a uint8 tensor shaped (N, H, W) or (N, C, H, W), got {got}")


def _check_name_severity(name: str, severity: int) -> None:
    """Raise ValueError for an unknown corruption name or a severity outside 1..5."""
    if name not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {name!r}; valid names: {', '.join(CORRUPTIONS)}")
    if isinstance(severity, bool) or not isinstance(severity, int) or not 1 <= severity <= 5:
        raise ValueError(f"severity must be an integer in 1..5 (valid range), got {severity!r}")


def _to_uint8(x: Tensor) -> Tensor:
    """float [0, 1] -> uint8 [0, 255], clipped and rounded to nearest."""
    return (x.clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)


def _conv_same(x: Tensor, kernel: Tensor) -> Tensor:
    """Convolve every channel of x (N, C, H, W) with a 2-D odd-sized kernel (kh, kw).

    Edge-replicate padding keeps the spatial size.
    """
    n, c, h, w = x.shape
    kh, kw = kernel.shape
    flat = F.pad(x.reshape(n * c, 1, h, w), (kw // 2, kw // 2, kh // 2, kh // 2), mode="replicate")
    return F.conv2d(flat, kernel.to(x.dtype)[None, None]).reshape(n, c, h, w)


def _gaussian_kernel_1d(sigma: float, truncate: float = 4.0) -> Tensor:
    """Normalised float32 Gaussian taps, radius ceil(truncate * sigma) (skimage default)."""
    radius = max(1, math.ceil(truncate * sigma))
    t = torch.arange(-radius, radius + 1, dtype=torch.float64)
    k = torch.exp(-0.5 * (t / sigma) ** 2)
    return (k / k.sum()).float()


def _disk_kernel(radius: float, supersample: int = 16) -> Tensor:
    """Anti-aliased disk: each tap = fraction of its unit pixel inside the disk, normalised.

    Returns float32 (2R+1, 2R+1) with R = ceil(radius).
    """
    half = math.ceil(radius)
    sub = (torch.arange(supersample, dtype=torch.float64) + 0.5) / supersample - 0.5
    centres = torch.arange(-half, half + 1, dtype=torch.float64)
    coords = (centres[:, None] + sub[None, :]).reshape(-1)  # (K * s,)
    inside = (coords[:, None] ** 2 + coords[None, :] ** 2 <= radius**2).to(torch.float64)
    k = 2 * half + 1
    cover = inside.reshape(k, supersample, k, supersample).mean(dim=(1, 3))
    return (cover / cover.sum()).float()


def _box_matrix(n_in: int, n_out: int) -> Tensor:
    """float32 (n_out, n_in) exact box-filter resampling weights (PIL ``Image.BOX``).

    Row i averages the input pixels overlapping [i, i + 1) * n_in / n_out, each
    weighted by its overlap length; rows sum to 1.
    """
    edges_in = torch.arange(n_in + 1, dtype=torch.float64)
    edges_out = torch.linspace(0.0, float(n_in), n_out + 1, dtype=torch.float64)
    lo = torch.maximum(edges_out[:-1, None], edges_in[None, :-1])
    hi = torch.minimum(edges_out[1:, None], edges_in[None, 1:])
    overlap = (hi - lo).clamp_min(0.0)
    return (overlap / overlap.sum(dim=1, keepdim=True)).float()


def _plasma_fractal(n: int, mapsize: int, decay: float, gen: torch.Generator) -> Tensor:
    """Diamond-square plasma fields as in ImageNet-C's ``plasma_fractal``.

    Args:
        n: number of independent fields.
        mapsize: side, a power of two.
        decay: factor by which the random "wibble" shrinks at each halving of the step
            (larger -> smoother fog).
        gen: CPU generator drawing the uniforms.

    Returns:
        float64 (n, mapsize, mapsize), each field rescaled to [0, 1].
    """
    m = torch.zeros(n, mapsize, mapsize, dtype=torch.float64)
    step, wibble = mapsize, 100.0

    def wibbled_mean(total: Tensor) -> Tensor:
        u = torch.rand(total.shape, generator=gen, dtype=torch.float64) * 2.0 - 1.0
        return total / 4.0 + wibble * wibble * u  # ImageNet-C: wibble * U(-wibble, wibble)

    while step >= 2:
        h = step // 2
        corners = m[:, 0::step, 0::step]
        squares = corners + corners.roll(-1, 1)
        squares = squares + squares.roll(-1, 2)
        m[:, h::step, h::step] = wibbled_mean(squares)
        dr, ul = m[:, h::step, h::step], m[:, 0::step, 0::step]
        m[:, 0::step, h::step] = wibbled_mean(dr + dr.roll(1, 1) + ul + ul.roll(-1, 2))
        m[:, h::step, 0::step] = wibbled_mean(dr + dr.roll(1, 2) + ul + ul.roll(-1, 1))
        step, wibble = h, wibble / decay
    m = m - m.amin(dim=(1, 2), keepdim=True)
    return m / m.amax(dim=(1, 2), keepdim=True).clamp_min(1e-12)


# --- corruptions: float32 (N, C, H, W) in [0, 1] -> float32 same shape ------------


def _gaussian_noise(x: Tensor, severity: int, gen: torch.Generator) -> Tensor:
    noise = torch.randn(x.shape, generator=gen, dtype=torch.float32)
    return x + GAUSSIAN_NOISE_STD[severity - 1] * noise


def _shot_noise(x: Tensor, severity: int, gen: torch.Generator) -> Tensor:
    photons = SHOT_NOISE_PHOTONS[severity - 1]
    return torch.poisson(x * photons, generator=gen) / photons


def _impulse_noise(x: Tensor, severity: int, gen: torch.Generator) -> Tensor:
    hit = torch.rand(x.shape, generator=gen) < IMPULSE_NOISE_AMOUNT[severity - 1]
    salt = torch.rand(x.shape, generator=gen) < 0.5
    return torch.where(hit, salt.to(x.dtype), x)


def _gaussian_blur(x: Tensor, severity: int, gen: torch.Generator) -> Tensor:
    k = _gaussian_kernel_1d(GAUSSIAN_BLUR_SIGMA[severity - 1])
    return _conv_same(_conv_same(x, k[None, :]), k[:, None])


def _defocus_blur(x: Tensor, severity: int, gen: torch.Generator) -> Tensor:
    return _conv_same(x, _disk_kernel(DEFOCUS_BLUR_RADIUS[severity - 1]))


def _fog(x: Tensor, severity: int, gen: torch.Generator) -> Tensor:
    strength, decay = FOG_PARAMS[severity - 1]
    n, _, h, w = x.shape
    mapsize = 1 << max(1, math.ceil(math.log2(max(h, w))))
    fog = _plasma_fractal(n, mapsize, decay, gen)[:, None, :h, :w].to(x.dtype)
    peak = x.amax(dim=(1, 2, 3), keepdim=True)
    return (x + strength * fog) * peak / (peak + strength)


def _brightness(x: Tensor, severity: int, gen: torch.Generator) -> Tensor:
    return x + BRIGHTNESS_SHIFT[severity - 1]


def _contrast(x: Tensor, severity: int, gen: torch.Generator) -> Tensor:
    mean = x.mean(dim=(2, 3), keepdim=True)
    return (x - mean) * CONTRAST_FACTOR[severity - 1] + mean


def _pixelate(x: Tensor, severity: int, gen: torch.Generator) -> Tensor:
    """Exact box (area) downsample, then centre-aligned nearest upsample (PIL BOX both ways)."""
    h, w = x.shape[-2:]
    factor = PIXELATE_FACTOR[severity - 1]
    rows = _box_matrix(h, max(1, int(h * factor)))
    cols = _box_matrix(w, max(1, int(w * factor)))
    small = rows @ x @ cols.T
    return F.interpolate(small, size=(h, w), mode="nearest-exact")


def _jpeg_compression(x: Tensor, severity: int, gen: torch.Generator) -> Tensor:
    """RGB JPEG for 3 channels, otherwise each channel as a greyscale JPEG."""
    n, c, h, w = x.shape
    u8 = _to_uint8(x)
    if c == 3:
        planes, mode = list(u8), ImageReadMode.RGB
    else:
        planes, mode = list(u8.reshape(n * c, 1, h, w)), ImageReadMode.GRAY
    encoded = encode_jpeg(planes, quality=JPEG_QUALITY[severity - 1])
    decoded = decode_jpeg(encoded, mode=mode)
    return torch.stack(decoded).reshape(n, c, h, w).to(torch.float32) / 255.0


_FUNCTIONS: dict[str, _Corruption] = {
    "gaussian_noise": _gaussian_noise,
    "shot_noise": _shot_noise,
    "impulse_noise": _impulse_noise,
    "gaussian_blur": _gaussian_blur,
    "defocus_blur": _defocus_blur,
    "fog": _fog,
    "brightness": _brightness,
    "contrast": _contrast,
    "pixelate": _pixelate,
    "jpeg_compression": _jpeg_compression,
}


# --- public API ------------------------------------------------------------------


def corrupt(images: Tensor, name: str, severity: int, seed: int = 0) -> Tensor:
    """Apply one ImageNet-C-style corruption at one severity.

    Args:
        images: uint8 (N, H, W) grey images or uint8 (N, C, H, W), any device.
        name: one of ``CORRUPTIONS``.
        severity: integer in 1..5.
        seed: seed of the private ``torch.Generator`` (global RNG untouched); the
            same (images, name, severity, seed) always gives the same output.

    Returns:
        uint8 tensor with the shape and device of ``images``.

    Raises:
        ValueError: unknown ``name`` (lists the valid names), ``severity`` outside
            1..5, or ``images`` not uint8 (N, H, W) / (N, C, H, W).
    """
    _check_images(images)
    _check_name_severity(name, severity)
    if images.numel() == 0:
        return images.clone()
    x = images.detach().to("cpu", torch.float32) / 255.0
    x = x[:, None] if images.ndim == 3 else x
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    out = _to_uint8(_FUNCTIONS[name](x, severity, gen))
    return out.reshape(images.shape).to(images.device)


def corruption_errors_to_mce(
    errors: Mapping[str, Sequence[float]],
    reference: Mapping[str, Sequence[float]],
) -> tuple[float, dict[str, float]]:
    """Mean Corruption Error of a model relative to a reference model.

    For each corruption c of ``errors`` (severities s = 1..S, usually S = 5):

        CE_c = sum_s errors[c][s] / sum_s reference[c][s]
        mCE  = (1 / |C|) * sum_c CE_c

    Args:
        errors: corruption name -> error rates of the evaluated model per severity.
        reference: corruption name -> error rates of the reference model (same
            lengths); extra corruptions in ``reference`` are ignored.

    Returns:
        (mCE, {c: CE_c}) as Python floats, keys in the order of ``errors``.

    Raises:
        ValueError: ``errors`` empty, a corruption missing from ``reference``, a
            length mismatch, or a reference sum of 0 (the corruption is named).
    """
    if not errors:
        raise ValueError("errors is empty: no corruption to average")
    ce: dict[str, float] = {}
    for c, errs in errors.items():
        if c not in reference:
            raise ValueError(f"corruption {c!r} is missing from reference")
        ref = reference[c]
        if len(errs) != len(ref):
            raise ValueError(
                f"corruption {c!r}: {len(errs)} error values but {len(ref)} reference values; "
                "lengths must match"
            )
        ref_sum = math.fsum(float(v) for v in ref)
        if ref_sum == 0.0:
            raise ValueError(f"corruption {c!r}: reference errors sum to 0, CE undefined")
        ce[c] = math.fsum(float(v) for v in errs) / ref_sum
    return math.fsum(ce.values()) / len(ce), ce
