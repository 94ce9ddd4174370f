"""``python -m flows <stage> [options]``: one pipeline step in the pipeline's environment.

    python -m flows fetch --out data/raw
    python -m flows finetune --params params.yaml --raw data/raw --out models
    python -m flows quantize --params params.yaml --raw data/raw --models models --out results
    python -m flows sources --params params.yaml --out results-sources
    python -m flows report --results results/results.json --models models --out reports
    python -m flows ablate ... | python -m flows shift ... | python -m flows deploy ... | python -m flows zoo ...

Sets :func:`flows.settings.apply_defaults` first (the stage modules import Prefect and MLflow,
which read it), then runs ``flows.<stage>.main()`` with the remaining arguments.
"""

from __future__ import annotations

import importlib
import sys

from flows.settings import apply_defaults

STAGES = ("fetch", "finetune", "quantize", "sources", "ablate", "shift", "deploy", "report", "zoo")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in STAGES:
        raise SystemExit(f"usage: python -m flows {{{','.join(STAGES)}}} [options]: "
                         f"got {argv[0] if argv else 'no stage'!r}")
    stage = argv.pop(0)
    apply_defaults()
    sys.argv = [f"python -m flows {stage}", *argv]
    importlib.import_module(f"flows.{stage}").main()


if __name__ == "__main__":
    main()
