"""The package's layering, read from the code: who may import whom, and no cycles.

Every ``import`` in ``mpitrain/`` (at module level or inside a function) is
read with the ast module.  The rules: the lower layers (``nn``, ``optim``,
``data``) import no MPI and nothing above them; only ``comm`` imports mpi4py;
only ``backend`` imports cupy; only ``files`` imports yaml; nothing imports
pickle; and no two modules import each other, directly or round a loop.
"""

import ast
import os
from collections import defaultdict

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpitrain")

#: component -> the mpitrain components it may import (besides itself).
ALLOWED = {
    "backend": set(),
    "files": set(),
    "threads": set(),
    "words": set(),
    "state_fields": {"words"},
    "h5io": {"files"},
    "testing": {"backend"},
    "comm": {"backend"},
    "nn": {"backend", "h5io", "files", "state_fields", "words"},
    "optim": {"backend", "state_fields", "words"},
    "data": {"backend", "files", "h5io", "words"},
    "parallel": {"backend", "state_fields", "words"},
    "config": {"files", "nn", "parallel", "words"},
    "plotting": {"files"},
    "thread_plan": {"config", "threads"},
    "starter": {"files"},
    "launch": {"comm", "files"},
    "inference": {"backend", "data", "export", "files", "nn"},
    "export": {"backend", "data", "files", "nn"},
    "convert": {"export", "files", "nn"},   # export: the prior and unseen-pdf scoring rules
    "train": {"backend", "comm", "config", "data", "files", "h5io", "nn", "optim", "parallel",
              "plotting", "state_fields", "threads", "words"},
    "bench": {"backend", "comm", "config", "data", "files", "h5io", "nn", "optim", "parallel",
              "plotting", "starter", "testing", "threads", "train", "words"},
    "process": {"files", "train"},      # train: the stop signals kept for a run
    "cli": {"backend", "bench", "comm", "config", "convert", "data", "export", "files",
            "launch", "nn", "optim",
            "parallel", "plotting", "process", "starter", "threads", "train", "words"},
    "__main__": {"cli", "process", "threads"},      # process: stop signals kept at once
    "__init__": {"inference"},
}
#: third-party modules only one component may import.
ONLY = {"mpi4py": {"comm"}, "cupy": {"backend"}, "cupy_backends": {"backend"},
        "cupyx": set(), "yaml": {"files"}, "pickle": set(), "cPickle": set(), "dill": set()}
#: what config may take from parallel: the names of the methods, not the strategies.
CONFIG_FROM_PARALLEL = {"mpitrain.parallel.registry"}
#: and from nn: the dropout schedule's syntax, not the network.
CONFIG_FROM_NN = {"mpitrain.nn.dropout"}


def _modules(package=PACKAGE):
    for root, _, files in os.walk(package):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, os.path.dirname(package))[:-3].replace(os.sep, ".")
                if rel.endswith(".__init__"):
                    rel = rel[:-len(".__init__")]
                yield rel, path


def _imports(module: str, path: str, package=PACKAGE):
    """Absolute names imported by the file of ``module``."""
    is_package = path.endswith("__init__.py")
    base = module.split(".") if is_package else module.split(".")[:-1]
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base[:len(base) - (node.level - 1)]
                prefix = ".".join(parent + ([node.module] if node.module else []))
            else:
                prefix = node.module
            # "from . import x" names a submodule x; otherwise names from the module
            submodules = [f"{prefix}.{alias.name}" for alias in node.names
                          if os.path.exists(os.path.join(os.path.dirname(package),
                                                         *f"{prefix}.{alias.name}".split("."))
                                            + ".py")]
            if len(submodules) < len(node.names):
                yield prefix, node.lineno
            for candidate in submodules:
                yield candidate, node.lineno


def _component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph(package=PACKAGE):
    modules = dict(_modules(package))
    edges = defaultdict(set)
    found = []
    for module, path in modules.items():
        for name, line in _imports(module, path, package):
            found.append((module, name, line))
            if name.startswith("mpitrain.") or name == "mpitrain":
                target = name
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != module:
                    edges[module].add(target)
    return modules, edges, found


def layering_problems(package=PACKAGE) -> list:
    modules, edges, found = _graph(package)
    bad = []
    for module, targets in edges.items():
        mine = _component(module)
        for target in targets:
            theirs = _component(target)
            if theirs == mine or target == "mpitrain":
                continue
            if theirs not in ALLOWED.get(mine, set()):
                bad.append(f"{module} imports {target}")
            if mine == "config" and theirs == "parallel" and target not in CONFIG_FROM_PARALLEL:
                bad.append(f"{module} imports {target} (only the method registry)")
            if mine == "config" and theirs == "nn" and target not in CONFIG_FROM_NN:
                bad.append(f"{module} imports {target} (only the dropout schedule)")
    bad += [f"component {c!r} has no rule" for c in {_component(m) for m in modules} - set(ALLOWED)]
    bad += [f"{module}:{line} imports {name}" for module, name, line in found
            if name.split(".")[0] in ONLY
            and _component(module) not in ONLY[name.split(".")[0]]]
    return sorted(bad)


def import_cycles(package=PACKAGE) -> list:
    modules, edges, _ = _graph(package)
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            # a package's __init__ importing its own modules is not a loop back
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in modules:
        if module not in index:
            visit(module)
    return cycles


def test_components_import_only_what_lies_below_them():
    assert layering_problems() == []


def test_no_import_cycles():
    assert import_cycles() == []


def test_the_checks_can_fail(tmp_path):
    """A package with a forbidden import inside a function, yaml outside files, and a loop."""
    package = tmp_path / "mpitrain"
    (package / "nn").mkdir(parents=True)
    (package / "comm").mkdir()
    (package / "__init__.py").write_text("")
    (package / "nn" / "__init__.py").write_text("")
    (package / "comm" / "__init__.py").write_text("")
    (package / "nn" / "a.py").write_text("def f():\n    from ..comm import c\n    import yaml\n")
    (package / "nn" / "b.py").write_text("from . import c\n")
    (package / "nn" / "c.py").write_text("from .b import x\n")
    (package / "comm" / "c.py").write_text("import mpi4py\n")
    problems = layering_problems(str(package))
    assert "mpitrain.nn.a imports mpitrain.comm.c" in problems
    assert any("imports yaml" in p for p in problems)      # files alone may
    assert not any("mpi4py" in p for p in problems)       # comm may
    assert import_cycles(str(package)) == [["mpitrain.nn.b", "mpitrain.nn.c"]]


def test_the_architecture_page_gives_every_component_a_row():
    """docs/architecture.md's table names each component the rules above know."""
    page = os.path.join(os.path.dirname(PACKAGE), "docs", "architecture.md")
    with open(page, encoding="utf-8") as fh:
        first_cells = [line.split("|")[1] for line in fh if line.startswith("| `")]
    named = " ".join(first_cells)
    missing = [c for c in ALLOWED if f"`{c}.py`" not in named and f"`{c}/`" not in named]
    assert missing == []
