"""BayesQ's pipeline row against rivals at their strongest, on every test example, paired: one
model, seed and budget of what ``reports/paired.json`` holds, without the pipeline.

For each fine-tuned embedded model (``make run`` first, or at least its fine-tune stage) and the
pipeline's calibration and held-out selection draws (seed ``--seed``), each method of
``--methods`` runs with params.yaml's settings exactly as its pipeline row does
(:func:`flows.configs.method_config`: BayesQ's default row, the baselines with their variant
selection and bias correction; the rows on GPTQ's grids also try the BayesQ row's allocation as a
variant when ``bayesq`` runs before them, as in the pipeline), except that ``--iters`` sets the steps of the learned rivals
(``iters`` of ``baselines.adaround``, ``brecq``, ``lsq``, ``lsq-plus``, ``pact``, ``dorefa``) for rows too slow at their papers'
counts. Each is scored on every test example: ``KL(p_FP || p_Q)`` and correctness. Prints each
method's mean KL, accuracy, seconds and true bits, then ``first - X`` with paired 95 % bootstrap
intervals (:func:`bayesq.comparison.paired_difference`, the pipeline's) for every other X.

Each row (its per-example KL and correctness, bits, seconds, variant and, for ``bayesq``, its
allocation) is saved under ``--rows`` (default ``.cache/rival_test/``) as a safetensors file
keyed by the model, seed, budget, method spec, the method's full config, params.yaml and the
contents of ``bayesq/``, ``flows/``, this script's input loader and the model file, so a later
run with the same inputs and code loads the row instead of recomputing it (``--fresh``
recomputes). Each ``first - X`` interval is printed as soon as X's row is there, so a run
stopped part way keeps the rows and intervals it finished.

A method may carry params.yaml overrides, ``METHOD:section.key=value[,section.key=value]``
(YAML values, as an ablation row's), e.g. ``bayesq:posterior.curvature_share=0.25``: the same
method with those settings, as its own row.

    python benchmarks/rival_test.py [--models lite0-fmnist] [--methods bayesq gptq brecq] [--budget 3.0]
                                    [--iters N] [--seed 17] [--rows DIR] [--fresh]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["lite0-fmnist"])
    ap.add_argument("--methods", nargs="+", default=["bayesq", "gptq", "brecq"])
    ap.add_argument("--budget", type=float, default=3.0)
    ap.add_argument("--iters", type=int, default=None, help="steps of the learned rivals (default: params.yaml's)")
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--rows", type=Path, default=ROOT / ".cache" / "rival_test", help="where rows are saved and reused")
    ap.add_argument("--fresh", action="store_true", help="recompute every row (and overwrite its saved copy)")
    a = ap.parse_args()

    from flows.settings import apply_defaults

    apply_defaults()
    from one_time_cost import load_inputs, test_batches

    from bayesq.comparison import correct_per_example, paired_difference
    from bayesq.evaluation import kl_per_input, predict, reference_log_probs
    from bayesq.methods import Inputs, quantize_with
    from flows.configs import method_config
    from flows.methods import GRID_METHODS, Method
    from flows.params import ablation_params

    for name in a.models:
        params, model, calibration, selection = load_inputs(name, a.seed, ROOT / "params.yaml")
        if a.iters is not None:
            params = replace(params, baselines=params.baselines.changed(
                {f"{m}.iters": a.iters for m in ("adaround", "brecq", "lsq", "lsq-plus", "pact", "dorefa")}))
        test, labels = test_batches(name, params)
        labels = torch.as_tensor(labels)
        reference = None  # the FP model's test log-probabilities, computed when a row needs them
        code = code_fingerprint(ROOT / "models" / name / "model.safetensors")
        kl, correct, kept, first = {}, {}, None, a.methods[0]
        for spec in a.methods:
            method, over = parse_spec(spec)
            cfg = method_config(method, ablation_params(params, over, spec) if over else params, a.budget, a.seed)[0]
            given = kept if Method(method) in GRID_METHODS and getattr(cfg, "select", False) else None
            path = a.rows / f"{name}-{safe_name(spec)}-{row_key(name, spec, cfg, a.budget, a.seed, given, len(labels), code)}.safetensors"
            row = None if a.fresh else load_row(path)
            if row is None:
                if reference is None:
                    reference = reference_log_probs(model, test)
                start = time.perf_counter()
                out = quantize_with(model, cfg, a.budget, Inputs(calibration=calibration, selection=selection,
                                                                 allocation=given))
                seconds = time.perf_counter() - start
                with torch.no_grad():
                    row = Row(kl=kl_per_input(reference, out.result.model, test),
                              correct=correct_per_example(predict(out.result.model, test), labels).double(),
                              bits=out.result.average_bits, seconds=seconds,
                              variant=str(out.details.get("variant") or out.details.get("encoding") or ""),
                              allocation={k: tuple(map(int, v)) for k, v in out.result.allocation.unit_bits.items()})
                save_row(path, row)
            else:
                print(f"{name} {spec}: loaded from {path}", flush=True)
            if spec == "bayesq":
                kept = row.allocation
            kl[spec], correct[spec] = row.kl, row.correct
            print(f"{name} {spec}: KL {row.kl.mean():.5f}, accuracy {100 * row.correct.mean():.2f} % "
                  f"({len(row.kl)} test examples), {row.bits:.3f} bits, {row.seconds:.0f} s {row.variant}", flush=True)
            if spec != first:
                for what, values, scale in (("KL", kl, 1.0), ("accuracy (pts)", correct, 100.0)):
                    d = paired_difference(scale * values[first], scale * values[spec])
                    star = "*" if d.ci_low > 0 or d.ci_high < 0 else ""
                    print(f"{name} {first} - {spec}: {what} {d.diff:+.5f} [{d.ci_low:+.5f}, {d.ci_high:+.5f}]{star}",
                          flush=True)


@dataclass(frozen=True)
class Row:
    """One method's scores on every test example: (N,) float64 KL and 0/1 correctness."""

    kl: torch.Tensor
    correct: torch.Tensor
    bits: float
    seconds: float
    variant: str
    allocation: dict[str, tuple[int, ...]]


