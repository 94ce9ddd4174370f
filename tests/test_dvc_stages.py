"""dvc.yaml: each stage's dependencies hold every flows module its command imports (but those in
NOT_OUTPUTS), so that DVC re-runs a stage when code it runs changes."""

import ast
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
#: flows files whose code does not change what a stage writes, so no stage depends on them
NOT_OUTPUTS = {
    "flows/__init__.py": "the repository root only",
    "flows/locks.py": "how concurrent runs wait on a cache key, not what they compute",
}


def _file(module: str) -> Path | None:
    path = ROOT / (module.replace(".", "/") + ".py")
    package = ROOT / module.replace(".", "/") / "__init__.py"
    return path if path.exists() else package if package.exists() else None


def _imported(module: str) -> set[Path]:
    """The flows files ``module`` imports, at module level or inside functions, transitively
    (a package's ``__init__`` included)."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(2, len(parts))]  # the packages on the way
        path = _file(name)
        if path is None or path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "flows":
                todo += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.split(".")[0] == "flows"]
    return seen


def test_every_stage_depends_on_the_flows_code_it_runs():
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    checked = 0
    for name, stage in stages.items():
        cmd = stage["cmd"] if isinstance(stage["cmd"], str) else " ".join(stage["cmd"])
        found = re.search(r"python -m flows (\w+)", cmd)
        if not found:
            continue
        deps = [ROOT / d for d in stage.get("deps", []) if isinstance(d, str)]
        missing = sorted(str(f.relative_to(ROOT)) for f in _imported(f"flows.{found.group(1)}")
                         if not any(f == d or d in f.parents for d in deps))
        missing = [f for f in missing if f not in NOT_OUTPUTS]
        assert not missing, f"stage {name} runs {missing} but does not depend on them: add them to its deps"
        checked += 1
    assert checked >= 8  # fetch, finetune, quantize, sources, report, deploy, ablate, shift, ...
