"""How the library calls a model on a calibration batch, whatever the batch looks like.

A batch is either a tensor (images, (B, C, H, W)) or a mapping of tensors passed as keyword
arguments (tokenised text: ``input_ids``, ``attention_mask``, ...). :func:`model_batches`
brings what a user passes to that form: an ``(inputs, labels)`` tuple or list gives its first
element (labels are never read), floating tensors are cast to the model's floating dtype, and
non-finite values are refused. Outputs may be a tensor of logits, an object with a ``.logits``
attribute (Hugging Face models), a mapping with a ``"logits"`` entry, or a tuple whose first
element is the logits (:func:`output_logits`). :func:`kept_state` gives the user's model back
as it came (modes, ``requires_grad``, ``.grad``).

Logits are one row per input, (B, C) (a classifier), or one row per token, (B, T, V) (a causal
language model). :func:`predictions` gives both with the (B, T) mask of the real tokens
(:func:`token_mask`: the batch's ``attention_mask``; None for (B, C)); every pass that reads the
predictive works on :func:`prediction_rows`, the (R, C) logits of the real tokens (R = B for a
classifier), and reduces per input with :func:`per_input`:

    loss_n = sum_{t: m_nt = 1} ell(z_nt)            (Fisher, K-FAC, Hutchinson: a sum per input)
    KL_n   = 1/T_n sum_{t: m_nt = 1} KL_nt,  T_n = sum_t m_nt    (evaluation: a mean per input)

so padding contributes nothing. A model without a head returns features, not logits
(:func:`output_likelihood`: ``gaussian``); :func:`predicted` says so next to them, and the passes
that read a predictive read a Gaussian around the features there (:class:`Likelihood`). Layer-input rows of padded tokens are dropped too
(:func:`token_rows`), where the logits have a token axis.
"""

from __future__ import annotations

from contextlib import contextmanager
from enum import Enum
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from bayesq.blocks import tied_layers

Batch = Any  # torch.Tensor | Mapping[str, torch.Tensor]


class Likelihood(str, Enum):
    """What a model's output is read as (:func:`output_likelihood`).

    ``categorical``: class logits ``z`` (B, C) or (B, T, V), ``p(y | x) = softmax(z)``.
    ``gaussian``: the features ``f`` of a model without a head (a Hugging Face base model's
    ``last_hidden_state``, (B, T, H)), ``p(y | x) = N(y; f, sigma^2 I)``: its negative
    log-likelihood at ``y = f_FP`` is the feature-matching loss ``||f - f_FP||^2 / (2 sigma^2)``,
    its Fisher the Gauss-Newton matrix ``J^T J / sigma^2`` (``J = df/dw``), and the KL between two
    models' predictives ``||f_P - f_Q||^2 / (2 sigma^2)`` per token.
    """

    CATEGORICAL = "categorical"
    GAUSSIAN = "gaussian"


GAUSSIAN_UNSUPPORTED = ("the model has no head (it returns features, read with a Gaussian likelihood) and {what} reads "
                        "a softmax over class logits: use posterior.curvature: fisher, whose Gauss-Newton matrix on "
                        "the features is the Fisher of that likelihood (or give the model a head)")


def _headless(out: Any) -> bool:
    return (not torch.is_tensor(out) and getattr(out, "logits", None) is None
            and not (isinstance(out, Mapping) and "logits" in out)
            and getattr(out, "last_hidden_state", None) is not None)


def output_likelihood(out: Any) -> Likelihood:
    """``gaussian`` for the output of a model without a head (an object with ``last_hidden_state``
    and no logits), else ``categorical``."""
    return Likelihood.GAUSSIAN if _headless(out) else Likelihood.CATEGORICAL


