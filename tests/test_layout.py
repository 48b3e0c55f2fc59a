"""The repository's layout: a short root, and no import cycle between the project's own modules.

The root holds the modules a reader opens first; machinery lives in packages (sandbox/, engine/). Imports
are read with `ast` (nothing is imported): every `import` and `from ... import` of a project module, at any
depth of a module's body, is an edge. A harness module's flat imports (`import measure`, as it runs in a
sandbox child) name its siblings in sandbox/harness/. A submodule's own package is not an edge: it is
always imported first, and a package's __init__ importing its submodules is not a cycle.

Run: python -m pytest -q tests/test_layout.py
"""
import ast
import glob
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("sandbox", "engine")
ROOT_MAX = 15


def _modules() -> dict[str, str]:
    """{dotted module name: path} of the root modules and the packages' modules."""
    paths = glob.glob(os.path.join(REPO, "*.py"))
    for pkg in PACKAGES:
        paths += glob.glob(os.path.join(REPO, pkg, "**", "*.py"), recursive=True)
    mods = {}
    for p in paths:
        rel = os.path.relpath(p, REPO)[:-3].split(os.sep)
        mods[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = p
    return mods


def _edges(name: str, path: str, mods: dict[str, str]) -> set[str]:
    is_pkg = path.endswith("__init__.py")
    package = name if is_pkg else name.rpartition(".")[0]
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}  # this module's packages

    def resolve(target: str) -> set[str]:
        if target not in mods and package and f"{package}.{target}" in mods:  # a harness sibling, by flat name
            target = f"{package}.{target}"
        parts = target.split(".")
        found = {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & set(mods)
        return found - own - {name}

    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            for a in node.names:
                out |= resolve(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for a in node.names:
                sub = f"{target}.{a.name}"
                out |= resolve(sub) if sub in mods or (package and f"{package}.{sub}" in mods) else resolve(target)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, comps, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def test_root_is_short():
    root = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "*.py")))
    assert len(root) <= ROOT_MAX, root


def test_no_import_cycle():
    mods = _modules()
    graph = {m: _edges(m, p, mods) for m, p in mods.items()}
    assert "sandbox.core" in graph["sandbox"] and "sandbox.harness.measure" in graph["sandbox.harness.driver"]
    assert _cycles(graph) == []


def test_root_modules_reach_packages_through_their_front():
    """Root modules import `sandbox` and `engine`, never a module inside them (tests and scripts may)."""
    mods = _modules()
    for m, p in mods.items():
        if os.path.dirname(p) != REPO:
            continue
        inner = {e for e in _edges(m, p, mods) if e.partition(".")[0] in PACKAGES and "." in e}
        inner -= {"sandbox.ray"}  # `from sandbox import ray`: the package's own attribute
        assert not inner, (m, inner)


def test_harness_imports_flat_in_a_child_and_as_a_package_on_the_host():
    """The worker starts as a script beside the other harness files (a child's view: flat module names); the
    host imports the same files once each, as modules of sandbox.harness."""
    worker = os.path.join(REPO, "sandbox", "harness", "sandbox_worker.py")
    r = subprocess.run([sys.executable, worker, "--probe"], capture_output=True, text=True, cwd="/", timeout=120)
    assert r.returncode == 0 and "sandbox_worker ok" in r.stdout, r.stderr
    code = ("import sys, sandbox, sandbox.harness.driver; "
            "flat = {'sandbox_worker', 'inline', 'measure', 'wire', 'share', 'driver', 'rules'} & set(sys.modules); "
            "print(sorted(flat) or 'none')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "none", (r.stdout, r.stderr)
