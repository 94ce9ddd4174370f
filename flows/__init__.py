"""Pipeline steps (Prefect flows run by DVC stages). All I/O, caching and tracking live here.

Importing this package sets nothing: the entry points (``python -m flows <stage>``, the
``bayesq`` command) apply :func:`flows.settings.apply_defaults` before Prefect or MLflow is
imported.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
