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
    from bayesq.codebook import LevelTables, UniformGrids
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
