"""Speed of BayesQ's ONNX Runtime files on the architectures users serve, next to FP32 and ONNX
Runtime's own 4-bit RTN, measured side by side in one run: BERT-base at 128 tokens and a
GPT-2-small decoding step (one new token with a cache of ``--past`` tokens), both built from their
Hugging Face configs with random weights (so only speed and size mean anything here; the
fidelity of these files is measured on trained models by the `deploy` stage).

For each architecture: BayesQ quantises for the ``onnxruntime`` target (its default: one width of
2 / 4 / 8 per layer, blocks of 128) at ``--budget`` on ``--calibration`` batches of random tokens,
once with every Linear and, for GPT-2, once more with the head (tied to the 38.6 M-weight token
embedding) kept in floating point, to see what the head costs. Every file is timed at accuracy
level 1 (float32 compute) and 4 (int8 activations). Printed per file: size on disk and the
median latency of ``--repeats`` calls at each batch size, ``intra_op_num_threads`` as given, and
the ratio FP32 latency / file latency (above 1: faster).

    python benchmarks/onnx_architectures.py [--arch bert-base gpt2-decode] [--budget 4.0] [--threads 2]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import onnx
import torch
from torch import nn

from bayesq import BayesQConfig, QuantConfig, quantize_model
from bayesq.baselines.ort import Peer, ort_quantize
from bayesq.onnx_export import OnnxModel, export_onnx, graph_of

N_LAYER = 12


class DecodeStep(nn.Module):
    """One decoding step of a GPT-2 LM: (B, 1) token ids and the (B, 2 L, H, T, D) keys and values
    of T earlier tokens -> (B, 1, V) logits and the cache of T + 1 tokens, stacked the same way."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, past: torch.Tensor):
        from transformers import DynamicCache

        cache = DynamicCache()
        for i in range(past.shape[1] // 2):
            cache.update(past[:, 2 * i], past[:, 2 * i + 1], i)
        mask = torch.ones(input_ids.shape[0], past.shape[3] + 1, dtype=torch.long)
        out = self.lm(input_ids=input_ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        kv = out.past_key_values
        layers = [(kv.layers[i].keys, kv.layers[i].values) for i in range(len(kv.layers))]
        return out.logits, torch.stack([t for pair in layers for t in pair], 1)


def bert_base() -> tuple[nn.Module, list[dict], dict[int, dict]]:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_labels=2)).eval()
    g = torch.Generator().manual_seed(1)

    def batch(b, t):
        return {"input_ids": torch.randint(0, 30522, (b, t), generator=g), "attention_mask": torch.ones(b, t, dtype=torch.long)}

    return model, [batch(8, 64) for _ in range(4)], {b: batch(b, 128) for b in (1, 2, 8)}


def gpt2_lm() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=N_LAYER)).eval()


def decode_inputs(b: int, past: int) -> dict:
    g = torch.Generator().manual_seed(2)
    return {"input_ids": torch.randint(0, 50257, (b, 1), generator=g),
            "past": 0.1 * torch.randn(b, 2 * N_LAYER, 12, past, 64, generator=g)}


def files_for(name: str, model: nn.Module, calibration: list, example: dict, budget: float, out: Path,
              wrap=None, exclude: tuple[str, ...] = (), dynamic=None) -> dict[str, Path]:
    """The FP32 graph, ONNX Runtime's RTN 4-bit (block 128), and BayesQ at ``budget`` (with and
    without ``exclude``), each BayesQ file also at accuracy level 4. ``example``: a batch of 2 or
    more (the exporter fixes an axis of size 1); ``dynamic``: the exporter's dynamic axes."""
    wrap = wrap or (lambda m: m)
    fp = out / f"{name}-fp32.onnx"
    onnx.save(graph_of(wrap(model), example, dynamic_shapes=dynamic), str(fp))
    files = {"fp32": fp, "ort-rtn-4b-b128": ort_quantize(fp, Peer("rtn", 4, 128), out / f"{name}-ort-rtn.onnx")}
    quant = QuantConfig().for_target("onnxruntime")
    variants = {"": ()} | ({f" ({', '.join(exclude)} in float)": exclude} if exclude else {})
    for tag, ex in variants.items():
        res = quantize_model(model, calibration, BayesQConfig(budget=budget, quant=quant), exclude=ex)
        prefix = "lm." if wrap(model) is not model else ""
        for level in (1, 4):
            key = f"bayesq {res.average_bits:.2f} b{tag}, level {level}"
            path = out / f"{name}-bayesq{'-'.join(ex)}-l{level}.onnx"
            export_onnx(wrap(res.model), {prefix + k: v for k, v in res.weights.items()}, example, path,
                        accuracy_level=level, dynamic_shapes=dynamic)
            files[key] = path
    return files


def timed(name: str, files: dict[str, Path], inputs: dict[int, dict], threads: int, repeats: int) -> None:
    print(f"\n{name}: median of {repeats} calls, intra_op_num_threads={threads}; ratio FP32 latency / file latency")
    print("| file | MB | " + " | ".join(f"batch {b}: ms (× FP32)" for b in inputs) + " |")
    print("|---|---|" + "---|" * len(inputs))
    base = {}
    for key, path in files.items():
        m = OnnxModel(path, threads=threads)
        ms = {b: m.latency_ms(x, repeats) for b, x in inputs.items()}
        base = base or ms
        cells = " | ".join(f"{ms[b]:.2f} ({base[b] / ms[b]:.2f}×)" for b in inputs)
        print(f"| {key} | {path.stat().st_size / 1e6:.1f} | {cells} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", nargs="+", default=["gpt2-decode", "bert-base"], choices=["gpt2-decode", "bert-base"])
    p.add_argument("--budget", type=float, default=4.0)
    p.add_argument("--past", type=int, default=128, help="GPT-2: cached tokens before the new one")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="ort-arch-")))
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if "gpt2-decode" in a.arch:
        lm = gpt2_lm()
        g = torch.Generator().manual_seed(1)
        cal = [{"input_ids": torch.randint(0, 50257, (4, 64), generator=g),
                "attention_mask": torch.ones(4, 64, dtype=torch.long)} for _ in range(4)]
        inputs = {b: decode_inputs(b, a.past) for b in (1, 8)}
        files = files_for("gpt2", lm, cal, decode_inputs(2, a.past), a.budget, a.out, wrap=DecodeStep,
                          exclude=("lm_head",), dynamic={"input_ids": {0: "batch"}, "past": {0: "batch"}})
        timed(f"GPT-2 small decoding step (1 token, {a.past} cached)", files, inputs, a.threads, a.repeats)
    if "bert-base" in a.arch:
        model, cal, inputs = bert_base()
        files = files_for("bert", model, cal, inputs.pop(2), a.budget, a.out)
        timed("BERT-base, 128 tokens", files, inputs, a.threads, a.repeats)


if __name__ == "__main__":
    main()
