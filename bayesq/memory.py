"""Peak memory of a BayesQ run, estimated before it starts, and a clear error when it cannot fit.

The estimate is empirical: four terms, the first two with constants fitted (least squares, the
activation factors kept from an earlier fit) to the peak resident memory beyond the model and
inputs that ``benchmarks/scale.py`` measured for BayesQ's default at 3.0 bits on a 2-core CPU,
2026-11-28 at 57f100a (128 calibration + 128 selection inputs of 128 tokens or 224 px, batches
of 8; the posterior released before the candidates are scored and the input moments layer by
layer as encoded): EfficientNet-Lite0 0.32 GiB, the MiniLM classifier 0.54, ResNet-50 1.67,
BERT-base 1.87, GPT-2 small 2.38. The fit gives 0.29 / 0.65 / 1.56 / 1.93 / 2.29 GiB (-9 % to
+21 %):

    peak ~ BYTES_PER_WEIGHT * P_q                 (posterior, tables, candidates, encodings)
         + BYTES_PER_MOMENT * M                   (input moments; one layer's damped metric and factor)
         + ACTIVATION_FACTOR * A                  (the curvature pass's forward + backward)
         + LOGIT_FACTOR * 8 * R * V               (per-token predictive in float64)

P_q: weights of the layers to quantise; M: elements of their d_in x d_in input moments (per
convolution group: wide convolutions and MLP projections hold large ones); A: bytes of every
module's output on the inputs of one curvature pass (measured by one forward pass of the first
calibration batch, no gradients, and scaled to the pass); R x V: those inputs' per-token logits
(language models; 0 for one row per input). The curvature pass holds at most
:attr:`MemoryEstimate.pass_inputs` inputs: the batch when its two last terms fit in
``PASS_BYTES``, else the most that fit in ``PART_BYTES`` (at least one; batches run in parts,
:func:`bayesq.posterior.fit_posterior`'s ``max_inputs``).
:func:`check` compares it with what the model's device has free (``MemAvailable`` and the
process's data limit on the CPU, ``torch.cuda.mem_get_info`` plus PyTorch's reusable cache on a
GPU) and raises :class:`InsufficientMemoryError` naming the estimate, each term and what lowers it.
"""

from __future__ import annotations

import ctypes
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from bayesq.forward import Batch, batch_size, hooked_call, output_logits

BYTES_PER_WEIGHT = 4
BYTES_PER_MOMENT = 10
ACTIVATION_FACTOR = 2.0
LOGIT_FACTOR = 7.5
PASS_BYTES = 512 * 2**20  # activation + logit terms of a batch that one curvature pass holds whole ...
PART_BYTES = 256 * 2**20  # ... else of each part it runs in (benchmarks/scale.py)
GIB = 2**30


def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to call
        return None


_TRIM = _malloc_trim()


def release_freed() -> None:
    """Return the free pages of the C heap to the system (glibc's ``malloc_trim``; a no-op without
    glibc). Tensors below glibc's mmap threshold (up to 32 MiB: most layers' float64 working
    copies) are freed into the heap and stay resident, so a loop over layers whose temporaries
    differ in size grows the resident set well past what it holds (1 GiB of GPT-2 small's peak);
    called between layers and batches, it costs milliseconds."""
    if _TRIM is not None:
        _TRIM(0)


