"""Tiny networks shared by the curvature tests (imported as ``from nets import ...``)."""

import torch
import torch.nn.functional as F
from torch import nn


class SamePadConv(nn.Conv2d):
    """A Conv2d that pads inside forward (TF 'same'), like EfficientNet-Lite's convolutions."""

    def forward(self, x):
        return F.conv2d(F.pad(x, [0, 1, 0, 1]), self.weight, self.bias, self.stride, 0, 1, self.groups)


class AttentionModel(nn.Module):
    """Embedding, nn.MultiheadAttention (a raw in_proj_weight; out_proj never called as a
    module), two Linear layers; takes (B, T) token ids below 40."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(40, 32)
        self.attn = nn.MultiheadAttention(32, 2, batch_first=True)
        self.fc = nn.Linear(32, 64)
        self.head = nn.Linear(64, 3)

    def forward(self, ids):
        x = self.emb(ids)
        x, _ = self.attn(x, x, x)
        return self.head(torch.relu(self.fc(x.mean(1))))


class TokenModel(nn.Module):
    """Per-token Linear, tanh, masked sum-pool, Linear; takes dict batches (input_ids, mask).

    Per-example gradients sum over tokens.
    """

    def __init__(self, d_in: int = 5, hidden: int = 6, classes: int = 3):
        super().__init__()
        self.a = nn.Linear(d_in, hidden)
        self.b = nn.Linear(hidden, classes)

    def forward(self, input_ids, mask):
        h = torch.tanh(self.a(input_ids))  # (B, T, hidden)
        return self.b((h * mask[..., None]).sum(1))


def random_quantized(shape, group_size, unit_groups=1, bit_choices=(2, 3, 4, 8), row_aligned=False,
                     lut_bits=(), seed=0):
    """A QuantizedWeight with random unit bit-widths, codes, fp16 scales / integer zero-points,
    and per-group sorted fp16 look-up tables for the widths in ``lut_bits``."""
    import torch

    from bayesq.blocks import LayerBlocks
    from bayesq.grids import UniformGrids
    from bayesq.levels import LevelTables
    from bayesq.result import QuantizedWeight

    g = torch.Generator().manual_seed(seed)
    lb = LayerBlocks("w", tuple(shape), group_size, unit_groups, row_aligned)
    choices = torch.tensor(bit_choices)
    unit_bits = choices[torch.randint(0, len(bit_choices), (lb.n_units,), generator=g)]
    group_bits = unit_bits[lb.group_unit()]
    codes = (torch.rand(lb.n_groups, group_size, generator=g, dtype=torch.float64)
             * (2.0 ** group_bits[:, None])).floor().long()
    books = {}
    for b in group_bits.unique().tolist():
        n = int((group_bits == b).sum())
        if b in lut_bits:
            levels = torch.randn(n, 2**b, generator=g, dtype=torch.float64).half().double().sort(1).values
            books[b] = LevelTables(b, levels, torch.arange(n))
        else:
            scale = (torch.rand(n, generator=g, dtype=torch.float64) * 0.1 + 1e-3).half().double()
            zero = torch.randint(0, 2**b, (n,), generator=g).double()
            books[b] = UniformGrids(b, scale, zero)
    return QuantizedWeight(lb, group_bits, codes, books)


class TinyCausalLM(nn.Module):
    """A causal language model of nn.Embedding, nn.Linear and nn.LayerNorm only (untied head):
    ``forward(input_ids, attention_mask=None) -> {"logits": (B, T, V)}``.

    Position t mixes in the mean of the embeddings of the real tokens at positions <= t (a causal
    prefix mean through ``mix``), then a residual MLP, then the head; a right-padded token never
    reaches a real one, so padding leaves the real tokens' logits unchanged.
    """

    def __init__(self, vocab: int = 23, d: int = 16, hidden: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask=None):
        x = self.emb(input_ids)
        m = torch.ones_like(input_ids, dtype=x.dtype) if attention_mask is None else attention_mask.to(x.dtype)
        prefix = torch.cumsum(x * m[..., None], 1) / torch.cumsum(m, 1).clamp_min(1)[..., None]
        h = x + self.mix(prefix)
        h = h + self.fc2(torch.tanh(self.fc1(self.ln(h))))
        return {"logits": self.head(h)}


def lm_batches(lengths, vocab: int = 23, seed: int = 0):
    """Right-padded dict batches (``input_ids``, ``attention_mask``) of random tokens: one batch
    per list of lengths, each padded to its longest member."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for group in lengths:
        width = max(group)
        mask = (torch.arange(width)[None, :] < torch.tensor(group)[:, None]).long()
        ids = torch.randint(1, vocab, (len(group), width), generator=gen) * mask
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def with_padding(batches, extra: int, fill: int = 5):
    """The same batches with ``extra`` more padded positions appended (token ``fill``, mask 0)."""
    return [{"input_ids": torch.nn.functional.pad(b["input_ids"], (0, extra), value=fill),
             "attention_mask": torch.nn.functional.pad(b["attention_mask"], (0, extra))} for b in batches]
