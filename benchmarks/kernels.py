"""Speed of the dequantising kernels (GEMV / GEMM) and of the quantised embedded models vs FP16.

    python benchmarks/kernels.py [--quick] [--out FILE.json] [--report FILE.md] [--exports results/exports] \
        [--models lite0-fmnist minilm-sentiment resnet18-fmnist] [--method bayesq] [--budget 3.0] \
        [--seed 17] [--threads N] [--random-weights]

On a CUDA device: (1) the device-to-device copy bandwidth of a 1 GiB tensor (the measured peak)
next to the datasheet figure; (2) for random packed weights (uniform 2/3/4/8 bits, groups of 64)
of shapes 4096x4096, 8192x8192, 768x3072 and 3072x768 at batch 1, 4 and 16: the Triton kernel's
median time, the bytes it must move (code words + per-group goff/gbits/scale/zero + x + y), its
GB/s and % of the measured peak, its speedup over ``F.linear`` with the FP16 weight (same run),
the weight-only limits 16 / (b + (16 + b) / 64) (fp16 scale + b-bit zero per group, the file
format) and 16 / (b + 24 / 64) (fp16 scale + uint8 zero per group, as the kernels read them), and the max
abs error against the float32 reference; (3) median and IQR of the latency (batch 1) and
throughput (batch 64 images / 32 sentences) of each exported model
``<exports>/<model>_<method>_b<budget>_s<seed>.safetensors`` vs its FP16 fine-tuned model; with
``--random-weights`` (a machine without the pipeline's models) each embedded architecture with
seeded random weights instead, quantised here by BayesQ's default at ``--budget`` on 32 synthetic
inputs, exported and loaded back (speed does not depend on the weights' values). ``--report``
writes the tables as Markdown (``reports/kernels.md``).
Goal: >= 80 % of peak bandwidth at batch 1 for 3 and 4 bits.  Without a GPU it says so and runs
a small CPU check (reference backend vs float32 ``F.linear``; the Triton kernels too under
``TRITON_INTERPRET=1``).  ``--quick``: shapes 4096x4096 and 768x3072, bits 3 and 4 only;
``--threads 1`` steadies the CPU timings on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import timeit
from pathlib import Path

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((4096, 4096), (8192, 8192), (16384, 16384), (768, 3072), (3072, 768))
QUICK_SHAPES = ((4096, 4096), (768, 3072))
BITS, QUICK_BITS, BATCHES = (2, 3, 4, 8), (3, 4), (1, 4, 16)
GROUP = 64
UNIFORM_META_BYTES = 2 + 1  # per group read by the kernels at one bit-width: fp16 scale, uint8 zero
COLUMNS = (("us", ".1f"), ("fp16_us", ".1f"), ("gbs", ".0f"), ("pct_peak", ".1f"), ("fp16_gbs", ".0f"),
           ("speedup", ".2f"), ("limit_file", ".2f"), ("limit_mem", ".2f"), ("max_abs_err", ".2e"))
DATASHEET_TBS = (("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100 SXM", 3.35), ("H100 80GB HBM3", 3.35))


def random_packed(n: int, k: int, bits: int, seed: int):
    """PackedWeight (N, K) of random ``bits``-bit codes, groups of 64, fp16 scales, integer zeros."""
    from bayesq.blocks import LayerBlocks
    from bayesq.grids import UniformGrids
    from bayesq.kernels import pack_weight
    from bayesq.result import QuantizedWeight

    gen = torch.Generator().manual_seed(seed * 1009 + bits)
    lb = LayerBlocks("bench", (n, k), GROUP, 1)
    g = lb.n_groups
    codes = torch.randint(0, 2**bits, (g, GROUP), generator=gen, dtype=torch.int64)
    scale = ((0.5 + torch.rand(g, generator=gen, dtype=torch.float64)) * 2 / ((2**bits - 1) * k**0.5)).half().double()
    zero = torch.randint(0, 2**bits, (g,), generator=gen).double()
    qw = QuantizedWeight(lb, torch.full((g,), bits, dtype=torch.int64), codes, {bits: UniformGrids(bits, scale, zero)})
    return pack_weight(qw)


def moved_bytes(pw, m: int) -> int:
    """Bytes a dequantising matmul must move: code words, the per-group data the kernel reads
    (scale, zero; goff / gbits only for mixed widths; LUTs), fp16 x (M, K) and y (M, N)."""
    meta = [pw.scale, pw.zero, pw.lut, pw.lutoff] + ([] if pw.uniform_bits else [pw.goff, pw.gbits])
    return pw.words.numel() * 4 + sum(t.numel() * t.element_size() for t in meta) + 2 * m * (pw.k + pw.n)


def limits(bits: int) -> tuple[float, float]:
    """Weight-only GEMV speedup bounds over FP16: file format (fp16 scale + b-bit zero per 64) and in-memory."""
    return 16 / (bits + (16 + bits) / GROUP), 16 / (bits + 8 * UNIFORM_META_BYTES / GROUP)


def show(title: str, head: list[str], rows: list[list]) -> None:
    """Print a table (rich when importable, else aligned plain text)."""
    cells = [[c if isinstance(c, str) else f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(head)]
        print(f"\n{title}\n" + "  ".join(h.rjust(w) for h, w in zip(head, widths)))
        for r in cells:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        return
    t = Table(title=title)
    for h in head:
        t.add_column(h, justify="right")
    for r in cells:
        t.add_row(*r)
    Console(width=200).print(t)


def bench_ms(fn, rep: int = 100) -> float:
    """Median milliseconds of ``fn()`` on the GPU: triton's do_bench (L2 flushed before each call,
    ``rep`` ms of calls), else CUDA events around 50 calls after 10 warm-up calls, each after an L2 flush."""
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=rep, return_mode="median"))
    except ImportError:
        pass
    flush, times = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda"), []
    for i in range(60):
        flush.zero_()  # also keeps the GPU busy while the launch is queued
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 10:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_bandwidth() -> tuple[float, float | None, str]:
    """(measured GB/s of a 1 GiB device-to-device copy (read + write), datasheet GB/s or None, device name)."""
    x = torch.empty(2**29, dtype=torch.float16, device="cuda")
    y = torch.empty_like(x)
    measured = 2 * x.numel() * 2 / (bench_ms(lambda: y.copy_(x)) * 1e-3) / 1e9
    del x, y
    name = torch.cuda.get_device_name()
    nominal = next((tbs * 1e3 for key, tbs in DATASHEET_TBS if key.lower() in name.lower()), None)
    return measured, nominal, name


def kernel_rows(shapes, bits_list, peak: float, seed: int) -> list[dict]:
    """Triton kernel vs FP16 ``F.linear`` for every shape x bit-width x batch (times in us)."""
    from bayesq.kernels import dequant_linear, reference

    rows = []
    for n, k in shapes:
        for bits in bits_list:
            pw = random_packed(n, k, bits, seed).to("cuda")
            w32 = reference.dequantize(pw)  # (N, K) float32 on the GPU
            w16 = w32.half()
            for m in BATCHES:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + m)).to("cuda", torch.float16)
                err = float((dequant_linear(x, pw, None, "triton").float() - F.linear(x.float(), w32)).abs().max())
                tq = bench_ms(lambda: dequant_linear(x, pw, None, "triton")) * 1e3
                tf = bench_ms(lambda: F.linear(x, w16)) * 1e3
                gbs = moved_bytes(pw, m) / (tq * 1e-6) / 1e9
                fp_gbs = (2 * n * k + 2 * m * (n + k)) / (tf * 1e-6) / 1e9
                lim_file, lim_mem = limits(bits)
                rows.append(dict(n=n, k=k, bits=bits, m=m, us=tq, fp16_us=tf, bytes=moved_bytes(pw, m), gbs=gbs,
                                 pct_peak=100 * gbs / peak, fp16_gbs=fp_gbs, speedup=tf / tq, limit_file=lim_file,
                                 limit_mem=lim_mem, max_abs_err=err))
            del pw, w32, w16
            torch.cuda.empty_cache()
    return rows


def inputs_for(entry, batch: int, seed: int) -> tuple[object, str]:
    """A batch of ``batch`` seeded-random test examples (synthetic inputs if the data cannot be read)."""
    data = None
    try:
        from flows.common import read_params
        from flows.finetune import raw_path

        data = read_params(ROOT / "params.yaml").data
        splits = entry.load_splits(data, raw_path(entry, ROOT / "data" / "raw"))
        idx = torch.randperm(len(splits.test_labels), generator=torch.Generator().manual_seed(seed))[:batch]
        inp = splits.test_inputs
        picked = inp[idx] if isinstance(inp, torch.Tensor) else [inp[i] for i in idx.tolist()]
        out = entry.batches(picked, batch, data)[0]
        return out, "test set" + (f", L={out['input_ids'].shape[1]}" if isinstance(out, dict) else "")
    except Exception as err:  # noqa: BLE001 - any data problem: fall back to synthetic inputs
        why = f"synthetic ({type(err).__name__}: {str(err)[:80]})"
    size = data.image_size if data else 64
    if entry.task == "image":
        return torch.randn(batch, 3, size, size), why
    length = data.text_max_length if data else 64
    ids = torch.randint(1000, 20000, (batch, length))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}, why


def to_half(model):
    """Model on CUDA in float16 (quantised layers keep their packed buffers' types: see qlayers)."""
    return model.cuda().half().eval()


def on_cuda(batch):
    """Token ids as they are, images as float16, on the GPU."""
    return {key: v.cuda() for key, v in batch.items()} if isinstance(batch, dict) else batch.to("cuda", torch.float16)


def timed(model, batch, reps: int = 30, warmup: int = 5, run=None) -> list[float]:
    """Wall-clock seconds of ``reps`` synchronised forward passes (or calls of ``run``) after
    ``warmup`` ones."""
    from bayesq.forward import logits

    out = []
    with torch.inference_mode():
        for i in range(warmup + reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run() if run else logits(model, batch)
            torch.cuda.synchronize()
            if i >= warmup:
                out.append(time.perf_counter() - t0)
    return out


def graphed(model, batch):
    """``model``'s forward on ``batch`` captured once in a CUDA graph; returns its replay. Each
    replay launches every kernel of the pass at once, so the host's per-layer launch cost (10-30
    us a layer, longer than a small layer's GPU time) is paid at capture, not per call."""
    from bayesq.forward import logits

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode(), torch.cuda.stream(side):
        for _ in range(3):  # warm-up on a side stream, as capture needs
            logits(model, batch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        logits(model, batch)
    return graph.replay


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(median, 25 %, 75 %)."""
    q = statistics.quantiles(xs, n=4)
    return q[1], q[0], q[2]


def iqr(q: tuple[float, float, float], spec: str) -> str:
    return f"{q[0]:{spec}} [{q[1]:{spec}}, {q[2]:{spec}}]"


def synthetic_inputs(entry, batch: int, seed: int, data=None):
    """A seeded batch of random images (B, 3, S, S) or token ids (B, L) at params.yaml's sizes."""
    g = torch.Generator().manual_seed(seed)
    if entry.task == "image":
        size = data.image_size if data else 64
        return torch.randn(batch, 3, size, size, generator=g)
    length = data.text_max_length if data else 64
    ids = torch.randint(1000, 20000, (batch, length), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}


def random_export(entry, a, folder: Path):
    """(FP model, loaded export, description) of ``entry``'s architecture with seeded random weights,
    quantised by BayesQ's default at ``a.budget`` on 32 synthetic inputs, exported and loaded back."""
    from bayesq.config import BayesQConfig
    from bayesq.export import load, save_export
    from bayesq.methods import Inputs, quantize_with
    from flows.params import read_params

    data = read_params(ROOT / "params.yaml").data
    torch.manual_seed(a.seed)
    fp = entry.build(pretrained=False).eval()
    cal = [synthetic_inputs(entry, 8, a.seed + i, data) for i in range(4)]
    cfg = BayesQConfig()
    out = quantize_with(fp, cfg, a.budget, Inputs(calibration=cal))
    path = folder / f"{entry.name}_random_b{a.budget}.safetensors"
    res = out.result
    save_export(path, res.model, res.weights, cfg.quant, res.allocation.total_bits, architecture=entry.name)
    return fp, load(path), f"random weights, BayesQ {res.average_bits:.2f} bits, {path.stat().st_size / 1e6:.1f} MB"


def end_to_end(a) -> list[dict]:
    """Latency (batch 1) and throughput (batch 64 images / 32 sentences) of each export vs FP16."""
    import tempfile

    from bayesq.export import load
    from bayesq.forward import logits
    from bayesq.harness.models.zoo import get_entry

    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="bayesq-kernels-"))
    for name in a.models:
        path = a.exports / f"{name}_{a.method}_b{a.budget}_s{a.seed}.safetensors"
        fp_path = ROOT / "models" / name / "model.safetensors"
        if not a.random_weights and (not path.exists() or not fp_path.exists()):
            print(f"{name}: skipped, {path if not path.exists() else fp_path} not found (run the pipeline first, "
                  "or give --random-weights)")
            continue
        try:
            entry = get_entry(name)
            big = 64 if entry.task == "image" else 32
            if a.random_weights:
                fp, quantized, what = random_export(entry, a, tmp)
                path = what
                batch, source = synthetic_inputs(entry, big, a.seed), "synthetic"
            else:
                from flows.finetune import load_model

                fp, quantized = load_model(entry, fp_path), load(path)
                batch, source = inputs_for(entry, big, a.seed)
            models = {"fp16": to_half(fp), "quantized": to_half(quantized)}
            one = batch[:1] if isinstance(batch, torch.Tensor) else {key: v[:1] for key, v in batch.items()}
            batch, one = on_cuda(batch), on_cuda(one)
            with torch.inference_mode():
                out = [logits(m, batch).float() for m in models.values()]
            diff = float((out[0] - out[1]).abs().max())
            row = dict(model=name, export=str(path), inputs=source, max_logit_diff=diff, batch=big)
            for tag, model in models.items():
                lat = [t * 1e3 for t in timed(model, one)]
                thr = [big / t for t in timed(model, batch)]
                row[tag] = dict(latency_ms=quartiles(lat), throughput=quartiles(thr))
                try:  # batch 1 again, the pass replayed from a CUDA graph
                    row[tag]["graph_latency_ms"] = quartiles([t * 1e3 for t in timed(model, one,
                                                                                       run=graphed(model, one))])
                except Exception as err:  # noqa: BLE001 - a model that cannot be captured: say why
                    row[tag]["graph_error"] = f"{type(err).__name__}: {str(err)[:120]}"
            rows.append(row)
        except Exception as err:  # noqa: BLE001 - report and go on with the next model
            import traceback

            traceback.print_exc()
            print(f"{name}: failed: {type(err).__name__}: {err}")
            rows.append(dict(model=name, export=str(path), error=f"{type(err).__name__}: {err}"))
        torch.cuda.empty_cache()
    return rows


def sweep_configs(bits: int, m: int) -> list[tuple]:
    """(kernel, BLOCK_N, BLOCK_U, warps, split-K) tried at ``m`` input rows: the library's choice,
    the units GEMVs over tiles around its default and, at batch 1, the row kernel with the
    mantissa decode (``kernel_variants.gemv_mantissa_kernel``: fewer integer operations per code)."""
    from bayesq.kernels.packed import unit_shape

    base = 256 // unit_shape(bits)[0] // max(1, 1 << (m - 1).bit_length())  # units per step at the default
    configs = [("library", 0, 0, 0, 0)]
    if m > 1:
        return configs + [("units", 64, bu, 4, split) for bu in (base, 2 * base) for split in (1, 4)]
    for bu in sorted({max(1, base // 2), base, base * 2}):
        for bn in (64, 128):
            for split in (1, 4):
                configs.append(("units", bn, bu, 4, split))
    configs += [("units", 128, base, 8, split) for split in (1, 4)]
    return configs + [("mantissa", bn, bu, warps, 4) for bn, bu, warps in
                      ((64, base, 4), (128, base, 4), (64, 2 * base, 4), (128, base, 8))]


SWEEP_SHAPES = ((4096, 4096), (16384, 16384), (768, 3072), (3072, 768))


def sweep_rows(peak: float, seed: int, device: str = "cuda", shapes=SWEEP_SHAPES, bench=bench_ms) -> list[dict]:
    """``--sweep``: the units GEMVs (``launcher._units_gemv``: the row kernel at batch 1) over
    tiles and K splits at batch 1 and 4, on the large and the BERT-sized shapes at 3 and 4 bits,
    beside the library's default tile (``dequant_linear``) and the mantissa-decode variant (batch
    1); each checked against the float32 reference. ``device``, ``shapes`` and ``bench``
    (milliseconds of a call) let the CPU check it under ``TRITON_INTERPRET=1``."""
    import kernel_variants  # noqa: E402 - benchmarks/ is on sys.path when this script runs

    from bayesq.kernels import dequant_linear, launcher

    rows = []
    for n, k in shapes:
        for bits in (3, 4):
            pw = random_packed(n, k, bits, seed).to(device)
            for m in (1, 4):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(device, torch.float16)
                ref = x.float() @ launcher.dequantize(pw, torch.float32, "torch").T
                for kernel, bn, bu, warps, split in sweep_configs(bits, m):
                    rec = dict(n=n, k=k, bits=bits, m=m, kernel=kernel, bn=bn, bk=bu, warps=warps, split=split)
                    try:
                        if kernel == "mantissa":
                            run = kernel_variants.mantissa_gemv(x, pw, (bu, bn, warps, split))
                        elif kernel == "units":
                            def run(t=(bu, bn, warps, split)):
                                return launcher._units_gemv(x, pw, None, t)
                        else:
                            def run():
                                return dequant_linear(x, pw, None, "triton")
                        rec["err"] = float((run().float() - ref).abs().max() / ref.abs().max())
                        rec["us"] = bench(run, rep=40) * 1e3
                    except Exception as e:  # noqa: BLE001 - a tile the compiler refuses: say so, go on
                        rows.append({**rec, "error": str(e)[:160]})
                        continue
                    rec["gbs"] = moved_bytes(pw, m) / (rec["us"] * 1e-6) / 1e9
                    rec["pct_peak"] = 100 * rec["gbs"] / peak
                    rows.append(rec)
                for kernel in ("library", "units", "mantissa"):
                    done = [r for r in rows if (r["n"], r["k"], r["bits"], r["m"], r["kernel"]) == (n, k, bits, m, kernel)
                            and "us" in r]
                    if done:
                        b = max(done, key=lambda r: r["gbs"])
                        print(f"sweep {n}x{k} {bits}-bit M={m} {kernel}: best BLOCK_N={b['bn']} BLOCK_U={b['bk']} "
                              f"warps={b['warps']} split-K={b['split']} {b['us']:.1f} us, {b['pct_peak']:.0f} % of peak "
                              f"(rel err {b['err']:.1e})", flush=True)
            del pw
    return rows


def gpu(a) -> dict:
    """The GPU part: peak bandwidth, kernel table, goal lines, end-to-end table."""
    measured, nominal, name = peak_bandwidth()
    print(f"device {name}: measured copy bandwidth {measured:.0f} GB/s; datasheet "
          + (f"{nominal:.0f} GB/s ({100 * measured / nominal:.0f} % of it)" if nominal else "unknown"))
    if a.sweep:  # the sweep alone
        return dict(device=name, peak_gbs=measured, datasheet_gbs=nominal, sweep=sweep_rows(measured, a.seed))
    rows = kernel_rows(QUICK_SHAPES if a.quick else SHAPES, QUICK_BITS if a.quick else BITS, measured, a.seed)
    show("dequantising matmul (Triton) vs FP16 F.linear; % of the measured copy bandwidth",
         ["N x K", "bits", "M", "us", "fp16 us", "GB/s", "% peak", "fp16 GB/s", "speedup", "limit", "limit mem",
          "max|err|"],
         [[f"{r['n']}x{r['k']}", r["bits"], r["m"]] + [f"{r[key]:{spec}}" for key, spec in COLUMNS] for r in rows])
    for bits in (3, 4):
        pct = [r["pct_peak"] for r in rows if r["bits"] == bits and r["m"] == 1]
        if pct:
            print(f"goal {bits}-bit batch 1: {min(pct):.0f}-{max(pct):.0f} % of peak "
                  f"({'met' if min(pct) >= 80 else 'NOT met'}: >= 80 %)")
    sweep = []
    e2e = end_to_end(a)
    if any("error" not in r for r in e2e):
        show("end to end: median [IQR] latency (batch 1) and throughput; quantised vs FP16",
             ["model", "inputs", "fp16 ms", "quant ms", "lat ratio", "graph fp16 | quant | ratio", "batch",
              "fp16 ex/s", "quant ex/s", "thr ratio",
              "max|dlogit|"],
             [[r["model"], r["inputs"][:40], iqr(r["fp16"]["latency_ms"], ".3f"),
               iqr(r["quantized"]["latency_ms"], ".3f"), r["quantized"]["latency_ms"][0] / r["fp16"]["latency_ms"][0],
               graph_cells(r["fp16"], r["quantized"]),
               r["batch"], iqr(r["fp16"]["throughput"], ".0f"), iqr(r["quantized"]["throughput"], ".0f"),
               r["quantized"]["throughput"][0] / r["fp16"]["throughput"][0], f"{r['max_logit_diff']:.2e}"]
              for r in e2e if "error" not in r])
    return dict(device=name, peak_gbs=measured, datasheet_gbs=nominal, kernels=rows, end_to_end=e2e, sweep=sweep,
                versions=dict(torch=torch.__version__, triton=_version("triton"), cuda=torch.version.cuda),
                date=time.strftime("%Y-%m-%d"))


def _version(package: str) -> str:
    try:
        return __import__(package).__version__
    except ImportError:
        return "-"


def sweep_markdown(result: dict, command: str) -> str:
    """``--sweep --report FILE``: the best tile of each kernel per shape and width."""
    done = [r for r in result["sweep"] if "us" in r]
    lines = [f"# GEMV kernel sweep on {result['device']}", "", f"`{command}`; copy bandwidth "
             f"{result['peak_gbs']:.0f} GB/s. Batches 1 and 4, fp16 x, float32 accumulation; each kernel's best tile.", "",
             "| N x K | bits | batch | kernel | BLOCK_N | BLOCK_U | warps | split-K | us | % peak | rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, k, bits, m, kernel in sorted({(r["n"], r["k"], r["bits"], r["m"], r["kernel"]) for r in done}):
        b = max((r for r in done if (r["n"], r["k"], r["bits"], r["m"], r["kernel"]) == (n, k, bits, m, kernel)),
                key=lambda r: r["gbs"])
        tile = "| - | - | - | - |" if kernel == "library" else f"| {b['bn']} | {b['bk']} | {b['warps']} | {b['split']} |"
        lines.append(f"| {n}x{k} | {bits} | {m} | {kernel} {tile} "
                     f"{b['us']:.1f} | {b['pct_peak']:.1f} | {b['err']:.1e} |")
    failed = [r for r in result["sweep"] if "error" in r]
    if failed:
        lines += ["", f"{len(failed)} configurations did not compile or run, e.g. {failed[0]}"]
    return "\n".join(lines) + "\n"


def markdown(result: dict, command: str) -> str:
    """``reports/kernels.md``: the device, the bandwidth, the kernel table, the goal lines, the models."""
    v = result["versions"]
    lines = [f"# Dequantising kernels on {result['device']}", "",
             f"Measured {result['date']} with `{command}` (torch {v['torch']}, Triton {v['triton']}, "
             f"CUDA {v['cuda']}). Times are medians of `triton.testing.do_bench` (L2 flushed).", "",
             f"Device-to-device copy bandwidth (1 GiB, read + write): **{result['peak_gbs']:.0f} GB/s**"
             + (f" ({100 * result['peak_gbs'] / result['datasheet_gbs']:.0f} % of the datasheet's "
                f"{result['datasheet_gbs']:.0f} GB/s)." if result["datasheet_gbs"] else "."), "",
             "## Dequantising matmul (Triton) against FP16 `F.linear`", "",
             "Random packed weights, uniform b bits in groups of 64 (fp16 scale + uint8 zero per group). "
             "GB/s counts the bytes the kernel must move (codes, per-group data, fp16 x and y); % peak is of "
             "the copy bandwidth above. Limit: the weight-only speedup bound over FP16 at batch 1, "
             "16 / (b + (16 + b) / 64) for the file format, 16 / (b + 24 / 64) as the kernels read it.", "",
             "| N x K | bits | batch | us | FP16 us | GB/s | % peak | speedup | limit (file) | limit (mem) | max abs err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["kernels"]:
        lines.append(f"| {r['n']}x{r['k']} | {r['bits']} | {r['m']} | {r['us']:.1f} | {r['fp16_us']:.1f} | "
                     f"{r['gbs']:.0f} | {r['pct_peak']:.1f} | {r['speedup']:.2f} | {r['limit_file']:.2f} | "
                     f"{r['limit_mem']:.2f} | {r['max_abs_err']:.1e} |")
    lines += ["", "Goal: at least 80 % of the copy bandwidth at batch 1 for 3 and 4 bits on the large shapes "
              "(4096x4096, 8192x8192, 16384x16384).", ""]
    for bits in (3, 4):
        pct = [r["pct_peak"] for r in result["kernels"] if r["bits"] == bits and r["m"] == 1 and r["n"] >= 4096]
        if pct:
            lines.append(f"- {bits} bits, batch 1, large shapes: {min(pct):.0f}-{max(pct):.0f} % of the copy bandwidth "
                         f"({'met' if min(pct) >= 80 else 'not met'}).")
    ok = [r for r in result["end_to_end"] if "error" not in r]
    lines += ["", "## Exported models against FP16", "",
              "Median [IQR] over 30 runs after 5 warm-up runs; latency at batch 1, throughput at the batch shown.", "",
              "| model | export | inputs | FP16 ms | quantised ms | latency ratio | FP16 graph ms | quantised graph ms "
              "| graph ratio | batch | FP16 ex/s | quantised ex/s | throughput ratio | max abs logit diff |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ok:
        f, q = r["fp16"], r["quantized"]
        lines.append(f"| {r['model']} | {Path(r['export']).name if r['export'].endswith('.safetensors') else r['export']} "
                     f"| {r['inputs']} | {iqr(f['latency_ms'], '.3f')} | {iqr(q['latency_ms'], '.3f')} | "
                     f"{q['latency_ms'][0] / f['latency_ms'][0]:.2f} | {graph_cells(f, q)} | {r['batch']} | "
                     f"{iqr(f['throughput'], '.0f')} | {iqr(q['throughput'], '.0f')} | "
                     f"{q['throughput'][0] / f['throughput'][0]:.2f} | {r['max_logit_diff']:.2e} |")
    for r in ok:
        for tag in ("fp16", "quantized"):
            if "graph_error" in r[tag]:
                lines.append(f"\n{r['model']} {tag}: no CUDA graph: {r[tag]['graph_error']}")
    for r in result["end_to_end"]:
        if "error" in r:
            lines.append(f"\n{r['model']}: failed: {r['error']}")
    return "\n".join(lines) + "\n"


def graph_cells(f: dict, q: dict) -> str:
    """``FP16 graph ms | quantised graph ms | ratio`` cells (``-`` where a capture failed)."""
    if "graph_latency_ms" not in f or "graph_latency_ms" not in q:
        return "- | - | -"
    fg, qg = f["graph_latency_ms"], q["graph_latency_ms"]
    return f"{iqr(fg, '.3f')} | {iqr(qg, '.3f')} | {qg[0] / fg[0]:.2f}"


def median_us(fn, reps: int = 7) -> float:
    """Median wall-clock microseconds of ``fn()`` on the CPU after one warm-up call."""
    fn()
    return statistics.median(timeit.repeat(fn, number=1, repeat=reps)) * 1e6


def cpu_check(seed: int) -> list[dict]:
    """96x160: reference backend vs float32 F.linear (batch 1); Triton (interpreted) errors if asked."""
    from bayesq.kernels import dequant_linear, dequantize, reference, triton_available

    interp = os.environ.get("TRITON_INTERPRET", "0") == "1" and triton_available()
    rows = []
    for bits in (3, 4):
        pw = random_packed(96, 160, bits, seed)
        w = reference.dequantize(pw)
        x = torch.randn(16, 160, generator=torch.Generator().manual_seed(seed))
        row = dict(n=96, k=160, bits=bits, ref_us=median_us(lambda: dequant_linear(x[:1], pw, None, "torch")),
                   f32_us=median_us(lambda: F.linear(x[:1], w)))
        if interp:
            for m in (1, 16):  # GEMV, GEMM
                y = dequant_linear(x[:m], pw, None, "triton")
                row[f"triton_err_m{m}"] = float((y - F.linear(x[:m], w)).abs().max())
            row["triton_dequant_err"] = float((dequantize(pw, torch.float32, "triton") - w).abs().max())
        rows.append(row)
    head = ["N x K", "bits", "reference us", "f32 F.linear us", "ratio"]
    if interp:
        head += ["triton err M=1", "M=16", "dequant err"]
    show("CPU check: reference backend (decodes every call) vs float32 F.linear, batch 1", head,
         [[f"{r['n']}x{r['k']}", r["bits"], r["ref_us"], r["f32_us"], r["ref_us"] / r["f32_us"]]
          + ([f"{r['triton_err_m1']:.2e}", f"{r['triton_err_m16']:.2e}", f"{r['triton_dequant_err']:.2e}"]
             if interp else []) for r in rows])
    if not interp:
        print("Triton kernels not run (set TRITON_INTERPRET=1 to check them in the interpreter)")
    return rows


def main() -> None:
    from flows.settings import apply_defaults

    apply_defaults()  # the pipeline's environment, before Prefect / Hugging Face are imported
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="shapes 4096x4096 and 768x3072, bits 3 and 4")
    p.add_argument("--out", type=Path, help="write all figures to this JSON file")
    p.add_argument("--exports", type=Path, default=ROOT / "results" / "exports")
    p.add_argument("--models", nargs="+", default=["lite0-fmnist", "minilm-sentiment", "resnet18-fmnist"])
    p.add_argument("--method", default="bayesq")
    p.add_argument("--budget", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--threads", type=int, help="torch CPU threads (CPU timings on a busy machine: 1)")
    p.add_argument("--sweep", action="store_true", help="only time the units GEMVs over tile shapes, warps and K "
                   "splits (batch 1 and 4, large and BERT-sized shapes)")
    p.add_argument("--report", type=Path, help="write the GPU tables as Markdown to this file")
    p.add_argument("--random-weights", action="store_true",
                   help="end to end on each embedded architecture with random weights, quantised here")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if torch.cuda.is_available():
        result = dict(gpu=True, **gpu(a))
    else:
        print("no GPU found (torch.cuda.is_available() is False): kernel timings need a CUDA device; "
              "ran the CPU checks only")
        result = dict(gpu=False, cpu_check=cpu_check(a.seed))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {a.out}")
    if a.report and result["gpu"]:
        import sys

        command = "python benchmarks/kernels.py " + " ".join(sys.argv[1:])
        a.report.parent.mkdir(parents=True, exist_ok=True)
        a.report.write_text(sweep_markdown(result, command) if a.sweep else markdown(result, command))
        print(f"wrote {a.report}")


if __name__ == "__main__":
    main()
