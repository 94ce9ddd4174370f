"""Architectures the method was not built for, made from their libraries' configs with seeded
random weights (nothing is downloaded): torchvision CNNs and a Vision Transformer, Hugging Face
encoders, GPT-2 and T5, and an ``nn.TransformerEncoder`` classifier.

``size="tiny"``: widths and depths cut down so that every method runs in seconds (the test
matrix, ``tests/test_architectures.py``); ``size="real"``: the published configuration (the
accounting of ``benchmarks/architectures.py``). :func:`example_batches` gives matching seeded
inputs: (4, 3, H, W) images, or dicts of ``input_ids`` / ``attention_mask`` with half of each
batch right-padded and every sentence ending in one EOS token (T5's classifier pools there).
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB_TINY = 97
PAD, EOS = 0, 1
IMAGE_FAMILIES = ("resnet18", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny", "vit")
TEXT_FAMILIES = ("bert", "distilbert", "gpt2", "gpt2-lm", "t5", "transformer-encoder")
FAMILIES = IMAGE_FAMILIES + TEXT_FAMILIES


class EncoderClassifier(nn.Module):
    """``nn.TransformerEncoder`` over token embeddings, mean-pooled over real tokens, then a
    linear head: ``forward(input_ids (B, T), attention_mask (B, T)) -> (B, 3)``."""

    def __init__(self, vocab: int = VOCAB_TINY, width: int = 64, layers: int = 2, heads: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(width, heads, 2 * width, batch_first=True), layers)
        self.head = nn.Linear(width, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.enc(self.emb(input_ids), src_key_padding_mask=attention_mask == 0)
        keep = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


def _torchvision(name: str, tiny: bool) -> nn.Module:
    from torchvision import models
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    from torchvision.models.efficientnet import EfficientNet, _efficientnet_conf

    if name == "resnet18":  # torchvision fixes its widths
        return models.resnet18(num_classes=10)
    if name == "mobilenet_v3_small":
        return models.mobilenet_v3_small(num_classes=10, width_mult=0.25 if tiny else 1.0)
    if name == "efficientnet_b0":
        if not tiny:
            return models.efficientnet_b0(num_classes=10)
        setting, last = _efficientnet_conf("efficientnet_b0", width_mult=0.25, depth_mult=0.25)
        return EfficientNet(setting, 0.2, last_channel=last, num_classes=10)
    if name == "convnext_tiny":
        if not tiny:
            return models.convnext_tiny(num_classes=10)
        return ConvNeXt([CNBlockConfig(24, 48, 1), CNBlockConfig(48, 96, 1), CNBlockConfig(96, 192, 1),
                         CNBlockConfig(192, None, 1)], num_classes=10)  # convnext_tiny's stages, a quarter wide
    if tiny:  # vit
        return models.VisionTransformer(32, 8, num_layers=2, num_heads=2, hidden_dim=64, mlp_dim=128, num_classes=10)
    return models.vit_b_16(num_classes=10)


def _huggingface(name: str, tiny: bool) -> nn.Module:
    import transformers as tf

    ids = dict(num_labels=3, pad_token_id=PAD, eos_token_id=EOS)
    small = dict(vocab_size=VOCAB_TINY, **ids) if tiny else ids
    if name == "bert":
        sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128) if tiny else {}
        return tf.BertForSequenceClassification(tf.BertConfig(**sizes, **small))
    if name == "distilbert":
        sizes = dict(dim=64, n_layers=2, n_heads=2, hidden_dim=128) if tiny else {}
        return tf.DistilBertForSequenceClassification(tf.DistilBertConfig(**sizes, **small))
    if name in ("gpt2", "gpt2-lm"):
        sizes = dict(n_layer=2, n_embd=64, n_head=2, n_positions=32) if tiny else {}
        cfg = tf.GPT2Config(bos_token_id=EOS, **sizes, **small)
        return tf.GPT2ForSequenceClassification(cfg) if name == "gpt2" else tf.GPT2LMHeadModel(cfg)
    # t5: t5-small's published sizes, or cut down
    sizes = (dict(d_model=64, d_kv=32, d_ff=128, num_layers=2, num_decoder_layers=1, num_heads=2) if tiny else
             dict(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8))
    return tf.T5ForSequenceClassification(tf.T5Config(decoder_start_token_id=PAD, **sizes, **small))


def build(family: str, size: str = "tiny", seed: int = 0) -> nn.Module:
    """The ``family``'s model in eval mode, weights drawn after ``torch.manual_seed(seed)``.

    Raises:
        KeyError: an unknown family (naming the known ones).
    """
    if family not in FAMILIES:
        raise KeyError(f"unknown architecture {family!r}: choose one of {', '.join(FAMILIES)}")
    if size not in ("tiny", "real"):
        raise ValueError(f"size {size!r}: choose 'tiny' or 'real'")
    tiny = size == "tiny"
    torch.manual_seed(seed)
    if family in IMAGE_FAMILIES:
        model = _torchvision(family, tiny)
    elif family == "transformer-encoder":
        model = EncoderClassifier() if tiny else EncoderClassifier(30522, 512, 6, 8)
    else:
        model = _huggingface(family, tiny)
    return model.eval()


def example_batches(family: str, size: str = "tiny", n_batches: int = 2, seed: int = 0) -> list:
    """``n_batches`` seeded input batches of 4 for ``family`` (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    if family in IMAGE_FAMILIES:
        side = 32 if size == "tiny" else 224
        return [torch.randn(4, 3, side, side, generator=g) for _ in range(n_batches)]
    vocab = VOCAB_TINY if size == "tiny" else 1000  # ids every real vocabulary holds
    out = []
    for _ in range(n_batches):
        mask = torch.ones(4, 12, dtype=torch.long)
        mask[:2, -4:] = 0  # right padding on half the batch
        ids = torch.randint(2, vocab, (4, 12), generator=g)
        ids[torch.arange(4), mask.sum(1) - 1] = EOS
        out.append({"input_ids": ids.masked_fill(mask == 0, PAD), "attention_mask": mask})
    return out
