"""BayesQ's one-time cost against GPTQ's, side by side in one process, per embedded model.

BayesQ (the library default, distillation off): posterior fit and layer-input statistics (one
pass, as ``quantize_model``: the error-feedback metric and the bias correction read them) + loss
table + :func:`bayesq.selection.encode_best` (its other candidates' tables, every allocation and
encoding, the KL on the held-out selection inputs that picks one) + :func:`bayesq.quantize.assemble`
(the quantised model and its output offset). GPTQ as the pipeline's ``gptq`` row runs it:
layer-input statistics + :func:`bayesq.baselines.gptq.gptq_select` (every variant, BayesQ's
allocation among them, the KL on the same selection inputs that picks one, the kept one's output
offset). Each computes the FP model's outputs it reads itself (the pipeline caches them), on the
calibration inputs in its own first pass (as the library does: the curvature pass, the statistics
pass). Same
fine-tuned model, same calibration and selection inputs, same budget, one thread each after the
other.

    python benchmarks/one_time_cost.py [--models lite0-fmnist,minilm-sentiment] [--budget 3.0] [--seed 17]
                                       [--threads 1] [--profile N] [--device cpu|cuda]

Prints each stage's wall seconds, each model's two totals and their ratio, and last
``max ratio: X`` (the larger ratio). ``--profile N`` also prints the N functions with the most
cumulative time inside BayesQ (cProfile). ``--device cuda``: model and batches on the GPU (each
stage timed after a synchronisation). Needs ``models/`` and ``data/raw`` from ``make run``
(``benchmarks/scale.py --device cuda`` measures the same architectures without them).
"""

from __future__ import annotations

import argparse
import cProfile
from contextlib import contextmanager
from pathlib import Path
import pstats
import time


@contextmanager
def _timed(stages: dict, name: str):
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
    sync()
    start = time.perf_counter()
    yield
    sync()
    stages[name] = time.perf_counter() - start


def load_inputs(model_name: str, seed: int, params_path: Path):
    """(params, fine-tuned model, calibration batches, selection batches) of one embedded model and seed."""
    from bayesq.harness.models.zoo import get_entry
    from flows.common import read_params
    from flows.finetune import load_model, raw_path
    from flows.prepare import calibration_batches, selection_batches

    params = read_params(params_path)
    entry = get_entry(model_name)
    model = load_model(entry, Path("models") / model_name / "model.safetensors")
    splits = entry.load_splits(params.data, raw_path(entry, Path("data/raw")))
    _, batches = calibration_batches(entry, splits, params.data, params.calibration, seed)
    return params, model, batches, selection_batches(entry, splits, params.data, params.calibration, seed)


def test_batches(model_name: str, params) -> tuple[list, list]:
    """(batches of 64, labels) of every test example of one embedded model."""
    from bayesq.harness.models.zoo import get_entry
    from flows.finetune import raw_path

    entry = get_entry(model_name)
    splits = entry.load_splits(params.data, raw_path(entry, Path("data/raw")))
    return entry.batches(splits.test_inputs, 64, params.data), splits.test_labels


def on_device(model, calibration, selection, device: str):
    """Model and batches (tensors, dicts of tensors) moved to ``device``."""
    def move(b):
        return {k: v.to(device) for k, v in b.items()} if isinstance(b, dict) else b.to(device)

    return model.to(device), [move(b) for b in calibration], [move(b) for b in selection]


