"""The package's shape: no import cycles between its modules (lazy imports inside functions
and TYPE_CHECKING blocks count too), no module over 500 lines outside the kernels without a
reason at its top, no environment variable read outside `pagedserve/envs.py`, and no file that
points at a document outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pagedserve
from pagedserve import envs

ROOT = Path(pagedserve.__file__).parent
MAX_LINES = 500
# Kernel sources: long by nature (one kernel and its launch logic per file).
KERNELS = ("attention/ops/", "models/layer_kernels.py")
# A longer module says why in its docstring, in a paragraph that starts like this.
SIZE_REASON = "Longer than 500 lines:"


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `name` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import submodule` imports the submodule; any other name, the package.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_long_modules_say_why() -> None:
    long = []
    for path in _modules().values():
        rel = path.relative_to(ROOT).as_posix()
        lines = path.read_text().count("\n")
        if lines <= MAX_LINES or rel.startswith(KERNELS):
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if SIZE_REASON not in doc:
            long.append(f"{rel}: {lines} lines")
    assert long == [], f"modules over {MAX_LINES} lines with no '{SIZE_REASON}' in their docstring"


def test_environment_read_only_in_envs() -> None:
    readers = re.compile(r"os\.environ(\.get|\[)|os\.getenv")
    allowed = {"envs.py", "attention/ops/tq_decode_cuda.py"}  # CUDA_HOME, CUDA_PATH: nvcc's
    offenders = [path.relative_to(ROOT).as_posix() for path in ROOT.rglob("*.py")
                 if readers.search(path.read_text())
                 and path.relative_to(ROOT).as_posix() not in allowed]
    assert offenders == []
    named = set()
    for path in ROOT.rglob("*.py"):
        named.update(re.findall(r"\bPAGEDSERVE_[A-Z_]+\b", path.read_text()))
    assert named <= set(envs.VARIABLES), named - set(envs.VARIABLES)
    for name in envs.VARIABLES:
        getattr(envs, name)  # every reader runs with the environment as it is


# Documents that live outside the repository: a reader of a clone cannot follow a reference to
# them. Built from parts, so that this file does not name them itself.
OUTSIDE_DOCS = [name + ".md" for name in ("DESIGN", "DEVELOPERS", "FACTS", "STYLE")]
OUTSIDE_DIRS = [".." + "/shared"]
# What the repository holds besides the package: every text file under these is read.
REPO_DIRS = ("pagedserve", "tests", "benchmarks", "docs", "scripts", "examples", ".ci")
REPO_FILES = ("README.md", "Makefile", "pyproject.toml")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".toml", ".txt", ".cu", ".json", ".jsonl", ""}


def _repo_text_files() -> list[Path]:
    repo = ROOT.parent
    files = [repo / name for name in REPO_FILES if (repo / name).is_file()]
    for folder in REPO_DIRS:
        files += [path for path in (repo / folder).rglob("*") if path.is_file()
                  and path.suffix in TEXT_SUFFIXES and "__pycache__" not in path.parts]
    return files


def test_no_reference_to_documents_outside_the_repository() -> None:
    names = OUTSIDE_DOCS + OUTSIDE_DIRS
    offenders = []
    for path in _repo_text_files():
        text = path.read_text(errors="replace")
        offenders += [f"{path.relative_to(ROOT.parent)}: {name}" for name in names
                      if name in text]
    assert offenders == [], "cite a file in the repository (docs/architecture.md) instead"
