"""Speed and size of a BayesQ ONNX file in ONNX Runtime, next to the FP32 graph and ONNX Runtime's
own weight-only quantisers on the same graph, measured side by side in one run. (Not named
onnxruntime.py: run as a script, that name would shadow the onnxruntime package.)

For a Hugging Face folder (`save_pretrained`) and a BayesQ `.onnx` written from it
(`bayesq quantize --model <folder> ... --target onnxruntime --out m.onnx`): the FP32 graph is
the model's own ONNX export (:func:`bayesq.onnx_export.graph_of`), the peers are ONNX Runtime's
RTN (4 bits, block 64 and 128) and HQQ (4 bits, block 64) on that FP32 graph
(:mod:`bayesq.baselines.ort`, accuracy level 1), and each BayesQ file is also run at the other of
accuracy levels 1 (float32) and 4 (int8 activations, the default it is written at). Printed per file: size on disk, and the
median latency of `--repeats` calls at each batch size and each length of `--tokens` (random token
ids, no padding), `intra_op_num_threads` as given; ratios are against FP32 in the same run. Also the
largest logit difference to the FP32 graph on those inputs (not a fidelity measure: the
report of `bayesq quantize` has the paired KL on real test examples).

    python benchmarks/onnx_speed.py --model ./minilm-sst --onnx m.onnx [more.onnx ...] [--tokens 8 20 128]
        [--batches 1 8] [--threads 2] [--repeats 30] [--rounds 3] [--no-peers] [--out /tmp/ort-bench]

Latencies: :func:`bayesq.onnx_export.latencies`, every file timed in ``--rounds`` rounds with one
live ONNX Runtime session at a time (an idle session's spinning threads slow the one timed).

``--layers``: instead, one MatMulNBits node against one FP32 MatMul for MiniLM's and BERT-base's
layer shapes, at each width and accuracy level (random codes, block 128), 1 and 128 rows: which
kernels are fast.

    python benchmarks/onnx_speed.py --layers [--threads 2]

``--convolutions FP32.onnx``: instead, what weight-only convolutions cost in ONNX Runtime: every
``Conv`` of an FP32 graph (e.g. the deploy stage's ``results-deploy/lite0-fmnist/fp32.onnx``) fed
by a standard ``DequantizeLinear`` of 8- or 4-bit codes (opset 21, min/max round-to-nearest, one
scale and zero-point per output channel, zero on the grid), timed as written (a default session)
and as a session with ``session.disable_quant_qdq`` runs it (the dequantisation folded into a float
weight at load: the graph that session optimises to, saved and timed), next to FP32 and FP32 saved
the same way (a control for the saving), on random inputs of the graph's shape. Printed: size on disk,
latency and ratio, largest logit difference to FP32 (random inputs: not a fidelity measure).

    python benchmarks/onnx_speed.py --convolutions results-deploy/lite0-fmnist/fp32.onnx [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from bayesq.baselines.ort import Peer, ort_quantize
from bayesq.harness.sources import resolve_model
from bayesq.onnx_export import OnnxModel, at_accuracy_level, graph_of, latencies


def latency_ms(s: ort.InferenceSession, feed: dict, repeats: int) -> float:
    """Median of ``repeats`` runs in ms after a warm-up (one layer's bare session)."""
    s.run(None, feed)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        s.run(None, feed)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def level_of(path: Path) -> int:
    """The accuracy level of a file's first MatMulNBits node."""
    for node in onnx.load(str(path)).graph.node:
        if node.op_type == "MatMulNBits":
            return next(a.i for a in node.attribute if a.name == "accuracy_level")
    return 0


def with_accuracy_level(src: Path, dst: Path, level: int) -> Path:
    onnx.save(at_accuracy_level(onnx.load(str(src)), level), str(dst))
    return dst


def peers(fp: Path, out: Path) -> dict[str, Path]:
    return {p.name: ort_quantize(fp, p, out / f"{p.name}.onnx", accuracy_level=1)
            for p in (Peer("rtn", 4, 64), Peer("hqq", 4, 64), Peer("rtn", 4, 128))}


def layer_table(threads: int, repeats: int) -> None:
    """FP32 latency / MatMulNBits latency of one layer, per width and accuracy level."""
    from onnx import TensorProto, helper, numpy_helper

    from bayesq.onnx_export import pack_bits

    rng = np.random.default_rng(0)

    def one(nodes, inits, k, n, a):
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], initializer=inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        s = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        return latency_ms(s, {"A": a}, repeats)

    print(f"ONNX Runtime {ort.__version__}, intra_op_num_threads={threads}, block 128, median of {repeats} calls; "
          "FP32 MatMul latency / MatMulNBits latency (above 1: faster); L1: float32 compute, L4: int8 activations")
    print("| K x N, rows | FP32 µs | " + " | ".join(f"{b}b L{lv}" for b in (2, 4, 8) for lv in (1, 4)) + " |")
    print("|---|---|" + "---|" * 6)
    for k, n in ((384, 384), (384, 1536), (1536, 384), (768, 768), (768, 3072)):
        for rows in (1, 128):
            a = rng.standard_normal((rows, k)).astype(np.float32)
            w = numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "W")
            fp = one([helper.make_node("MatMul", ["A", "W"], ["Y"])], [w], k, n, a)
            cells = []
            for bits in (2, 4, 8):
                kb = k // 128
                codes = pack_bits(rng.integers(0, 2**bits, (n, kb, 128)).astype(np.uint8), bits)
                zeros = rng.integers(0, 2**bits, (n, kb + (-kb) % (8 // bits))).astype(np.uint8)
                inits = [numpy_helper.from_array(codes, "B"), numpy_helper.from_array(
                    rng.uniform(0.01, 0.1, n * kb).astype(np.float32), "S"),
                    numpy_helper.from_array(pack_bits(zeros, bits).reshape(-1), "Z")]
                for level in (1, 4):
                    node = helper.make_node("MatMulNBits", ["A", "B", "S", "Z"], ["Y"], domain="com.microsoft", K=k,
                                            N=n, bits=bits, block_size=128, accuracy_level=level)
                    cells.append(f"{fp / one([node], inits, k, n, a):.2f}x")
            print(f"| {k} x {n}, {rows} | {1e3 * fp:.0f} | " + " | ".join(cells) + " |", flush=True)


def dequantized_convolutions(fp: Path, bits: int, dst: Path) -> Path:
    """``fp`` with every Conv weight initializer as ``DequantizeLinear`` of ``bits``-bit codes
    (uint8 / uint4, per output channel, min/max grid through zero), opset 21."""
    from onnx import TensorProto, helper, numpy_helper

    m = onnx.load(str(fp))
    for o in m.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = max(o.version, 21)  # blocked / 4-bit DequantizeLinear
    g = m.graph
    inits = {i.name: i for i in g.initializer}
    dtype, top = (TensorProto.UINT4 if bits == 4 else TensorProto.UINT8), 2**bits - 1
    nodes, gone = [], set()
    for node in g.node:
        if node.op_type == "Conv" and node.input[1] in inits:
            name = node.input[1]
            w = numpy_helper.to_array(inits[name])
            flat = w.reshape(w.shape[0], -1).astype(np.float64)
            lo, hi = np.minimum(flat.min(1), 0), np.maximum(flat.max(1), 0)
            scale = np.maximum(hi - lo, 1e-12) / top
            zero = np.clip(np.round(-lo / scale), 0, top)
            codes = np.clip(np.round(flat / scale[:, None]) + zero[:, None], 0, top).astype(np.uint8)
            g.initializer.extend([helper.make_tensor(f"{name}_codes", dtype, w.shape, codes.reshape(-1).tolist()),
                                  numpy_helper.from_array(scale.astype(np.float32), f"{name}_scale"),
                                  helper.make_tensor(f"{name}_zero", dtype, zero.shape, zero.astype(np.uint8).tolist())])
            nodes.append(helper.make_node("DequantizeLinear", [f"{name}_codes", f"{name}_scale", f"{name}_zero"],
                                          [f"{name}_dq"], name=f"{name}_DequantizeLinear", axis=0))
            node.input[1] = f"{name}_dq"
            gone.add(name)
        nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    kept = [i for i in g.initializer if i.name not in gone]
    del g.initializer[:]
    g.initializer.extend(kept)
    onnx.save(m, str(dst))
    return dst


def folded_at_load(src: Path, dst: Path) -> Path:
    """``src`` as ONNX Runtime's basic graph optimisations leave it with QDQ handling off
    (``session.disable_quant_qdq``): each constant ``DequantizeLinear`` folded into a float
    weight, what such a session runs."""
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.disable_quant_qdq", "1")
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opts.optimized_model_filepath = str(dst)
    ort.InferenceSession(str(src), opts, providers=["CPUExecutionProvider"])
    return dst


def conv_table(fp: Path, out: Path, batches: list[int], threads: int, repeats: int, rounds: int) -> None:
    """FP32 Conv against DequantizeLinear -> Conv at 8 and 4 bits, as written (a default session)
    and with the dequantisation folded at load."""
    files = {"fp32": fp, "fp32 saved the same way": folded_at_load(fp, out / "fp32-saved.onnx")}  # the control
    for b in (8, 4):
        files[f"dq-{b}bit"] = dequantized_convolutions(fp, b, out / f"dq{b}.onnx")
        files[f"dq-{b}bit folded at load"] = folded_at_load(files[f"dq-{b}bit"], out / f"dq{b}-folded.onnx")
    first = ort.InferenceSession(str(fp), providers=["CPUExecutionProvider"]).get_inputs()[0]
    rng = np.random.default_rng(0)
    feeds = {b: torch.from_numpy(rng.standard_normal((b, *first.shape[1:])).astype(np.float32)) for b in batches}
    ms = latencies(files, feeds, threads, repeats, rounds)
    ref = {b: OnnxModel(fp, threads=threads)(x).numpy() for b, x in feeds.items()}
    n = sum(node.op_type == "Conv" for node in onnx.load(str(fp)).graph.node)
    print(f"ONNX Runtime {ort.__version__}, intra_op_num_threads={threads}, {n} Conv nodes, input {first.shape}, "
          f"median over {rounds} rounds (one live session at a time) of the median of {repeats} calls; ratios: FP32 "
          "latency / file latency (above 1: faster); MB: the file as written (folded: the file written, not the "
          "float weights the session holds)")
    print("| file | MB | " + " | ".join(f"batch {b}: ms (x FP32)" for b in batches) + " | largest logit diff to FP32 |")
    print("|---|---|" + "---|" * len(batches) + "---|")
    for k, f in files.items():
        m = OnnxModel(f, threads=threads)
        diff = max(float(np.abs(m(x).numpy() - ref[b]).max()) for b, x in feeds.items())
        size = files[k.removesuffix(" folded at load")].stat().st_size / 1e6
        print(f"| {k} | {size:.1f} | " + " | ".join(f"{ms[k][b]:.2f} ({ms['fp32'][b] / ms[k][b]:.2f}x)" for b in batches)
              + f" | {diff:.3g} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", action="store_true", help="the per-width layer table instead (no model needed)")
    p.add_argument("--convolutions", type=Path, help="an FP32 .onnx: its Conv layers as DequantizeLinear -> Conv")
    p.add_argument("--model", help="the Hugging Face folder the BayesQ file was made from")
    p.add_argument("--onnx", type=Path, nargs="+", help="BayesQ .onnx files (each also run at accuracy level 4)")
    p.add_argument("--tokens", type=int, nargs="+", default=[128])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3, help="rounds over the files")
    p.add_argument("--no-peers", action="store_true", help="only FP32 and the given files (model mode)")
    p.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="ort-bench-")))
    a = p.parse_args()
    if a.layers:
        return layer_table(a.threads, max(a.repeats, 50))
    if a.convolutions:
        a.out.mkdir(parents=True, exist_ok=True)
        return conv_table(a.convolutions, a.out, a.batches, a.threads, a.repeats, a.rounds)
    if not a.model or not a.onnx:
        p.error("--model and --onnx are needed (or --layers)")
    a.out.mkdir(parents=True, exist_ok=True)
    src = resolve_model(a.model)
    model = src.build()
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    example = {"input_ids": torch.randint(0, vocab, (2, max(a.tokens)), generator=g),
               "attention_mask": torch.ones(2, max(a.tokens), dtype=torch.long)}
    fp = a.out / "fp32.onnx"
    onnx.save(graph_of(model, example), str(fp))
    files = {"fp32": fp}
    for f in a.onnx:  # each file as written, and (unless --no-peers) at the other of levels 1 and 4
        other = 1 if level_of(f) == 4 else 4
        files[f.stem] = f
        if not a.no_peers:
            files[f"{f.stem}-level{other}"] = with_accuracy_level(f, a.out / f"{f.stem}-level{other}.onnx", other)
    if not a.no_peers:
        files |= peers(fp, a.out)
    print(f"ONNX Runtime {ort.__version__}, intra_op_num_threads={a.threads}, median over {a.rounds} rounds (one "
          f"live session at a time) of the median of {a.repeats} calls; ratios: FP32 latency / file latency "
          "(above 1: faster)")
    inputs = {(t, b): {"input_ids": torch.randint(0, vocab, (b, t), generator=g),
                       "attention_mask": torch.ones(b, t, dtype=torch.long),
                       "token_type_ids": torch.zeros(b, t, dtype=torch.long)} for t in a.tokens for b in a.batches}
    ms = latencies(files, inputs, a.threads, a.repeats, a.rounds)
    fp32 = OnnxModel(fp, threads=a.threads)
    ref = {k: fp32.session.run(None, fp32.feed(x))[0] for k, x in inputs.items()}
    head = " | ".join(f"{t} tok x {b}: ms (x FP32)" for t, b in inputs)
    print(f"| file | MB | {head} | largest logit diff to FP32 |")
    print("|---|---|" + "---|" * len(inputs) + "---|")
    for k, f in files.items():
        m = OnnxModel(f, threads=a.threads)
        diff = max(float(np.abs(m.session.run(None, m.feed(x))[0] - ref[i]).max()) for i, x in inputs.items())
        cells = " | ".join(f"{ms[k][i]:.2f} ({ms['fp32'][i] / ms[k][i]:.2f}x)" for i in inputs)
        print(f"| {k} | {f.stat().st_size / 1e6:.1f} | {cells} | {diff:.3g} |", flush=True)

if __name__ == "__main__":
    main()
