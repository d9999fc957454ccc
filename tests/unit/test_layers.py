"""The folders are the layers (docs/design/architecture.md): every import in the package,
lazy ones inside functions too, points to the importer's own layer or one below it."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
    "adapt": {"base", "policies"},
    "slurm": {"base", "comm", "elastic"},
    "loop": {"base", "comm", "cuda", "data", "parallel", "state", "elastic", "policies", "adapt",
             "slurm"},
}
APPS = {"job", "train", "builtin_training", "args", "plot", "models", "datasets", "agent", "__main__",
        "saved_model", "generate",
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


def _package_files():
    for folder in ("hpcadapt", "policies", "cuda", "slurm"):
        for base, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith(".py"):
                    yield os.path.join(base, name)


def test_no_two_modules_share_a_name():
    """``loop/membership.py`` beside ``elastic/membership.py`` made every mention ambiguous."""
    seen = {}
    for path in _package_files():
        name = os.path.basename(path)
        if name in ("__init__.py", "__main__.py"):
            continue
        seen.setdefault(name, []).append(os.path.relpath(path, ROOT))
    twins = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twins, twins


def _module_level(tree):
    """What runs at import: the module's statements, ``if``/``try`` blocks, class bodies,
    and of each function its decorators and default values (not its body)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from node.decorator_list
            yield from node.args.defaults
            yield from (d for d in node.args.kw_defaults if d is not None)
            continue
        if isinstance(node, ast.ClassDef):
            yield from node.decorator_list
            yield from node.bases
            todo.extend(node.body)
            continue
        if isinstance(node, (ast.If, ast.Try)):
            todo.extend(node.body + node.orelse + getattr(node, "finalbody", [])
                        + [s for h in getattr(node, "handlers", []) for s in h.body])
            yield from ([node.test] if isinstance(node, ast.If) else [])
            continue
        yield node


def _names_of_os(tree):
    """The names ``os`` is bound to (``import os``, ``import os as _os``) and those of its
    environment functions imported directly (``from os import environ, getenv``)."""
    module, direct = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            module |= {a.asname or a.name for a in node.names if a.name == "os"}
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            direct |= {a.asname or a.name for a in node.names
                       if a.name in ("environ", "getenv", "putenv")}
    return module, direct


# Where importing a module does something on purpose: importing mpi4py starts MPI, and the
# environment MPI must see is set just before, in this one module.
IMPORT_EFFECTS = {os.path.join("hpcadapt", "comm", "mpi.py")}


def test_no_module_reads_or_writes_the_environment_at_import():
    """Reading HPCADAPT_FAULT at import (base/faults.py) tied behaviour to import order, and
    setting MPI's variables in world.py made seven modules import it first for its effect."""
    found = []
    for path in _package_files():
        rel = os.path.relpath(path, ROOT)
        if rel in IMPORT_EFFECTS or "testcluster" in rel:
            continue
        tree = ast.parse(open(path, encoding="utf-8").read())
        module, direct = _names_of_os(tree)
        for stmt in _module_level(tree):
            for node in _walk_outside_lambdas(stmt):
                if ((isinstance(node, ast.Attribute)
                     and node.attr in ("environ", "getenv", "putenv")
                     and isinstance(node.value, ast.Name) and node.value.id in module)
                        or (isinstance(node, ast.Name) and node.id in direct)):
                    found.append(f"{rel}:{node.lineno}")
    assert not found, "module-level environment access: " + ", ".join(found)


def _walk_outside_lambdas(node):
    """``ast.walk`` that does not enter a lambda (its body runs when called, not at import)."""
    todo = [node]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Lambda):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def test_the_import_reader_sees_class_bodies_defaults_and_aliases():
    code = ("import os as _o\nfrom os import getenv as g\n"
            "class A:\n    X = _o.environ.get('A')\n"
            "def f(x=g('B')):\n    return os.environ['C']\n"
            "h = lambda: _o.environ['D']\n")
    tree = ast.parse(code)
    module, direct = _names_of_os(tree)
    hits = sorted({n.lineno for s in _module_level(tree) for n in _walk_outside_lambdas(s)
                   if (isinstance(n, ast.Attribute) and n.attr == "environ"
                       and isinstance(n.value, ast.Name) and n.value.id in module)
                   or (isinstance(n, ast.Name) and n.id in direct)})
    assert hits == [4, 5]   # not the function's body, not the lambda's


def test_mpi_is_imported_through_one_module():
    """Every module gets MPI from hpcadapt.comm.mpi, which sets MPI's environment first."""
    found = []
    for path in _package_files():
        rel = os.path.relpath(path, ROOT)
        if rel in IMPORT_EFFECTS:
            continue
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            if ((isinstance(node, ast.ImportFrom) and node.module
                 and node.module.startswith("mpi4py"))
                    or (isinstance(node, ast.Import)
                        and any(a.name.startswith("mpi4py") for a in node.names))):
                found.append(f"{rel}:{node.lineno}")
    assert not found, "import hpcadapt.comm.mpi instead: " + ", ".join(found)


def test_a_wrong_fault_variable_is_refused_when_armed_not_at_import():
    import subprocess
    import sys

    code = ("import hpcadapt.base.faults as f\nprint('imported', flush=True)\nf.arm()\n")
    env = dict(os.environ, HPCADAPT_FAULT="nonsense", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.strip() == "imported"
    assert proc.returncode != 0 and "HPCADAPT_FAULT='nonsense'" in proc.stderr
