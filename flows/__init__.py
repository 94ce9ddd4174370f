"""Pipeline steps (Prefect flows run by DVC stages). All I/O, caching and tracking live here.

Importing this package sets the offline/quiet environment before Prefect, MLflow or
Hugging Face libraries are imported (values already set by the caller win).
"""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

for _key, _value in {
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_HOME": str(ROOT / ".prefect"),
    "PREFECT_LOGGING_LEVEL": "WARNING",  # Prefect's own console chatter
    # our flow and task runs' INFO lines (flows.tracking.say, Prefect's state changes) reach the
    # UI's Logs tab; the console keeps warnings only (say() prints its line itself)
    "PREFECT_LOGGING_LOGGERS_PREFECT_FLOW_RUNS_LEVEL": "INFO",
    "PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL": "INFO",
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
    "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
    "PREFECT_LOCAL_STORAGE_PATH": str(ROOT / ".prefect" / "results"),
    "MLFLOW_TRACKING_URI": f"sqlite:///{ROOT / 'mlflow.db'}",
}.items():
    os.environ.setdefault(_key, _value)
