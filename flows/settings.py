"""The environment the pipeline runs in: offline, quiet, and its stores inside the repository.

Nothing here runs on import. :func:`apply_defaults` is called by the entry points
(``python -m flows <stage>``, the ``bayesq`` command) before they import Prefect, MLflow or the
Hugging Face libraries, which read these variables when imported; a value the caller already
set wins (e.g. ``MLFLOW_TRACKING_URI`` pointing at a team's server).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import MutableMapping

from flows import ROOT


def defaults(root: Path = ROOT) -> dict[str, str]:
    """Variable -> value for a pipeline rooted at ``root``."""
    return {
        "DO_NOT_TRACK": "true",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DVC_NO_ANALYTICS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PREFECT_HOME": str(root / ".prefect"),
        "PREFECT_LOGGING_LEVEL": "WARNING",  # Prefect's own console chatter
        # our flow and task runs' INFO lines (flows.tracking.say, Prefect's state changes) reach the
        # UI's Logs tab; the console keeps warnings only (say() prints its line itself)
        "PREFECT_LOGGING_LOGGERS_PREFECT_FLOW_RUNS_LEVEL": "INFO",
        "PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL": "INFO",
        "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
        "PREFECT_LOCAL_STORAGE_PATH": str(root / ".prefect" / "results"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
    }


def apply_defaults(environ: MutableMapping[str, str] | None = None, root: Path = ROOT) -> dict[str, str]:
    """Set every :func:`defaults` variable that ``environ`` (default ``os.environ``) lacks;
    returns the ones it set."""
    env = os.environ if environ is None else environ
    added = {k: v for k, v in defaults(root).items() if k not in env}
    env.update(added)
    return added
