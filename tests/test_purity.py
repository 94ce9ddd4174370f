import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_library_sources_never_import_pipeline_tools():
    pattern = re.compile(r"^\s*(import|from)\s+(prefect|mlflow|dvc|flows)\b", re.M)
    bad = [str(p) for p in (ROOT / "bayesq").rglob("*.py") if pattern.search(p.read_text())]
    assert not bad, f"bayesq/ must stay pure, but these import prefect/mlflow/dvc/flows: {bad}"


def test_library_import_loads_no_pipeline_tools():
    code = (
        "import sys, bayesq, bayesq.quantize, bayesq.baselines.rtn, bayesq.harness.models.zoo;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'mlflow', 'dvc')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


PIPELINE_STACK = {"prefect", "prefect-dask", "mlflow", "dvc", "dask", "distributed", "fastapi", "typer"}


def _name(requirement: str) -> str:
    return re.split(r"[\s=<>~!;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_core_dependencies_exclude_the_pipeline_stack_and_cover_library_imports():
    import tomllib
    from importlib.metadata import packages_distributions, requires

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(r) for r in project["dependencies"]}
    assert not core & PIPELINE_STACK
    assert PIPELINE_STACK <= {_name(r) for r in project["optional-dependencies"]["pipeline"]}
    allowed = set(core)  # the core pins and what they pull in themselves (pillow, triton, ...)
    for dist in core:
        allowed |= {_name(r) for r in requires(dist) or () if "extra ==" not in r}
    top_level = re.compile(r"^(?:import|from)\s+([A-Za-z_]\w*)", re.M)  # module-level imports only
    modules = {m for p in (ROOT / "bayesq").rglob("*.py") for m in top_level.findall(p.read_text())}
    dists = packages_distributions()
    third_party = {m: {_name(d) for d in dists[m]} for m in modules - {"bayesq"} if m in dists}
    missing = {m: d for m, d in third_party.items() if not d & allowed}
    assert not missing, f"bayesq/ imports at module level what only an extra installs: {missing}"


def _project_imports() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its source (module level or inside a
    function); ``from pkg import sub`` counts the submodule, not the package."""
    mods = {}
    for path in list((ROOT / "bayesq").rglob("*.py")) + list((ROOT / "flows").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path

    def owner(dotted: str) -> str | None:
        while dotted and dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph = {}
    for name, path in mods.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
                edges |= {owner(t) for t in (subs or [node.module])}
            elif isinstance(node, ast.Import):
                edges |= {owner(a.name) for a in node.names}
        graph[name] = {t for t in edges if t and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (depth-first search), or None."""
    state, stack = {}, []

    def visit(v):
        state[v] = "open"
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == "open":
                return stack[stack.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = "done"
        stack.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


# Function-local imports of project modules allowed, with why: the CLI imports each subcommand's
# modules (torch, the zoo, the flows) only when that subcommand runs, so `bayesq --help` and the
# light subcommands start fast; the kernel launcher imports the optional Triton kernels only when a
# GPU asks for them, so the library imports on machines without Triton.
LOCAL_IMPORTS_ALLOWED = {"flows/cli.py", "bayesq/kernels/launcher.py"}


def _function_local_project_imports(path: Path) -> list[int]:
    """Lines of ``import``/``from ... import`` of ``bayesq``/``flows`` modules (or relative ones)
    inside a function or class body of the module at ``path``."""
    found = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if nested and isinstance(child, ast.Import):
                if any(a.name.split(".")[0] in ("bayesq", "flows") for a in child.names):
                    found.append(child.lineno)
            elif nested and isinstance(child, ast.ImportFrom):
                if child.level or (child.module or "").split(".")[0] in ("bayesq", "flows"):
                    found.append(child.lineno)
            visit(child, nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))

    visit(ast.parse(path.read_text()), False)
    return found


def test_no_function_local_project_imports_outside_the_cli():
    paths = list((ROOT / "bayesq").rglob("*.py")) + list((ROOT / "flows").rglob("*.py"))
    local = {p.relative_to(ROOT).as_posix(): lines for p in paths if (lines := _function_local_project_imports(p))}
    bad = {p: lines for p, lines in local.items() if p not in LOCAL_IMPORTS_ALLOWED}
    assert not bad, f"import project modules at module level (the import graph has no loops), not in: {bad}"
    assert LOCAL_IMPORTS_ALLOWED <= set(local), "an allowed exception no longer imports locally: drop it"


def test_local_import_finder_vs_hand_made_module(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\nfrom bayesq import config\ntry:\n    import flows.cli\nexcept ImportError:\n    pass\n\n"
                   "def f():\n    import json\n    from bayesq.config import replace\n\n"
                   "class C:\n    def g(self):\n        import flows.common\n        from . import sibling\n")
    assert _function_local_project_imports(src) == [10, 14, 15]


def test_import_graph_has_no_loops():
    cycle = _cycle(_project_imports())
    assert cycle is None, f"import loop: {' -> '.join(cycle)} (move what both need to a module below them)"


def test_method_core_reads_no_harness_but_the_export_loader():
    """The layout: bayesq/harness (embedded models, data, corruptions, model sources) sits beside
    the method core; only loading an export reaches into it (to rebuild an architecture by name
    or from the skeleton the export describes)."""
    graph = _project_imports()
    core = {m: {t for t in edges if t.startswith("bayesq.harness")} for m, edges in graph.items()
            if m.startswith("bayesq") and not m.startswith("bayesq.harness")}
    assert {m: e for m, e in core.items() if e} == {"bayesq.export": {"bayesq.harness.models.zoo",
                                                                      "bayesq.harness.sources"}}


def test_cycle_finder_vs_hand_made_graphs():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_repository_refers_to_nothing_outside_it():
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True).stdout.split()
    texts = [p for p in tracked if p.endswith((".py", ".md", ".yaml", ".toml", ".cfg", ".sh")) or p == "Makefile"]
    outside = re.compile(r"\.\./shared|DESIGN\.md")
    bad = [p for p in texts if (ROOT / p).exists() and outside.search((ROOT / p).read_text(errors="ignore"))]
    assert not bad, f"these files refer to files outside the repository: {bad}"


def test_importing_the_pipeline_sets_no_environment_variable():
    code = (  # third-party imports first: importing torchvision itself sets TORCHINDUCTOR_CACHE_DIR
        "import torchvision, transformers, prefect, mlflow;"
        "import os; before = dict(os.environ);"
        "import flows, flows.common, flows.quantize, flows.report, flows.zoo, flows.cli, flows.settings;"
        "added = sorted(set(os.environ) - set(before)); changed = sorted(k for k in before if os.environ.get(k) != before[k]);"
        "print(added, changed)"
    )
    from flows.settings import defaults

    env = {k: v for k, v in os.environ.items() if k not in defaults()}  # as a user's shell would have it
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[] []"


def test_apply_defaults_keeps_the_callers_values():
    from flows.settings import apply_defaults, defaults

    env = {"MLFLOW_TRACKING_URI": "http://team-server:5000"}
    added = apply_defaults(env, root=Path("/repo"))
    assert env["MLFLOW_TRACKING_URI"] == "http://team-server:5000" and "MLFLOW_TRACKING_URI" not in added
    assert env["PREFECT_HOME"] == str(Path("/repo") / ".prefect") and set(env) == set(defaults())