class LazyMap(Mapping[str, torch.Tensor]):
    """name -> ``make(name)``, made on every access and not kept: a per-layer tensor (e.g. a
    float64 metric shaped like the weight) that a loop over layers reads once, so one layer's is
    held at a time instead of the whole model's."""

    def __init__(self, names: Iterable[str], make: Callable[[str], torch.Tensor]) -> None:
        self._names, self._make = tuple(names), make
        self._known = frozenset(self._names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        return self._make(name)

    def __contains__(self, name: object) -> bool:  # without making the value
        return name in self._known

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class InsufficientMemoryError(MemoryError):
    """The estimated peak exceeds the memory free on the model's device (nothing was changed)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak bytes of a BayesQ run beyond the model itself, by term.

    Attributes:
        weights: the per-weight term (bytes).
        activations, logits: the activation and per-token log-probability terms of one input
            (bytes; logits 0 without a token axis).
        n_weights: weights to quantise.
        batch: inputs in the first calibration batch.
        moments: the input-moment term (bytes).
        n_moments: elements of the layers' d_in x d_in input moments.
    """

    weights: int
    activations: int
    logits: int
    n_weights: int
    batch: int
    moments: int = 0
    n_moments: int = 0

    @property
    def pass_inputs(self) -> int:
        """Inputs one curvature pass holds: the whole batch when its activation and logit terms
        fit in ``PASS_BYTES``, else the most whose terms fit in ``PART_BYTES`` (at least one): a
        batch that has to run in parts runs in parts small enough to lower the peak."""
        per = self.activations + self.logits
        if per * self.batch <= PASS_BYTES:
            return self.batch
        return max(1, min(self.batch, PART_BYTES // per))

    @property
    def total(self) -> int:
        return self.weights + self.moments + self.pass_inputs * (self.activations + self.logits)

    def describe(self) -> str:
        k = self.pass_inputs
        parts = [f"{self.weights / GIB:.2f} GiB for {self.n_weights:,} weights to quantise",
                 f"{self.moments / GIB:.2f} GiB for their layers' input moments ({self.n_moments:,} elements)",
                 f"{k * self.activations / GIB:.2f} GiB for the activations of a curvature pass over {k} "
                 f"input{'s' if k > 1 else ''}"]
        if self.logits:
            parts.append(f"{k * self.logits / GIB:.2f} GiB for their per-token log-probabilities")
        return f"about {self.total / GIB:.2f} GiB ({', '.join(parts)})"


def _output_bytes(model: nn.Module, batch: Batch) -> tuple[int, int]:
    """(bytes of every module's tensor output, elements of the logits if per-token else 0) on ``batch``."""
    total = [0]

    def add(_m, _i, out) -> None:
        if isinstance(out, torch.Tensor):
            total[0] += out.numel() * out.element_size()

    z = output_logits(hooked_call(model, batch, post=[(m, add) for m in model.modules()]))
    return total[0], z.numel() if z.dim() == 3 else 0


def estimate(model: nn.Module, layers: dict[str, nn.Module], calibration: list[Batch]) -> MemoryEstimate:
    """:class:`MemoryEstimate` for quantising ``layers`` of ``model`` on ``calibration`` (one
    forward pass of its first batch; the model's state and every random generator untouched)."""
    n_weights = sum(m.weight.numel() for m in layers.values())
    n_moments = sum(getattr(m, "groups", 1) * (m.weight[0].numel()) ** 2 for m in layers.values())
    acts, logit_elements = _output_bytes(model, calibration[0])
    n = batch_size(calibration[0])
    return MemoryEstimate(BYTES_PER_WEIGHT * n_weights, int(ACTIVATION_FACTOR * acts / n),
                          int(LOGIT_FACTOR * 8 * logit_elements / n), n_weights, n,
                          BYTES_PER_MOMENT * n_moments, n_moments)


def _data_limit_room() -> int | None:
    """Bytes left under the process's data-segment limit (``ulimit -d``), None without one."""
    soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    used = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmData:")), 0)
    return max(0, soft - used)


def available_bytes(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device``; None where it cannot be read (no check then)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    free = next((int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:")), None)
    room = _data_limit_room()
    if free is None:
        return room
    return free if room is None else min(free, room)


def check(est: MemoryEstimate, device: torch.device) -> None:
    """Raise :class:`InsufficientMemoryError` when ``est`` exceeds what ``device`` has free."""
    free = available_bytes(device)
    if free is None or est.total <= free:
        return
    raise InsufficientMemoryError(
        f"BayesQ needs {est.describe()} on {device}, but only {free / GIB:.2f} GiB is free. "
        "Lower it: shorter inputs (fewer tokens or pixels: the activation part), `exclude=` for layers to keep in "
        "floating point (the weight and input-moment parts), or run on a device with more memory; "
        "`check_memory=False` runs anyway (on the five models of benchmarks/scale.py the estimate was from 9 % under "
        "to 81 % over the peaks measured).")
