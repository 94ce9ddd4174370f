"""Tiny models and data on disk, as a user would bring them (no downloads): Hugging Face folders
written with ``save_pretrained`` (a BERT classifier, a GPT-2 causal LM, a ViT image classifier, a
base BERT), a torchvision checkpoint, and data sets written with ``datasets`` in every supported
format. Random weights, fixed seeds."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from torch import nn

WORDS = "the movie was good bad great awful fine plot actors boring fun long short film story".split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n)]


def bert_tokenizer(folder: Path):
    """A WordPiece tokenizer over :data:`WORDS` (written to ``folder``)."""
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    return BertTokenizerFast(vocab_file=str(vocab))


def gpt2_tokenizer():
    """A byte-level BPE tokenizer (300 tokens) trained on :func:`sentences`."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2TokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(sentences(200), vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>"])
    return GPT2TokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                             unk_token="<|endoftext|>")


def make_models(root: Path) -> dict[str, Path]:
    """``bert`` (2-class), ``bert-base`` (no head), ``gpt2`` (causal LM), ``vit`` (3-class, 32 px)
    folders and ``mnv3.pth`` / ``mnv3.safetensors`` (torchvision MobileNetV3-Small, 3 classes)."""
    import torchvision
    from safetensors.torch import save_file
    from transformers import (BertConfig, BertForSequenceClassification, BertModel, GPT2Config, GPT2LMHeadModel,
                              ViTConfig, ViTForImageClassification, ViTImageProcessor)

    torch.manual_seed(0)
    out = {}
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=64)
    tok = bert_tokenizer(root / "bert")
    bert = BertConfig(vocab_size=tok.vocab_size, num_labels=2, **small)
    BertForSequenceClassification(bert).eval().save_pretrained(root / "bert")
    tok.save_pretrained(root / "bert")
    out["bert"] = root / "bert"
    BertModel(BertConfig(vocab_size=tok.vocab_size, **small)).eval().save_pretrained(root / "bert-base")
    tok.save_pretrained(root / "bert-base")
    out["bert-base"] = root / "bert-base"
    gtok = gpt2_tokenizer()
    gpt = GPT2Config(vocab_size=len(gtok), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                     bos_token_id=gtok.eos_token_id, eos_token_id=gtok.eos_token_id)
    GPT2LMHeadModel(gpt).eval().save_pretrained(root / "gpt2")
    gtok.save_pretrained(root / "gpt2")
    out["gpt2"] = root / "gpt2"
    vit = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, num_labels=3)
    ViTForImageClassification(vit).eval().save_pretrained(root / "vit")
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(root / "vit")
    out["vit"] = root / "vit"
    mnv3 = torchvision.models.get_model("mobilenet_v3_small", weights=None, num_classes=3).eval()
    torch.save(mnv3.state_dict(), root / "mnv3.pth")
    save_file({k: v.contiguous() for k, v in mnv3.state_dict().items()}, str(root / "mnv3.safetensors"))
    out["mnv3"] = root / "mnv3.pth"
    return out


def make_data(root: Path, n_text: int = 200, per_class: int = 24) -> dict[str, Path]:
    """Sentences with 0/1 labels (and a second sentence column) as Parquet, CSV, JSON Lines and a
    ``save_to_disk`` DatasetDict (splits train / test); a 3-class image folder (40 px PNGs)."""
    import datasets
    from PIL import Image

    datasets.disable_progress_bars()
    root.mkdir(parents=True, exist_ok=True)
    text = sentences(n_text)
    ds = datasets.Dataset.from_dict({"sentence": text, "second": sentences(n_text, 1),
                                     "label": [i % 2 for i in range(n_text)]})
    out = {"parquet": root / "sst.parquet", "csv": root / "sst.csv", "jsonl": root / "sst.jsonl",
           "disk": root / "sst_disk", "images": root / "images"}
    ds.to_parquet(str(out["parquet"]))
    ds.to_csv(str(out["csv"]), index=False)
    ds.to_json(str(out["jsonl"]))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(40))}).save_to_disk(str(out["disk"]))
    for c in range(3):
        folder = out["images"] / f"class{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = np.random.default_rng(100 * c + i).random((40, 40, 3)) * 80 + 60 * c
            Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{i}.png")
    return out


def tiny_text_model() -> nn.Module:
    """For ``package.module:function`` sources: a classifier over token ids (embedding, mean, linear)."""
    return TinyTextClassifier()


class TinyTextClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(WORDS) + 5, 16)
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 2)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        h = self.embed(input_ids)
        m = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        h = (h * m[..., None]).sum(1) / m.sum(1, keepdim=True).clamp_min(1)
        return self.fc2(torch.relu(self.fc1(h)))


def not_a_module():
    return "not a module"
