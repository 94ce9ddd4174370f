import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_library_sources_never_import_pipeline_tools():
    pattern = re.compile(r"^\s*(import|from)\s+(prefect|mlflow|dvc)\b", re.M)
    bad = [str(p) for p in (ROOT / "bayesq").rglob("*.py") if pattern.search(p.read_text())]
    assert not bad, f"bayesq/ must stay pure, but these import prefect/mlflow/dvc: {bad}"


def test_library_import_loads_no_pipeline_tools():
    code = (
        "import sys, bayesq, bayesq.quantize, bayesq.baselines.rtn, bayesq.models.zoo;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'mlflow', 'dvc')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