def output_logits(out: Any) -> torch.Tensor:
    """The logits in a model's output: a tensor, ``out.logits``, ``out["logits"]`` or ``out[0]``;
    for a model without a head (a Hugging Face base model, e.g. a sentence encoder) its features
    ``out.last_hidden_state``: (B, T, H) per token, or a convolutional (B, C, h, w) map as
    (B, h w, C), one row per position. Such features are read with a Gaussian likelihood
    (:class:`Likelihood`, :func:`predicted`), not through a softmax.

    Raises:
        TypeError: naming the type of ``out`` when it is none of these.
    """
    if torch.is_tensor(out):
        return out
    if getattr(out, "logits", None) is not None:
        return out.logits
    if isinstance(out, Mapping) and "logits" in out:
        return out["logits"]
    if getattr(out, "last_hidden_state", None) is not None:
        f = out.last_hidden_state
        return f.flatten(2).transpose(1, 2) if f.dim() == 4 else f
    if isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0]):
        return out[0]
    raise TypeError(f"the model returned a {type(out).__name__}; BayesQ reads the logits from a tensor, an object "
                    "with .logits, a dict with a 'logits' entry or a tuple whose first element is the logits: "
                    "wrap the model so its forward returns one of these")


def call(model: nn.Module, batch: Batch) -> Any:
    """``model``'s output on ``batch`` (a mapping is passed as keyword arguments): a forward pass
    whose output is not read (the hooks of a statistics pass)."""
    return model(**batch) if isinstance(batch, Mapping) else model(batch)


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode inside; on exit every module gets its own train/eval mode back
    (``model.train(flag)`` would give every submodule the top module's)."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training


def hooked_call(model: nn.Module, batch: Batch, post: Iterable[tuple[nn.Module, Callable]] = (),
                pre: Iterable[tuple[nn.Module, Callable]] = ()) -> Any:
    """``call(model, batch)`` once in eval mode without gradients, with forward hooks
    ``hook(module, inputs, output)`` (``post``) and pre-hooks ``hook(module, inputs)`` (``pre``)
    registered as (module, hook) pairs for that pass only; every module's mode given back."""
    handles = [m.register_forward_hook(h) for m, h in post] + [m.register_forward_pre_hook(h) for m, h in pre]
    try:
        with eval_mode(model), torch.no_grad():
            return call(model, batch)
    finally:
        for h in handles:
            h.remove()


class Taps:
    """Zero scalar leaves (float32, one per device) that :func:`layer_calls` with ``taps`` adds to
    every layer output made with gradients enabled: ``output + leaf`` has the output's values and
    dtype (a 0-dim tensor does not promote) and joins the autograd graph whatever requires grad,
    so ``torch.autograd.backward(loss, inputs=taps.leaves())`` runs the backward pass through every
    layer output that reaches the loss, firing the hooks registered on them, without forming any
    weight gradient and without collecting every output gradient until the pass ends (as
    ``torch.autograd.grad(loss, outputs)`` does)."""

    def __init__(self) -> None:
        self._leaves: dict[torch.device, torch.Tensor] = {}

    def __call__(self, output: torch.Tensor) -> torch.Tensor:
        leaf = self._leaves.get(output.device)
        if leaf is None:
            leaf = self._leaves[output.device] = torch.zeros((), device=output.device, requires_grad=True)
        return output + leaf

    def leaves(self) -> list[torch.Tensor]:
        return list(self._leaves.values())

    def clear(self) -> None:
        """Forget the leaves (and so the graphs they tie): call between batches."""
        self._leaves.clear()


@contextmanager
def layer_calls(
    model: nn.Module, layers: Mapping[str, nn.Module],
    on_call: Callable[[str, nn.Module, torch.Tensor, torch.Tensor], None], *, weights_require_grad: bool = False,
    taps: Taps | None = None,
) -> Iterator[None]:
    """The one hook harness of the statistics and curvature passes.

    Inside it every call of a module in ``layers`` runs ``on_call(name, module, input, output)``
    (``input``: its first positional input; ``output``: its output, still in the autograd graph),
    and the model is in eval mode (no dropout, batch-norm statistics frozen, so examples do not
    interact). A module holding the weight of one of ``layers`` (tied, same type and settings,
    :func:`bayesq.blocks.tied_layers`) calls ``on_call`` under that layer's name and module too:
    the statistics of a shared weight sum over every place it is used. ``weights_require_grad``:
    the layers' weights require grad inside, so their outputs join the autograd graph even when the user froze them (a curvature pass
    differentiates the outputs). On exit the hooks are removed and every module's mode and
    the weights' ``requires_grad`` are as they were. ``taps``: every output made with gradients
    enabled is replaced by ``taps(output)`` (:class:`Taps`), which ``on_call`` gets, and no
    parameter of the model requires grad inside (the outputs are differentiated, never a weight).
    """
    def hook(name: str, owner: nn.Module):
        def fn(mod, inputs, output):
            if taps is not None and torch.is_grad_enabled() and torch.is_tensor(output):
                output = taps(output)
            on_call(name, owner, inputs[0], output)
            return output
        return fn

    handles = [m.register_forward_hook(hook(n, m)) for n, m in layers.items()]
    for alias, owner in tied_layers(model, layers).items():
        mod = model.get_submodule(alias)
        if type(mod) is type(layers[owner]) and mod.extra_repr() == layers[owner].extra_repr():
            handles.append(mod.register_forward_hook(hook(owner, layers[owner])))
    params = list({id(p): p for p in [*model.parameters(), *(m.weight for m in layers.values())]}.values())
    needs_grad = [(p, p.requires_grad) for p in params]
    try:
        if taps is not None:
            for p in params:
                p.requires_grad_(False)
        if weights_require_grad:
            for m in layers.values():
                m.weight.requires_grad_(True)
        with eval_mode(model):
            yield
    finally:
        for h in handles:
            h.remove()
        for p, flag in needs_grad:
            p.requires_grad_(flag)


def token_mask(batch: Batch, z: torch.Tensor) -> torch.Tensor | None:
    """(B, T) bool mask of the real tokens of (B, T, V) logits ``z``; None for (B, C) logits.

    The real tokens are the batch's ``attention_mask`` (a mapping with that key), else every
    position.

    Raises:
        ValueError: logits of rank other than 2 or 3, or an ``attention_mask`` whose shape is not
            the logits' (B, T) (each naming the shapes).
    """
    if z.dim() == 2:
        return None
    if z.dim() != 3:
        raise ValueError(f"the model returned logits of shape {tuple(z.shape)}; BayesQ reads (batch, classes) "
                         "logits (a classifier) or (batch, tokens, vocabulary) logits (a language model): wrap the "
                         "model so that it returns one of these")
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if mask is None:
        return torch.ones(z.shape[:2], dtype=torch.bool, device=z.device)
    if tuple(mask.shape) != tuple(z.shape[:2]):
        raise ValueError(f"the model returned per-token logits of shape {tuple(z.shape)} but the batch's "
                         f"attention_mask has shape {tuple(mask.shape)}; BayesQ reads the real tokens of (batch, "
                         "tokens, vocabulary) logits from a (batch, tokens) attention_mask: pass the mask of the "
                         "tokens the logits are for, or no attention_mask (every token counts)")
    return mask.to(z.device) != 0


def predictions(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``model``'s logits on ``batch`` as returned, (B, C) or (B, T, V), and :func:`token_mask`
    of them ((B, T) bool, or None for (B, C)).

    Raises:
        ValueError: as :func:`token_mask`.
    """
    z = output_logits(call(model, batch))
    return z, token_mask(batch, z)


def predicted(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None, Likelihood]:
    """:func:`predictions` with the :class:`Likelihood` they are read with (one forward pass)."""
    out = call(model, batch)
    z = output_logits(out)
    return z, token_mask(batch, z), output_likelihood(out)


def prediction_rows(z: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The (R, C) logits the predictive is read on: ``z`` itself for (B, C) logits (R = B, the
    very tensor), the real tokens ``z[mask]`` of (B, T, V) logits (R = sum of the mask, in
    example then token order)."""
    return z if mask is None else z[mask]


def row_examples(mask: torch.Tensor | None, n: int, device: torch.device | None = None) -> torch.Tensor:
    """(R,) int64: the input each of :func:`prediction_rows`' rows belongs to (``arange(n)`` for
    (B, C) logits)."""
    if mask is None:
        return torch.arange(n, device=device)
    return mask.nonzero()[:, 0].to(device)


def per_input(values: torch.Tensor, mask: torch.Tensor | None, reduce: str = "mean") -> torch.Tensor:
    """(B,) per input from (R,) per-row ``values`` of :func:`prediction_rows`.

    (B, C) logits (``mask`` None): ``values`` itself. (B, T, V) logits: ``reduce="sum"``,
    ``sum_{t: m_nt} v_nt``; ``"mean"``, that sum over ``T_n = sum_t m_nt`` (an input without a
    real token gives 0).
    """
    if mask is None:
        return values
    idx = row_examples(mask, mask.shape[0], values.device)
    total = torch.zeros(mask.shape[0], dtype=values.dtype, device=values.device).index_add_(0, idx, values)
    if reduce == "sum":
        return total
    return total / mask.sum(1).clamp_min(1).to(device=values.device, dtype=values.dtype)


def token_rows(rows: torch.Tensor, a: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """A layer's input rows (N, groups, T, d_in) (:func:`bayesq.curvature.patches.input_rows`)
    without the padded tokens' rows: (1, 1, R, d_in), the R rows of real tokens.

    Applies where the layer reads one row per token: ``a`` is (B, L, d_in) with (B, L) the
    shape of the (B, L) token ``mask`` and ``rows`` is (B, 1, L, d_in); any other layer
    (convolutions, a head on a pooled (B, d) input), or ``mask`` None, gets ``rows`` as it came.
    Sums over rows (second moments, means over positions with the row count ``N * T``) then run
    over real tokens only.
    """
    if (mask is None or a.dim() != 3 or tuple(a.shape[:2]) != tuple(mask.shape)
            or tuple(rows.shape[:3]) != (mask.shape[0], 1, mask.shape[1])):
        return rows
    return rows[:, 0][mask.to(rows.device)][None, None]


def padding_mask(batch: Batch) -> torch.Tensor | None:
    """The (B, L) bool mask of a mapping batch's ``attention_mask`` when it masks out some token,
    else None (no padding to drop)."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if mask is None or not torch.is_tensor(mask) or mask.dim() != 2 or bool(mask.all()):
        return None
    return mask != 0


def drops_padding(model: nn.Module, batches: list[Batch]) -> bool:
    """Whether a pass over ``batches`` drops padded tokens' layer-input rows: some batch has
    padding (:func:`padding_mask`) and ``model``'s logits have a token axis (one forward pass of
    the first input, eval mode, no gradients; a classifier's layer inputs are kept as they are)."""
    if not any(padding_mask(b) is not None for b in batches):
        return False
    with eval_mode(model), torch.no_grad():
        return output_logits(call(model, first_inputs(batches, 1)[0])).dim() == 3


def logits(model: nn.Module, batch: Batch) -> torch.Tensor:
    """(B, C) logits of ``model`` on ``batch``: the one row per input that callers with labels
    per input read (evaluation, fine-tuning); passes over per-token outputs use :func:`predictions`.

    Raises:
        ValueError: logits of another rank, e.g. a language model's (B, T, V), naming the shape.
    """
    out = output_logits(call(model, batch))
    if out.dim() != 2:
        raise ValueError(f"the model returned logits of shape {tuple(out.shape)}; this step reads one row of class "
                         "logits per input, (batch, classes), to compare with one label per input: per-token "
                         "outputs of a language model (batch, tokens, vocabulary) are read by the calibration, "
                         "curvature and KL passes (bayesq.forward.predictions), not here; wrap the model so that "
                         "it returns one row per input (e.g. a classification head, or the last token's logits)")
    return out


def _floating_dtype(model: nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def model_batch(batch: Any, dtype: torch.dtype | None = None, where: str = "batch") -> Batch:
    """One batch as the library passes it to the model: a tensor or a mapping of tensors.

    An ``(inputs, labels, ...)`` tuple or list gives its first element; floating tensors are
    cast to ``dtype`` (the model's); integer ones (token ids, masks) are kept.

    Raises:
        ValueError: a floating tensor holds NaN or Inf (naming ``where`` and the key).
        TypeError: anything but a tensor, a mapping of tensors or such a tuple.
    """
    if isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]

    def one(t: Any, key: str) -> torch.Tensor:
        if not torch.is_tensor(t):
            return t
        if t.is_floating_point():
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{where}{key} holds {int((~torch.isfinite(t)).sum())} NaN/Inf value(s): drop or "
                                 "clean those inputs before calibrating")
            if dtype is not None and t.dtype != dtype:
                t = t.to(dtype)
        return t

    if isinstance(batch, Mapping):
        return {k: one(v, f"['{k}']") for k, v in batch.items()}
    if torch.is_tensor(batch):
        return one(batch, "")
    raise TypeError(f"{where} is a {type(batch).__name__}: pass tensors, dicts of tensors (keyword arguments) or "
                    "(inputs, labels) tuples")


def model_batches(model: nn.Module, batches: Iterable[Any] | None, what: str = "calibration") -> list[Batch] | None:
    """Every batch of ``batches`` through :func:`model_batch` with the model's floating dtype
    (None stays None)."""
    if batches is None:
        return None
    dtype = _floating_dtype(model)
    return [model_batch(b, dtype, f"{what} batch {i}") for i, b in enumerate(batches)]


@contextmanager
def kept_state(model: nn.Module) -> Iterator[None]:
    """Give ``model`` back as it came: every module's train/eval mode, every parameter's
    ``requires_grad`` and ``.grad`` (the library's passes switch to eval mode and back-propagate)."""
    modes = {m: m.training for m in model.modules()}
    params = [(p, p.requires_grad, None if p.grad is None else p.grad.clone()) for p in model.parameters()]
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training
        for p, requires_grad, grad in params:
            p.requires_grad_(requires_grad)
            p.grad = grad


def batch_size(batch: Batch) -> int:
    """Number of examples in a batch."""
    if isinstance(batch, Mapping):
        return int(next(iter(batch.values())).shape[0])
    return int(batch.shape[0])


def by_length(batches: Iterable[Batch]) -> list[Batch]:
    """The same examples regrouped by length, each batch cut to its longest member.

    For sums over examples (curvature, layer-input statistics): tokenised batches padded to
    their longest member (a mapping with a (B, L) ``attention_mask`` of right padding) are
    concatenated, sorted by the number of real tokens (stable) and split again into batches
    of the first batch's size, every (B, L) tensor cut to the new batch's longest example.
    Each example's outputs are unchanged (padding is masked); a random draw of sentences in
    batches of 32 is about half padding, so the passes run on about half the tokens. Tensor
    batches (images) and batches without right padding come back as they are.
    """
    batches = list(batches)
    sorted_ = _length_sorted(batches)
    if sorted_ is None:
        return batches
    every, order, keys = sorted_
    size = batch_size(batches[0])
    out = []
    for i in range(0, len(order), size):
        idx = order[i:i + size]
        longest = int(every["attention_mask"][idx].sum(1).max())
        out.append({k: v[idx][:, :longest] if k in keys else v[idx] for k, v in every.items()})
    return out


def _length_sorted(batches: list[Batch]) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[str]] | None:
    """:func:`by_length`'s regrouping: (every input joined and padded to the widest batch, the
    (N,) int64 stable order by real tokens, the (B, L) keys cut per batch), or None where the
    batches come back as they are (no right-padded ``attention_mask``)."""
    if not batches or not all(isinstance(b, Mapping) and "attention_mask" in b for b in batches):
        return None
    masks = [b["attention_mask"] for b in batches]
    if any(m.dim() != 2 or bool((m[:, 1:] > m[:, :-1]).any()) for m in masks):
        return None  # not right padding (or not (B, L)): cutting would drop real tokens
    width = max(m.shape[1] for m in masks)
    keys = [k for k, v in batches[0].items() if torch.is_tensor(v) and v.dim() == 2 and v.shape == masks[0].shape]

    def padded(b: Mapping, k: str) -> torch.Tensor:
        v = b[k]
        return torch.nn.functional.pad(v, (0, width - v.shape[1])) if k in keys else v

    every = {k: torch.cat([padded(b, k) for b in batches]) for k in batches[0]}
    return every, every["attention_mask"].sum(1).argsort(stable=True), keys


def pass_logits(outputs: list[torch.Tensor | None], batches: Iterable[Batch]) -> list[torch.Tensor] | None:
    """A pass's logits back in the order of ``batches``: one (B, C) tensor per batch, or None.

    ``outputs``: the (B, C) logits of every forward call of a pass over :func:`by_length`
    ``(batches)``, in its order (whole batches or parts of them; None for a call whose logits
    have a token axis), as the curvature pass and the layer-input statistics collect them
    (``logits=``). Their rows are the inputs in :func:`by_length`'s order; they are put back
    in the order of ``batches`` and split into its batches. None unless every call gave (B, C)
    logits and their rows are exactly the inputs of ``batches`` (a pass that skipped batches,
    or a curvature that called the model more or less than once per input).
    """
    batches = list(batches)
    n = sum(batch_size(b) for b in batches)
    if not outputs or any(z is None for z in outputs) or sum(len(z) for z in outputs) != n:
        return None
    rows = torch.cat(outputs)
    sorted_ = _length_sorted(batches)
    if sorted_ is not None:  # row i of the pass is input order[i]
        rows = torch.empty_like(rows).index_copy_(0, sorted_[1].to(rows.device), rows)
    return list(rows.split([batch_size(b) for b in batches]))


def collect_logits(outputs: list[torch.Tensor | None] | None, out: Any) -> None:
    """Append the logits of a pass's model output ``out`` (:func:`output_logits`, read only when
    ``outputs`` is given: a pass that is not asked for them reads no output) to ``outputs``:
    detached (B, C) logits, or None for per-token ones (not kept: (B, T, V) is large, and
    :func:`pass_logits` reads rows per input)."""
    if outputs is not None:
        z = output_logits(out)
        outputs.append(z.detach() if z.dim() == 2 else None)


def positions(batch: Batch) -> int:
    """Positions per input of ``batch``: the second dimension of its (first, for a mapping) tensor
    with two or more dimensions (a token batch's sequence length), else 1."""
    xs = batch.values() if isinstance(batch, Mapping) else [batch]
    x = next((v for v in xs if torch.is_tensor(v) and v.dim() >= 2), None)
    return 1 if x is None else int(x.shape[1])


def _inputs(batch: Batch, start: int, stop: int) -> Batch:
    """Inputs ``start:stop`` of ``batch`` (every value sliced along dim 0)."""
    return {key: v[start:stop] for key, v in batch.items()} if isinstance(batch, Mapping) else batch[start:stop]


def first_inputs(batches: Iterable[Batch], n: int) -> list[Batch]:
    """The first ``n`` inputs of ``batches``, as batches (the last one cut)."""
    out, seen = [], 0
    for batch in batches:
        if seen >= n:
            break
        k = min(batch_size(batch), n - seen)
        out.append(_inputs(batch, 0, k))
        seen += k
    return out


def split_batches(batches: Iterable[Batch], size: int | None) -> list[Batch]:
    """Each batch of more than ``size`` inputs split into the fewest near-equal parts of at most
    ``size`` (views, in order: the same inputs); None: the batches as they are."""
    out = []
    for batch in batches:
        n = batch_size(batch)
        parts = 1 if size is None else -(-n // size)
        if parts == 1:
            out.append(batch)
            continue
        start = 0
        for i in range(parts):  # the first n % parts parts one input longer
            stop = start + n // parts + (i < n % parts)
            out.append(_inputs(batch, start, stop))
            start = stop
    return out