def bayesq_stages(model, calibration, params, budget: float, seed: int, selection=None) -> tuple[dict, object]:
    """Wall seconds of each BayesQ stage; the kept :class:`~bayesq.selection.Encoding`."""
    from bayesq.blocks import layer_blocks, quantizable_layers
    from bayesq.config import BayesQConfig, DistillConfig
    from bayesq.context import FPOutputs, KnownOutputs
    from bayesq.evaluation import log_probs, reference_log_probs
    from bayesq.forward import pass_logits
    from bayesq.memory import estimate
    from bayesq.quantize import assemble, posterior_and_stats
    from bayesq.rounding import bias_correction, ef_column_metric
    from bayesq.selection import encode_best
    from bayesq.tables import grid_tables

    cfg = BayesQConfig(budget=budget, posterior=params.posterior, quant=params.quant,
                       allocation=params.allocation, distill=DistillConfig(max_budget=0), seed=seed)
    q, stages = cfg.quant, {}
    blocks = layer_blocks(quantizable_layers(model), q.group_size, q.unit_groups, q.unit.value)
    with _timed(stages, "posterior + input stats"):  # one pass, as quantize_model: the metric and the bias correction
        layers = quantizable_layers(model)
        outputs = []  # the FP logits of the pass, read by the selection / the offset as quantize_model does
        post, stats = posterior_and_stats(model, calibration, layers, cfg.posterior, q, seed=seed, progress=False,
                                          max_inputs=estimate(model, layers, calibration).pass_inputs, logits=outputs)
        fp = pass_logits(outputs, calibration)
    with _timed(stages, "metric + bias correction"):
        metric = ef_column_metric(post, q, stats=stats)
        correction = bias_correction(model, stats, calibration) if q.bias_correction else None
    with _timed(stages, "table"):  # every grid candidate's, built together as quantize_model does
        tables = grid_tables(post, blocks, q, held_out=selection is not None, seed=seed, model=model,
                             calibration=calibration, column_metric=metric)
    with _timed(stages, "allocate+encode+select"):  # the FP model on the scored inputs, as quantize_model
        reference = ([log_probs(z) for z in fp] if selection is None and fp is not None
                     else reference_log_probs(model, selection if selection is not None else calibration))
        enc = encode_best(model, post, next(iter(tables.values())), q, budget, cfg.allocation, seed=seed,
                          calibration=calibration, column_metric=metric, correction=correction, selection=selection,
                          tables=tables, known=KnownOutputs(reference))
    with _timed(stages, "assemble+offset"):  # as quantize_model: the selection's outputs read, not recomputed
        logits = (None if fp is None else [z.float() for z in fp]) if selection is not None else reference
        scored = selection if selection is not None else calibration
        outputs = FPOutputs(model, scored, calibration, held_out=selection is not None,
                            known=KnownOutputs(reference, logits))
        assemble(model, enc, None, calibration, cfg.distill, budget, seed, selection=selection, fp=outputs)
    return stages, enc


def gptq_stages(model, calibration, params, budget: float, allocation, selection=None) -> tuple[dict, object]:
    """Wall seconds of GPTQ's statistics and its calibration-selected solve; the choice."""
    from bayesq.baselines.activations import input_stats
    from bayesq.baselines.gptq import gptq_select
    from bayesq.blocks import quantizable_layers
    from bayesq.context import KnownOutputs
    from bayesq.forward import pass_logits

    stages, outputs = {}, []
    with _timed(stages, "input stats"):  # GPTQ reads H only; the pass's FP logits go to the offset's fit
        stats = input_stats(model, calibration, quantizable_layers(model), abs_mean=False, logits=outputs)
        fp = pass_logits(outputs, calibration)
    gptq = params.baselines.config("gptq")
    with _timed(stages, "solve+select"):
        choice = gptq_select(model, stats, calibration, budget, params.quant,
                             group_sizes=gptq.group_sizes, allocation=allocation, act_order=gptq.act_order,
                             damp=gptq.damp, bias_correction=gptq.bias_correction, selection=selection,
                             known=KnownOutputs(logits=None if fp is None else [z.float() for z in fp]))
    return stages, choice


def main() -> None:
    from flows.settings import apply_defaults

    apply_defaults()  # the pipeline's environment, before Prefect / Hugging Face are imported
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="lite0-fmnist,minilm-sentiment")
    ap.add_argument("--budget", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--profile", type=int, default=0, help="print the N top cumulative functions of BayesQ")
    ap.add_argument("--device", default="cpu", help="where the model and the batches are (cuda: the GPU)")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    ratios = {}
    for name in a.models.split(","):
        params, model, calibration, selection = load_inputs(name, a.seed, a.params)
        model, calibration, selection = on_device(model, calibration, selection, a.device)
        prof = cProfile.Profile() if a.profile else None
        if prof:
            prof.enable()
        b_stages, enc = bayesq_stages(model, calibration, params, a.budget, a.seed, selection)
        if prof:
            prof.disable()
        allocation = {k: list(v) for k, v in enc.allocation.unit_bits.items()}
        g_stages, choice = gptq_stages(model, calibration, params, a.budget, allocation, selection)
        b, g = sum(b_stages.values()), sum(g_stages.values())
        ratios[name] = b / g
        fmt = lambda s: ", ".join(f"{k} {v:.1f}" for k, v in s.items())  # noqa: E731
        print(f"{name} at {a.budget} bits, seed {a.seed}, {a.threads} thread(s):")
        print(f"  BayesQ {b:.1f} s ({fmt(b_stages)}; kept {enc.name})")
        print(f"  GPTQ   {g:.1f} s ({fmt(g_stages)}; kept {choice.variant})")
        print(f"  ratio  {b / g:.2f}", flush=True)
        if prof:
            pstats.Stats(prof).sort_stats("cumulative").print_stats(a.profile)
    print(f"max ratio: {max(ratios.values()):.2f}")


if __name__ == "__main__":
    main()
