"""Each pipeline row now against the same row of an earlier commit's ``make run``, paired on the
same test examples: what a change of the library did to every method at once.

The quantise stage saves each row's per-example KL and correctness under ``results/examples/``
(``<model>_<method>_b<budget>_s<seed>.safetensors``). The earlier run's files are read from the
DVC cache through that commit's ``dvc.lock`` (the ``results`` output's directory listing), so they
must be in the local cache (a ``make run`` at that commit, or ``dvc pull``). For every row both runs
have, it prints the two mean KLs and ``now - then`` for KL and accuracy with the pipeline's paired
95 % bootstrap intervals (:func:`bayesq.comparison.paired_difference`; ``*``: resolved).

    python tools/pair_runs.py 1bb156a [--results results]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]


def cached_examples(rev: str) -> dict[str, Path]:
    """Row file name -> its path in the DVC cache, for the ``results`` output of ``rev``'s dvc.lock."""
    lock = yaml.safe_load(subprocess.run(["git", "show", f"{rev}:dvc.lock"], cwd=ROOT, check=True,
                                         capture_output=True, text=True).stdout)
    outs = [o for o in lock["stages"]["quantize"]["outs"] if o["path"] == "results"]
    if not outs:
        raise SystemExit(f"{rev}'s dvc.lock has no results output of the quantize stage")
    md5 = outs[0]["md5"]

    def blob(digest: str) -> Path:
        return ROOT / ".dvc" / "cache" / "files" / "md5" / digest[:2] / digest[2:]

    if not blob(md5).exists():
        raise SystemExit(f"the results of {rev} are not in the local DVC cache ({blob(md5)}): run `make run` at {rev} "
                         "or `dvc pull` first")
    listing = json.loads(blob(md5).read_text())
    return {Path(e["relpath"]).name: blob(e["md5"]) for e in listing if e["relpath"].startswith("examples/")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="the earlier commit (its dvc.lock names its results)")
    ap.add_argument("--results", type=Path, default=ROOT / "results", help="the current run's results directory")
    a = ap.parse_args()

    from safetensors.torch import load_file

    from bayesq.comparison import paired_difference

    then = cached_examples(a.rev)
    now = sorted(p for p in (a.results / "examples").glob("*_s*.safetensors") if p.name in then)
    if not now:
        raise SystemExit(f"no row of {a.results / 'examples'} is also in {a.rev}'s results")

    def interval(x, y) -> str:
        d = paired_difference(x, y)
        star = "*" if d.ci_low > 0 or d.ci_high < 0 else ""
        return f"{d.diff:+.5f} [{d.ci_low:+.5f}, {d.ci_high:+.5f}]{star}"

    for path in now:
        x, y = load_file(str(path)), load_file(str(then[path.name]))
        kx, ky = x["kl"].double(), y["kl"].double()
        cx, cy = 100 * x["correct"].double(), 100 * y["correct"].double()
        print(f"{path.stem}: KL {ky.mean():.5f} -> {kx.mean():.5f}, now - then {interval(kx, ky)}; "
              f"accuracy {cy.mean():.2f} -> {cx.mean():.2f} %, {interval(cx, cy)}", flush=True)


if __name__ == "__main__":
    main()
