"""The folders are the layers (docs/design/architecture.md): every import in the package,
lazy ones inside functions too, points to the importer's own layer or one below it."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What each layer may import (besides itself). Applications (train, args, plot, ...) and
# job.py may import anything of the package.
ALLOWED = {
    "base": set(),
    "comm": {"base"},
    "data": {"base"},
    "cuda": {"base", "comm"},
    "parallel": {"base", "comm", "cuda"},
    "state": {"base", "comm", "data", "parallel"},
    "elastic": {"base", "comm"},
    "policies": {"base"},
    "slurm": {"base", "comm", "elastic"},
    "loop": {"base", "comm", "cuda", "data", "parallel", "state", "elastic", "policies",
             "slurm"},
}
APPS = {"job", "train", "trainer", "args", "plot", "models", "datasets", "agent", "__main__",
        "__init__"}
FOLDERS = {"cuda": "cuda", "slurm": "slurm", "policies": "policies"}  # top-level folders


def _layer_of_module(dotted: str) -> str:
    """The layer of ``hpcadapt.X...``."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _sources():
    for layer in ALLOWED:
        folder = os.path.join(ROOT, FOLDERS.get(layer, os.path.join("hpcadapt", layer)))
        for base, _, files in os.walk(folder):
            if "testcluster" in base:
                continue
            for name in files:
                if name.endswith(".py"):
                    yield layer, os.path.join(base, name)


def _imports(path: str):
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "hpcadapt":
                for alias in node.names:
                    yield node.lineno, f"hpcadapt.{alias.name}"
            elif node.module.startswith("hpcadapt."):
                yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hpcadapt."):
                    yield node.lineno, alias.name


def test_every_import_points_down_or_sideways():
    wrong = []
    for layer, path in _sources():
        for line, module in _imports(path):
            target = _layer_of_module(module)
            if target == layer:
                continue
            if target in APPS or target not in ALLOWED[layer]:
                wrong.append(f"{os.path.relpath(path, ROOT)}:{line}: {layer} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_policies_never_import_mpi():
    for _, path in (p for p in _sources() if p[0] == "policies"):
        text = open(path, encoding="utf-8").read()
        assert "mpi4py" not in text, path


@pytest.mark.parametrize("folder", ["hpcadapt", "policies", "cuda", "slurm"])
def test_no_module_over_700_lines(folder):
    long = []
    for base, _, files in os.walk(os.path.join(ROOT, folder)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(base, name)
                n = sum(1 for _ in open(path, encoding="utf-8"))
                if n > 700:
                    long.append(f"{os.path.relpath(path, ROOT)}: {n} lines")
    assert not long, "\n".join(long)
