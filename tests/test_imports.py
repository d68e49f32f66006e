"""Imports run one way, read from the source with `ast`, lazy imports included: a module imports
only its own package and the packages below it, and no modules import each other in a cycle.
Two dependencies an import graph cannot see are checked too: no module outside `cli/` builds a
command line for the CLI (a launcher that ran `python -m rekv_jax.cli` would depend on the layer
at the top), and JAX's private modules are reached through one module only."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOP = ""  # rekv_jax/*.py: the shared vocabulary
KERNELS = "pallas_kernels"
# package -> the packages it may import besides its own
ALLOWED = {
    KERNELS: set(),
    TOP: {KERNELS},
    "model": {TOP, KERNELS},
    "transport": {TOP, KERNELS},
    "launch": {"transport", TOP, KERNELS},
    "handoff": {"model", "launch", "transport", TOP, KERNELS},
    "planning": {"model", "transport", TOP, KERNELS},
    "quality": {"handoff", "model", "launch", "transport", TOP, KERNELS},
    "serving": {"handoff", "planning", "model", "launch", "transport", TOP, KERNELS},
    "study": {"serving", "quality", "handoff", "planning", "model", "launch", "transport", TOP,
              KERNELS},
    "cli": {"study", "serving", "quality", "handoff", "planning", "model", "launch", "transport",
            TOP, KERNELS},
}


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted name -> file, for every module of rekv_jax and pallas_kernels under `root`."""
    out = {}
    for top in ("rekv_jax", KERNELS):
        for f in sorted((root / top).rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports(name: str, file: pathlib.Path, known: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its file (functions included)."""
    is_pkg = file.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".")[:len(name.split(".")) - node.level + is_pkg]
                base = ".".join([*pkg, *([base] if base else [])])
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                    for a in node.names}
    return {m for m in out if m in known and m != name}


def package(module: str) -> str:
    """`rekv_jax.handoff.core` -> "handoff"; `rekv_jax.sizes` and `rekv_jax` -> TOP."""
    parts = module.split(".")
    if parts[0] == KERNELS:
        return KERNELS
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else TOP


def graph(root: pathlib.Path) -> dict[str, set[str]]:
    found = modules(root)
    return {m: imports(m, f, set(found)) for m, f in found.items()}


def violations(deps: dict[str, set[str]]) -> list[str]:
    """Every import that runs against the layers, and every unknown package."""
    bad = []
    for m, targets in sorted(deps.items()):
        own = package(m)
        if own not in ALLOWED:
            bad.append(f"{m}: package {own!r} has no place in the layers (add it to ALLOWED)")
            continue
        for t in sorted(targets):
            to = package(t)
            if to != own and to not in ALLOWED[own]:
                bad.append(f"{m} imports {t} ({to or 'top level'} is not below "
                           f"{own or 'top level'})")
    return bad


def cycles(deps: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in deps.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(deps):
        if v not in index:
            visit(v)
    return out


def test_imports_run_one_way():
    deps = graph(ROOT)
    assert "rekv_jax.cli.main" in deps  # the layout this test checks is the tree's
    assert not violations(deps), "\n".join(violations(deps))


def test_no_import_cycles():
    assert not cycles(graph(ROOT)), cycles(graph(ROOT))


def test_the_check_finds_planted_violations(tmp_path):
    files = {
        "pallas_kernels/quant.py": "def f():\n    from rekv_jax import sizes\n",
        "rekv_jax/__init__.py": "",
        "rekv_jax/sizes.py": "from rekv_jax.model import transformer\n",
        "rekv_jax/model/__init__.py": "",
        "rekv_jax/model/transformer.py": "import rekv_jax.sizes\n",
        "rekv_jax/quality/__init__.py": "",
        "rekv_jax/quality/gate.py": "from rekv_jax.planning.costmodel import x\n",
        "rekv_jax/planning/__init__.py": "",
        "rekv_jax/planning/costmodel.py": "",
        "rekv_jax/study/__init__.py": "",
        "rekv_jax/study/a.py": "def f():\n    from rekv_jax.study import b\n",
        "rekv_jax/study/b.py": "from rekv_jax.study.a import f\nfrom rekv_jax.cli import main\n",
        "rekv_jax/cli/__init__.py": "",
        "rekv_jax/cli/main.py": "from . import other\n",
        "rekv_jax/cli/other.py": "",
        "rekv_jax/serving/__init__.py": "",
        "rekv_jax/serving/pages.py": "from rekv_jax.model import transformer\n",
        "rekv_jax/handoff/__init__.py": "",
        "rekv_jax/handoff/core.py": "from rekv_jax.serving.pages import BlockTable\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    deps = graph(tmp_path)
    assert deps["rekv_jax.cli.main"] == {"rekv_jax.cli.other"}  # relative imports resolve
    assert [v.split(" (")[0] for v in violations(deps)] == [
        "pallas_kernels.quant imports rekv_jax.sizes",
        "rekv_jax.handoff.core imports rekv_jax.serving.pages",
        "rekv_jax.quality.gate imports rekv_jax.planning.costmodel",
        "rekv_jax.sizes imports rekv_jax.model.transformer",
        "rekv_jax.study.b imports rekv_jax.cli.main",
    ]
    assert cycles(deps) == [["rekv_jax.model.transformer", "rekv_jax.sizes"],
                            ["rekv_jax.study.a", "rekv_jax.study.b"]]


# ------------------------------------------------ what the import graph cannot see

CLI_MODULE = "rekv_jax.cli"
CONSOLE_SCRIPT = "rekv"
PRIVATE_JAX = "jax." + "_src"  # spelled apart: this file is searched too
PRIVATE_DOOR = "rekv_jax/jax_private.py"


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def cli_command_lines(root: pathlib.Path) -> list[str]:
    """Modules outside `cli/` that build a command line for the CLI: a string naming the CLI's
    module (as `python -m` takes it) outside a docstring, or a list or tuple that starts with
    its console script."""
    bad = []
    for name, file in modules(root).items():
        if name.startswith(CLI_MODULE) or name.startswith(KERNELS):
            continue
        tree = ast.parse(file.read_text())
        skip = _docstrings(tree)
        for node in ast.walk(tree):
            named = (isinstance(node, ast.Constant) and id(node) not in skip
                     and isinstance(node.value, str)
                     and node.value.split()[:1] and node.value.split()[0].startswith(CLI_MODULE))
            script = (isinstance(node, ast.List | ast.Tuple) and node.elts
                      and isinstance(node.elts[0], ast.Constant)
                      and node.elts[0].value == CONSOLE_SCRIPT)
            if named or script:
                bad.append(f"{name}:{node.lineno}")
    return bad


def private_jax_users(root: pathlib.Path) -> list[str]:
    """Every Python file of the tree (tests and scripts too) that names JAX's private modules."""
    return sorted(str(f.relative_to(root)) for top in ("rekv_jax", KERNELS, "tests", "scripts")
                  for f in (root / top).rglob("*.py") if PRIVATE_JAX in f.read_text())


def test_only_the_cli_builds_command_lines_for_the_cli():
    assert not cli_command_lines(ROOT), cli_command_lines(ROOT)


def test_jax_private_modules_have_one_door():
    assert private_jax_users(ROOT) == [PRIVATE_DOOR]


def test_the_checks_find_planted_command_lines_and_private_imports(tmp_path):
    files = {
        "rekv_jax/__init__.py": "",
        "rekv_jax/transport/__init__.py": "",
        "rekv_jax/transport/job.py": (
            '"""Runs `python -m rekv_jax.cli handoff` (a docstring may say so)."""\n'
            "import sys\n"
            'ARGV = [sys.executable, "-m", "rekv_jax.cli", "handoff"]\n'),
        "rekv_jax/study/__init__.py": "",
        "rekv_jax/study/sweep.py": 'CMD = ("rekv", "handoff", "--json")\nOK = ["rekv-x"]\n',
        "rekv_jax/cli/__init__.py": "",
        "rekv_jax/cli/main.py": 'ARGV = ["-m", "rekv_jax.cli"]\n',
        "rekv_jax/jax_private.py": f"from {PRIVATE_JAX} import distributed\n",
        "tests/test_x.py": f"from {PRIVATE_JAX} import xla_bridge\n",
        "scripts/x.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cli_command_lines(tmp_path) == ["rekv_jax.study.sweep:1", "rekv_jax.transport.job:3"]
    assert private_jax_users(tmp_path) == [PRIVATE_DOOR, "tests/test_x.py"]


HTTP_STACK = ("fastapi", "pydantic", "starlette", "uvicorn")
HTTP_FRONT_END = {"rekv_jax.serving.http", "rekv_jax.serving.openai_request",
                  "rekv_jax.serving.openai_answer", "rekv_jax.serving.limits"}


def test_only_the_http_front_end_needs_the_http_stack():
    """A GPU image may hold JAX and not FastAPI: every module but the OpenAI front end (the
    doctor, a generated load and the Python API included) imports with the HTTP stack absent,
    and the front end, importing it, fails there (so the block is real); `rekv serve --http`
    then says so in one line, exit 2."""
    names = sorted(n for n in set(modules(ROOT)) - HTTP_FRONT_END if not n.endswith("__main__"))
    code = ("import importlib, sys\n"
            f"for m in {HTTP_STACK!r}:\n    sys.modules[m] = None\n"
            f"for n in {names!r}:\n    importlib.import_module(n)\n"
            "try:\n    importlib.import_module('rekv_jax.serving.http')\n"
            "except ImportError:\n    print('front end refused')\n"
            "from rekv_jax.cli.main import main\n"
            "main(['serve', '--model', 'tiny-7b', '--http', '127.0.0.1:0'])\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2, run.stderr[-3000:]  # `rekv serve --http` refused, one line:
    assert run.stderr.strip() == ("rekv serve: error: --http needs fastapi, pydantic, uvicorn, "
                                  "not installed here (they come with rekv-jax's dependencies: "
                                  "pip install -e .)")
    assert run.stdout.strip() == "front end refused"
