"""Real architectures (bayesq.harness.architectures: torchvision, Hugging Face and
nn.TransformerEncoder models built from configs with random weights, tiny widths) through every
method at 3.0 bits: each runs, accounts for every weight, and its export loads back to the same
logits."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from bayesq.baselines.adaround import AdaRoundConfig
from bayesq.baselines.anneal import AnnealConfig
from bayesq.baselines.awq import AWQConfig
from bayesq.baselines.bitsplit import BitSplitConfig
from bayesq.baselines.blockwise import BlockwiseConfig
from bayesq.baselines.brecq import BayesQBRECQConfig, BRECQConfig
from bayesq.baselines.dorefa import DoReFaConfig
from bayesq.baselines.gptq import GPTQConfig
from bayesq.baselines.lsq import LSQConfig
from bayesq.baselines.ocs import OCSConfig
from bayesq.baselines.rtn import RTNConfig
from bayesq.baselines.select import encoding_config
from bayesq.baselines.smoothquant import SmoothQuantConfig
from bayesq.baselines.zeroq import ZeroQConfig
from bayesq.config import BayesQConfig, Curvature, DistillConfig, Granularity, PosteriorConfig, QuantConfig
from bayesq.export import load, save_export
from bayesq.forward import call, output_logits
from bayesq.harness.architectures import FAMILIES, build, example_batches
from bayesq.methods import Inputs, quantize_with

BUDGET = 3.0
# resnet18 is built at its real width (torchvision fixes it): its last two stages (10.5 M of its
# 11.2 M weights) are excluded to keep the test fast, which also checks that they are listed.
EXCLUDE = {"resnet18": ("layer3", "layer4")}
SHORT = DistillConfig(steps=8)  # the default distillation (it applies at 3.0 bits), few steps: the same code path
METHODS = {
    "bayesq": BayesQConfig(distill=SHORT),
    "bayesq-ef": BayesQConfig(posterior=replace(PosteriorConfig(), curvature=Curvature.KFAC), distill=SHORT),
    "gptq": GPTQConfig(),
    "awq": AWQConfig(),
    "rtn": RTNConfig(Granularity.GROUP),
    "adaround": AdaRoundConfig(iters=40, progress=False),  # few steps: the same code path
    "brecq": BRECQConfig(iters=5, select=False, progress=False),  # every unit reconstructed, a few steps each
    # (its variant selection is GPTQ's, run by the gptq and adaround rows and tests/test_methods.py)
    "bayesq-brecq": BayesQBRECQConfig(brecq=BRECQConfig(iters=5, progress=False)),  # BayesQ's default, then BRECQ
    "lsq-plus": LSQConfig(offset=True, iters=40, progress=False),  # LSQ+ (LSQ's code path and the offsets)
    "pact": LSQConfig(gradient="pact", select=False, iters=40, progress=False),  # LSQ's code path, PACT's gradient
    "dorefa": DoReFaConfig(select=False, iters=40, progress=False),  # selection: GPTQ's, run by the gptq row
    "bit-split": BitSplitConfig(select=False, epochs=3, progress=False),  # selection: GPTQ's, run by the gptq row
    # one distilled input, a few steps, two candidate widths (a forward pass per layer and width): the same code path
    "zeroq": ZeroQConfig(QuantConfig(bits=(2, 8)), inputs=1, iters=3, progress=False),
    "clip-block": BlockwiseConfig("uniform"),
    "lloyd-block": BlockwiseConfig("lloyd"),  # LUT tables in the export
    "smoothquant": SmoothQuantConfig(),
    "ocs": OCSConfig(select=False),  # selection: GPTQ's, over its variants at each expand ratio (tests/test_ocs.py)
    "anneal": AnnealConfig(steps=6, progress=False),  # few moves: the same code path
}


def accounting(model: nn.Module, res) -> tuple[set[str], set[str], set[str]]:
    """(quantised, listed, tied) parameter names of the quantised model: every floating parameter
    with two or more dimensions, under every name it has, is one of them (or another name of a
    listed one), and none is both quantised and listed."""
    params = dict(model.named_parameters(remove_duplicate=False))
    matrices = {n for n, p in params.items() if p.dim() >= 2 and p.is_floating_point()}
    quantised = {f"{name}.weight" for name in res.weights}
    ids = {id(params[n]) for n in quantised}
    tied = {n for n in matrices - quantised if id(params[n]) in ids}
    listed = set(res.unquantized)
    shared = {n for n in matrices - quantised - tied - listed if any(params[n] is params[m] for m in listed)}
    assert matrices == quantised | listed | tied | shared, sorted(matrices - quantised - listed - tied - shared)[:5]
    assert not (quantised & listed)
    return quantised, listed, tied


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("family", FAMILIES)
def test_architecture_runs_accounts_every_weight_and_round_trips(family, method, tmp_path):
    model, batches = build(family), example_batches(family)
    config, exclude = METHODS[method], EXCLUDE.get(family, ())
    res = quantize_with(model, config, BUDGET, Inputs(calibration=batches, exclude=exclude)).result
    assert res.average_bits <= BUDGET + 1e-9
    _, listed, _ = accounting(res.model, res)
    assert all("matches exclude" in why for name, why in res.unquantized.items() if name.startswith(exclude))
    kept = dict(res.model.named_parameters())
    fp_weights = sum(kept[n].numel() for n in listed)
    fp_bits = sum(kept[n].numel() * 8 * kept[n].element_size() for n in listed)
    n = res.allocation.n_weights
    assert res.average_bits_all == pytest.approx((res.allocation.total_bits + fp_bits) / (n + fp_weights), rel=1e-9)
    quant = encoding_config(res, getattr(config, "quant", None) or BayesQConfig().quant)  # a variant's bit set
    info = save_export(tmp_path / "m.safetensors", res.model, res.weights, quant, res.allocation.total_bits)
    loaded = load(info.path, build(family))
    with torch.no_grad():
        want = output_logits(call(res.model, batches[0]))
        got = output_logits(call(loaded, batches[0]))
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same codes, decoded the same way


def test_build_unknown_family_names_the_known_ones():
    with pytest.raises(KeyError, match="unknown architecture 'resnet50'.*mobilenet_v3_small"):
        build("resnet50")
