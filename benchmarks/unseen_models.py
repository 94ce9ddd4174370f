"""The library default against RTN per group on architectures the project was not built for.

Each model is built from its library's config with seeded random weights (nothing to download):
torchvision ResNet-18 (batch-norm statistics re-estimated on the calibration images, so that its
logits are not flat) and a small Hugging Face BERT classifier (``initializer_range`` 0.2 instead
of 0.02: with the default its random logits are nearly equal, std 0.03, and every method's KL is
~0). Calibration and test inputs are
seeded random images / token ids, disjoint. Both methods quantise to the same budget; the script prints the mean KL(p_FP || p_Q)
on the test inputs and the paired 95 % bootstrap interval of the difference.

    python benchmarks/unseen_models.py [--budget 3.0]
"""

from __future__ import annotations

import argparse
import time

import torch


def _resnet():
    from torchvision.models import resnet18

    torch.manual_seed(0)
    model = resnet18(num_classes=10)
    g = torch.Generator().manual_seed(1)
    images = torch.randn(320, 3, 32, 32, generator=g)
    calibration, test = list(images[:192].split(32)), list(images[192:].split(32))
    model.train()
    with torch.no_grad():  # batch-norm running statistics of these inputs (no weights change)
        for x in calibration:
            model(x)
    return model.eval(), calibration, test


def _bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=512, num_labels=3, initializer_range=0.2)
    model = BertForSequenceClassification(cfg).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (320, 24), generator=g)
    batches = [{"input_ids": x, "attention_mask": torch.ones_like(x)} for x in ids.split(32)]
    return model, batches[:6], batches[6:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=3.0)
    budget = p.parse_args().budget

    from bayesq import BayesQConfig, quantize_model
    from bayesq.baselines.rtn import rtn_quantize
    from bayesq.comparison import kl_per_example, paired_difference
    from bayesq.config import Granularity
    from bayesq.evaluation import predict

    for name, build in (("resnet18", _resnet), ("bert-2x128", _bert)):
        model, calibration, test = build()
        fp = predict(model, test)
        start = time.perf_counter()
        bq = quantize_model(model, calibration, BayesQConfig(budget=budget), progress=False)
        seconds = time.perf_counter() - start
        rtn = rtn_quantize(model, Granularity.GROUP, budget)
        kl = {k: kl_per_example(fp, predict(r.model, test)) for k, r in (("bayesq", bq), ("rtn-group", rtn))}
        d = paired_difference(kl["bayesq"], kl["rtn-group"])
        print(f"{name}: BayesQ {bq.average_bits:.3f} bits KL {kl['bayesq'].mean():.5f} ({seconds:.0f} s), "
              f"RTN per group {rtn.average_bits:.3f} bits KL {kl['rtn-group'].mean():.5f}; "
              f"difference {d.diff:+.5f} [{d.ci_low:+.5f}, {d.ci_high:+.5f}]", flush=True)


if __name__ == "__main__":
    main()
