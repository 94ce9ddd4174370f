"""One-time cost and peak memory of BayesQ's default against GPTQ's strongest variant, from 5 M to
355 M weights: one process per method and size, the same calibration and selection inputs.

Models are built from configs with random weights (time and memory only): torchvision ResNet-50,
a BERT-base sequence classifier, GPT-2 small and GPT-2 medium (causal LMs, per-token outputs),
and the two embedded architectures (EfficientNet-Lite0 with a 10-class head, the MiniLM
classifier). Inputs: ``--calibration`` (128) sequences of ``--tokens`` (128) tokens or images of
``--pixels`` (224) px, and as many held-out selection inputs (both methods choose among their
candidates on them). BayesQ: ``quantize_with(model, BayesQConfig(), budget, Inputs(...))`` (the
library default); GPTQ: params.yaml's ``gptq`` row config (every variant, the selection KL that
picks one). Each child process builds the model, draws the inputs and times only the
quantisation; its peak RSS (``getrusage``'s ``ru_maxrss`` at its end) includes the model and the
inputs, the same for both methods.

    python benchmarks/scale.py [--sizes resnet50,bert-base,gpt2,gpt2-medium,lite0,minilm] [--budget 3.0]
                               [--methods bayesq,gptq] [--calibration 128] [--selection 0] [--tokens 128] [--pixels 224]
                               [--limit-gib 22] [--timeout 3600] [--device cpu|cuda] [--errors DIR]

Prints a row per size (seconds and peak GiB of each method, the ratios) and says which sizes did
not finish and why (out of memory: killed by the kernel or ``MemoryError``; over ``--timeout``;
an error; ``--errors DIR`` keeps each failed child's stderr). Last line: ``max time ratio: X, max
memory ratio: Y`` over the sizes both methods finish. ``--device cuda``: model and inputs on the GPU
(give ``--limit-gib 0``: CUDA reserves more address space than any cap); the memory ratio then
compares the GPU's peak allocated memory.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import resource
import signal
import subprocess
import sys
import time

ROOT = Path(__file__).resolve().parent.parent
SIZES = ("lite0", "minilm", "resnet50", "bert-base", "gpt2", "gpt2-medium")


def build(size: str):
    """(model, kind) with seeded random weights; kind is 'image', 'text' or 'lm'."""
    import torch

    torch.manual_seed(0)
    if size == "resnet50":
        from torchvision.models import resnet50

        return resnet50(num_classes=1000).eval(), "image"
    if size == "lite0":
        from bayesq.harness.models.zoo import get_entry

        return get_entry("lite0-fmnist").build(pretrained=False), "image"
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    if size == "minilm":
        cfg = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
                         num_labels=2)
        return BertForSequenceClassification(cfg).eval(), "text"
    if size == "bert-base":
        return BertForSequenceClassification(BertConfig(num_labels=2)).eval(), "text"
    if size == "gpt2":
        return GPT2LMHeadModel(GPT2Config()).eval(), "lm"
    if size == "gpt2-medium":
        return GPT2LMHeadModel(GPT2Config(n_embd=1024, n_layer=24, n_head=16)).eval(), "lm"
    raise SystemExit(f"unknown size {size!r}; sizes: {', '.join(SIZES)}")


def inputs(kind: str, n: int, tokens: int, pixels: int, vocab: int, seed: int, batch: int = 8,
           device: str = "cpu") -> list:
    """``n`` inputs in batches of ``batch`` on ``device``: images (B, 3, P, P) or token dicts (B, T)
    (drawn on the CPU: the same inputs on every device)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for start in range(0, n, batch):
        b = min(batch, n - start)
        if kind == "image":
            out.append(torch.randn(b, 3, pixels, pixels, generator=g).to(device))
        else:
            ids = torch.randint(0, vocab, (b, tokens), generator=g).to(device)
            out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return out