def code_fingerprint(model_file: Path) -> str:
    """sha256 of what a row depends on besides its arguments: the library, the flows (configs,
    data draws), params.yaml, the input loader and the model's weights."""
    h = hashlib.sha256()
    files = sorted([*ROOT.glob("bayesq/**/*.py"), *ROOT.glob("flows/**/*.py")])
    for f in [*files, ROOT / "params.yaml", ROOT / "benchmarks" / "one_time_cost.py", model_file]:
        h.update(str(f.relative_to(ROOT)).encode())
        h.update(f.read_bytes())
    h.update(torch.__version__.encode())
    return h.hexdigest()


def row_key(name: str, spec: str, cfg, budget: float, seed: int, allocation, n_test: int, code: str) -> str:
    """16 hex digits naming one row's inputs (``cfg``'s repr is its every setting)."""
    given = json.dumps(allocation, sort_keys=True) if allocation is not None else ""
    return hashlib.sha256(repr((name, spec, repr(cfg), budget, seed, given, n_test, code)).encode()).hexdigest()[:16]


def safe_name(spec: str) -> str:
    """A method spec as a file-name part (``lsq:baselines.lsq.iters=2000`` -> ``lsq_baselines.lsq.iters_2000``)."""
    return "".join(c if c.isalnum() or c in "-." else "_" for c in spec)[:80]


def save_row(path: Path, row: Row) -> None:
    """``row`` as safetensors (tensors ``kl``, ``correct``; the rest as JSON metadata), written
    to a temporary name and renamed, so a stopped run leaves no half file."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"bits": repr(row.bits), "seconds": repr(row.seconds), "variant": row.variant,
            "allocation": json.dumps(row.allocation)}
    tmp = path.with_suffix(".tmp")
    save_file({"kl": row.kl.contiguous(), "correct": row.correct.contiguous()}, str(tmp), metadata=meta)
    tmp.replace(path)


def load_row(path: Path) -> Row | None:
    """The row saved at ``path``; None where there is none or it cannot be read (recomputed then)."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            return Row(kl=f.get_tensor("kl"), correct=f.get_tensor("correct"), bits=float(meta["bits"]),
                       seconds=float(meta["seconds"]), variant=meta["variant"],
                       allocation={k: tuple(v) for k, v in json.loads(meta["allocation"]).items()})
    except Exception as e:  # a corrupt or foreign file: say so and recompute
        print(f"{path}: not a readable row ({type(e).__name__}: {e}); recomputing", flush=True)
        return None

def parse_spec(spec: str) -> tuple[str, dict]:
    """``METHOD[:section.key=value,...]`` -> (method, {dotted key: YAML value})."""
    import yaml

    method, _, rest = spec.partition(":")
    over = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"{spec!r}: write overrides as section.key=value")
        over[key.strip()] = yaml.safe_load(value)
    return method, over


if __name__ == "__main__":
    main()
