"""Tiny networks shared by the curvature tests (imported as ``from nets import ...``)."""

import torch
import torch.nn.functional as F
from torch import nn


class SamePadConv(nn.Conv2d):
    """A Conv2d that pads inside forward (TF 'same'), like EfficientNet-Lite's convolutions."""

    def forward(self, x):
        return F.conv2d(F.pad(x, [0, 1, 0, 1]), self.weight, self.bias, self.stride, 0, 1, self.groups)


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