def setup(a) -> tuple:
    """(model, calibration batches, selection batches) of size ``a.size`` on ``a.device``, torch threads set."""
    import torch

    torch.set_num_threads(a.threads or torch.get_num_threads())
    model, kind = build(a.size)
    model.to(a.device)
    vocab = getattr(getattr(model, "config", None), "vocab_size", 0)
    cal = inputs(kind, a.calibration, a.tokens, a.pixels, vocab, seed=1, device=a.device)
    sel = inputs(kind, a.selection or a.calibration, a.tokens, a.pixels, vocab, seed=2, device=a.device)
    return model, cal, sel


def child(a) -> None:
    """Quantise one size with one method; print one JSON line."""
    import torch

    from bayesq.config import BayesQConfig
    from bayesq.methods import Inputs, quantize_with
    from flows.configs import method_config
    from flows.params import read_params

    model, cal, sel = setup(a)
    cfg = BayesQConfig() if a.method == "bayesq" else method_config(a.method, read_params(ROOT / "params.yaml"),
                                                                    a.budget, 0)[0]
    cuda = a.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    est = None
    if a.method == "bayesq":  # the library's own estimate of its peak beyond the model and inputs
        from bayesq.blocks import quantizable_layers
        from bayesq.canonical import canonical
        from bayesq.memory import estimate

        with canonical(model):
            est = estimate(model, quantizable_layers(model), cal).total / 2**30
    before = torch.cuda.memory_allocated() / 2**30 if cuda else StagePeaks.rss()
    start = time.perf_counter()
    out = quantize_with(model, cfg, a.budget, Inputs(calibration=cal, selection=sel))
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    weights = sum(p.numel() for p in model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux -> GiB
    where = {str(p.device) for p in out.result.model.parameters()} | {str(b.device) for b in out.result.model.buffers()}
    print(json.dumps({"seconds": seconds, "avg_bits": out.result.average_bits, "weights": weights,
                      "rss_gib": peak, "gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                      "estimate_gib": est, "before_gib": before,
                      "result_devices": sorted(where)}), flush=True)


class StagePeaks:
    """Peak RSS (GiB) and wall seconds of named stages, RSS sampled every 20 ms by a thread."""

    def __init__(self) -> None:
        import threading

        self.current, self.peaks, self.seconds, self.after, self._stop = None, {}, {}, {}, False
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    @staticmethod
    def rss() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30

    @classmethod
    def settled(cls) -> float:
        """RSS (GiB) once garbage is collected and glibc has returned its free pages to the system
        (``malloc_trim``; plain RSS where there is no glibc): what the next stage starts from."""
        import ctypes
        import gc

        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        return cls.rss()

    def _sample(self) -> None:
        while not self._stop:
            if self.current is not None:
                self.peaks[self.current] = max(self.peaks.get(self.current, 0.0), self.rss())
            time.sleep(0.02)

    def stage(self, name: str):
        import contextlib

        @contextlib.contextmanager
        def run():
            self.current, start = name, time.perf_counter()
            self.peaks[name] = self.rss()
            try:
                yield
            finally:
                self.seconds[name] = time.perf_counter() - start
                self.peaks[name] = max(self.peaks[name], self.rss())
                self.current = None
                self.after[name] = self.settled()
        return run()


def stages(a) -> None:
    """``--stages``: BayesQ's default and GPTQ's strongest variant stage by stage in this process
    (as benchmarks/one_time_cost.py), each stage's wall seconds, peak RSS (sampled every 20 ms)
    and RSS after it once freed memory is returned to the system (:meth:`StagePeaks.settled`:
    what stays held, apart from what the allocator keeps). Each method's first pass also gives the
    FP model's logits on the calibration inputs, as in the library. BayesQ's last stage (the output
    offset's fit) runs twice: as the library runs it, reading the kept candidate's logits from
    the selection's scores and the FP logits from the curvature pass, and, for comparison, running
    both models again (not part of BayesQ's cost)."""
    from dataclasses import replace

    from bayesq.baselines.activations import input_stats
    from bayesq.baselines.gptq import gptq_select
    from bayesq.blocks import layer_blocks, quantizable_layers
    from bayesq.canonical import canonical
    from bayesq.config import BayesQConfig
    from bayesq.context import FPOutputs, KnownOutputs
    from bayesq.evaluation import reference_log_probs
    from bayesq.forward import pass_logits
    from bayesq.memory import estimate
    from bayesq.quantize import assemble, posterior_and_stats
    from bayesq.rounding import bias_correction, ef_column_metric
    from bayesq.selection import encode_candidates, select_encoding
    from bayesq.tables import grid_tables
    from flows.params import read_params

    model, cal, sel = setup(a)
    cfg, params = BayesQConfig(), read_params(ROOT / "params.yaml")
    q, peaks = cfg.quant, StagePeaks()
    print(f"{a.size}: model and inputs {StagePeaks.rss():.2f} GiB", flush=True)
    with canonical(model):
        layers = quantizable_layers(model)
        blocks = layer_blocks(layers, q.group_size, q.unit_groups, q.unit.value)
        if "bayesq" in a.methods:
            with peaks.stage("bayesq posterior + input stats"):  # and the FP logits, as quantize_model
                outputs = []
                post, st = posterior_and_stats(model, cal, layers, cfg.posterior, q, progress=False,
                                               max_inputs=estimate(model, layers, cal).pass_inputs, logits=outputs)
                fp = pass_logits(outputs, cal)
                fp = None if fp is None else [z.float() for z in fp]
            with peaks.stage("bayesq metric + bias correction"):
                metric = ef_column_metric(post, q, stats=st)
                correction = bias_correction(model, st, cal)
            del st  # as quantize_model: the sums are not read after the metric and the correction
            with peaks.stage("bayesq tables"):
                tables = grid_tables(post, blocks, q, model=model, calibration=cal, column_metric=metric)
            with peaks.stage("bayesq allocate + encode"):
                cands = encode_candidates(model, post, next(iter(tables.values())), q, a.budget, cfg.allocation,
                                          calibration=cal, column_metric=metric, correction=correction, selection=sel,
                                          tables=tables, consume_metric=True)
            del post, metric, correction, tables  # as quantize_model: not read by the selection
            with peaks.stage("bayesq select"):  # as quantize_model: one FP pass, read by the offset's fit too
                reference = reference_log_probs(model, sel)
                outputs = FPOutputs(model, sel, cal, held_out=True, known=KnownOutputs(reference, fp))
                enc = select_encoding(model, cands, outputs)
            del cands
            with peaks.stage("bayesq assemble + output offset"):  # reads the scored and the pass's logits
                assemble(model, enc, None, cal, cfg.distill, a.budget, selection=sel, fp=outputs)
            with peaks.stage("  the same, both models run again"):  # what it cost before it read them
                assemble(model, replace(enc, scored_logits=None), None, cal, cfg.distill, a.budget, selection=sel,
                         fp=FPOutputs(model, sel, cal, held_out=True, known=KnownOutputs(reference)))
            del enc, reference, fp, outputs
        if "gptq" in a.methods:
            b = params.baselines.config("gptq")
            with peaks.stage("gptq input stats"):  # and the FP logits, as the library's GPTQ
                outputs = []
                st = input_stats(model, cal, layers, abs_mean=False, logits=outputs)
                fp = pass_logits(outputs, cal)
                fp = None if fp is None else [z.float() for z in fp]
            with peaks.stage("gptq solve + select"):
                gptq_select(model, st, cal, a.budget, params.quant, group_sizes=b.group_sizes,
                            act_order=b.act_order, damp=b.damp, bias_correction=b.bias_correction,
                            selection=sel, known=KnownOutputs(logits=fp))
    peaks._stop = True
    for name in peaks.seconds:
        print(f"  {name:36s} {peaks.seconds[name]:7.1f} s  peak {peaks.peaks[name]:6.2f} GiB  "
              f"after {peaks.after[name]:6.2f} GiB", flush=True)


def run_one(size: str, method: str, a) -> dict:
    """Run :func:`child` in a fresh process; its seconds, peak RSS (GiB) and how it ended."""
    cmd = [sys.executable, __file__, "--child", "--size", size, "--method", method, "--budget", str(a.budget),
           "--calibration", str(a.calibration), "--selection", str(a.selection), "--tokens", str(a.tokens), "--pixels", str(a.pixels),
           "--threads", str(a.threads), "--device", a.device]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            preexec_fn=_limit(a.limit_gib))
    start = time.perf_counter()
    try:
        out, err = proc.communicate(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return {"status": f"over the {a.timeout} s timeout"}
    finally:
        wall = time.perf_counter() - start
    if "InsufficientMemoryError" in err:  # BayesQ's own estimate said it cannot fit, before any work
        return {"status": "does not fit: " + err.strip().splitlines()[-1].split(": ", 1)[-1]}
    if proc.returncode == -signal.SIGKILL or "MemoryError" in err or "can't allocate memory" in err:
        return {"status": f"out of memory (limit {a.limit_gib} GiB of address space)"}
    if proc.returncode != 0:
        if a.errors:
            a.errors.mkdir(parents=True, exist_ok=True)
            (a.errors / f"{size}-{method}.txt").write_text(err)
        return {"status": f"error: {err.strip().splitlines()[-1] if err.strip() else proc.returncode}"}
    rec = json.loads(out.strip().splitlines()[-1])
    return {**rec, "wall": wall, "status": "ok"}


def _limit(gib: float):
    """A preexec function capping the child's address space near ``gib`` (a clear MemoryError
    instead of the machine swapping or the kernel killing something else)."""
    def apply() -> None:
        if gib > 0:
            limit = int(gib * 2**30)
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    return apply


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--methods", default="bayesq,gptq")
    ap.add_argument("--budget", type=float, default=3.0)
    ap.add_argument("--calibration", type=int, default=128)
    ap.add_argument("--selection", type=int, default=0, help="held-out selection inputs (0: as many as --calibration)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--pixels", type=int, default=224)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per child (0: all cores)")
    ap.add_argument("--limit-gib", type=float, default=22.0, help="address-space cap per child (0: none)")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--device", default="cpu", help="where the model and the inputs are (cuda: also the GPU's "
                    "peak allocated memory, which the memory ratio then compares)")
    ap.add_argument("--errors", type=Path, help="write each failed child's stderr to this folder")
    ap.add_argument("--stages", action="store_true", help="one size (--sizes NAME) stage by stage in this process")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child or a.stages:
        from flows.settings import apply_defaults

        apply_defaults()
        if a.stages:
            a.size = a.sizes
            stages(a)
        else:
            child(a)
        return
    methods = a.methods.split(",")
    time_ratios, mem_ratios = [], []
    for size in a.sizes.split(","):
        res = {m: run_one(size, m, a) for m in methods}
        cells = []
        for m, r in res.items():
            gpu = f" (GPU {r['gpu_gib']:.2f} GiB, result on {','.join(r['result_devices'])})" if r.get("gpu_gib") else ""
            est = ""
            if r.get("estimate_gib") is not None:
                used = (r.get("gpu_gib") or r["rss_gib"]) - r["before_gib"]
                est = f" [estimate {r['estimate_gib']:.2f} GiB beyond the model and inputs, measured {used:.2f}]"
            cells.append(f"{m} {r['seconds']:.1f} s, {r['rss_gib']:.2f} GiB{gpu}{est}" if r["status"] == "ok"
                         else f"{m} did not finish: {r['status']}")
        line = f"{size:12s} " + "; ".join(cells)
        if all(r["status"] == "ok" for r in res.values()) and {"bayesq", "gptq"} <= set(res):
            mem = "gpu_gib" if res["gptq"].get("gpu_gib") else "rss_gib"
            tr, mr = res["bayesq"]["seconds"] / res["gptq"]["seconds"], res["bayesq"][mem] / res["gptq"][mem]
            time_ratios.append(tr)
            mem_ratios.append(mr)
            line += f"; {res['bayesq']['weights'] / 1e6:.0f} M weights; ratios: time {tr:.2f}, memory {mr:.2f}"
        print(line, flush=True)
    if time_ratios:
        print(f"max time ratio: {max(time_ratios):.2f}, max memory ratio: {max(mem_ratios):.2f}")
    else:
        print("max time ratio: -, max memory ratio: - (no size finished with both methods)")


if __name__ == "__main__":
    main()
