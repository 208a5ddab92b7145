"""The package's structure holds, as docs/architecture.md states: the layers import only what the
table below lets them (:data:`LAYERS`), no import cycles, and no module using another module's
private (underscore) names. All three read the source with ``ast``, so they see every import,
including those inside functions; an import under ``if TYPE_CHECKING:`` runs only for type
checkers and does not count. ``pyinfinity._C`` (the compiled core) is a leaf, and its name is
public.

An import is an edge to the module it names (``from pkg import mod``: to ``pkg.mod``; ``from pkg
import name``: to ``pkg``'s ``__init__``), relative imports resolved; the parent packages Python
also runs are not edges (``pyinfinity/__init__.py`` loads the engine only when an attribute asks
for it: the package face's imports inside its functions are the one kind allowed to run up the
table). A private name is one with a single leading underscore: imported from another pyinfinity
module (a private module included), or read or set as ``x._name`` / ``getattr(x, "_name")`` where
``x`` is not ``self``/``cls`` and ``_name`` is bound by another pyinfinity module and not by this
one (names torch's modules and tensors have are torch's). The examples are checked for private
names too; the tests are not."""
from __future__ import annotations

import ast
import os
import shutil
from dataclasses import dataclass, field
from typing import Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "pyinfinity"
EXEMPT = {"_C"}  # the compiled core: a public name that starts with an underscore
FACE = PACKAGE  # the package's __init__: its imports inside functions are lazy and may run up the table

# The layers, bottom up: (name, the modules and packages in it, the layers below it it may import).
# A module may import modules of its own layer and of the layers it names; docs/architecture.md
# draws the same table.
LAYERS: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    ("core", ("_C",), ()),
    ("leaves", ("config_values", "units", "device", "host_memory", "guards", "presets", "post_import", "progress"),
     ("core",)),
    ("config", ("config",), ("leaves",)),
    ("swap", ("swap", "aio"), ("core", "leaves", "config")),
    ("layout", ("layout",), ("leaves",)),
    ("zero", ("zero",), ("core", "leaves", "config", "swap", "layout")),
    ("plan", ("plan",), ("core", "leaves", "config", "layout")),
    # the rate probes time the engine's own code (optimizer steps, gradient add, the swap engine)
    # for the planner, which takes the rates it is given
    ("probes", ("probes",), ("core", "leaves", "config", "swap", "layout", "zero", "plan")),
    ("state io", ("checkpoint", "export", "pretrained", "adapters", "resume"),
     ("core", "leaves", "config", "swap", "layout", "zero")),
    ("engine", ("engine", "telemetry"),
     ("core", "leaves", "config", "swap", "layout", "zero", "plan", "probes", "state io")),
    # DeepSpeed's I/O backend, and pyinfinity's engine behind deepspeed.initialize (which builds an engine)
    ("integrations", ("integrations",),
     ("core", "leaves", "config", "swap", "layout", "zero", "plan", "probes", "state io", "engine")),
    # the package face (pyinfinity/__init__.py) imports only leaves when it loads (the post-import finder
    # it registers); its imports inside functions (the engine, the names it hands out) are lazy, the one
    # kind allowed anywhere
    ("face", ("",), ("leaves",)),
    ("tools", ("bench", "cli", "data", "__main__"),
     ("core", "leaves", "config", "swap", "layout", "zero", "plan", "probes", "state io", "engine", "face")),
]
# Imports that run up the table all the same, each with its reason (none is allowed silently).
UPWARD_EXCEPTIONS: dict[tuple[str, str], str] = {}


def torch_private_names() -> set[str]:
    """Private attributes of torch's modules and tensors (``module._buffers``, ``t._version``): a
    use of one of these names is a use of torch's, not of another pyinfinity module's."""
    import torch

    return {n for n in set(dir(torch.nn.Module())) | set(dir(torch.Tensor)) if n.startswith("_")}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name not in EXEMPT


@dataclass
class Module:
    name: str
    path: str
    tree: ast.Module
    is_package: bool
    imports: dict[str, int] = field(default_factory=dict)        # imported pyinfinity module -> first line
    private_uses: list[str] = field(default_factory=list)         # "line N: what"
    defines: set[str] = field(default_factory=set)                # private names this module binds
    eager: set[str] = field(default_factory=set)                 # imported outside functions (at import time)


def find_modules(root: str) -> dict[str, Module]:
    modules = {}
    base = os.path.join(root, PACKAGE)
    for dirpath, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            parts = os.path.relpath(path, root)[:-3].split(os.sep)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            name = ".".join(parts)
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
            tree = ast.parse(text, filename=path)
            modules[name] = Module(name, path, tree, is_package)
    return modules


def is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (its ``else`` still runs)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and is_type_checking(node.test):
            stack.extend(node.orelse)
            stack.append(node.test)
            continue
        stack.extend(ast.iter_child_nodes(node))


def function_level_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes inside a function (they run when it is called, not when the module loads)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(node) if n is not node)
    return inside


def layer_of(name: str) -> Optional[str]:
    """The layer of module ``name`` (:data:`LAYERS`), or None when the table does not place it."""
    rel = name[len(PACKAGE) + 1:] if name.startswith(PACKAGE + ".") else ("" if name == PACKAGE else None)
    if rel is None:
        return None
    for layer, where, _ in LAYERS:
        for w in where:
            if rel == w or (w and rel.startswith(w + ".")):
                return layer
    return None


def layer_violations(modules: dict[str, Module]) -> list[str]:
    """Imports the layer table does not allow, one line each: a module the table does not place,
    or an import of a layer its own does not name (the face's imports inside functions and
    :data:`UPWARD_EXCEPTIONS` aside)."""
    may = {layer: set(below) | {layer} for layer, _, below in LAYERS}
    bad = []
    for m in sorted(modules.values(), key=lambda m: m.name):
        mine = layer_of(m.name)
        if mine is None:
            bad.append(f"{m.name}: in no layer of the table")
            continue
        for target, line in sorted(m.imports.items()):
            theirs = layer_of(target)
            if theirs is None or theirs in may[mine]:
                continue
            if m.name == FACE and target not in m.eager:
                continue  # the package face's lazy imports
            if any(m.name == a and (target == b or target.startswith(b + ".")) for a, b in UPWARD_EXCEPTIONS):
                continue
            bad.append(f"{m.name} ({mine}) line {line} imports {target} ({theirs})")
    return bad


def defined_private_names(tree: ast.Module) -> set[str]:
    """Private names a module binds: its functions, classes and globals, their methods and class
    attributes, and attributes it assigns on ``self``/``cls``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if is_private(n)}


def resolve_from(module: Module, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.name.split(".")
    if not module.is_package:
        parts = parts[:-1]
    if node.level > 1:
        parts = parts[:-(node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def deepest_known(name: str, modules: dict[str, Module]) -> str | None:
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules or candidate == f"{PACKAGE}._C":
            return candidate
        parts.pop()
    return None


def find_scripts(root: str, folder: str) -> dict[str, Module]:
    """The scripts of ``folder`` (the examples): users of the package, checked for private names."""
    scripts = {}
    base = os.path.join(root, folder)
    for f in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        if f.endswith(".py"):
            path = os.path.join(base, f)
            with open(path, encoding="utf-8") as fh:
                scripts[f"{folder}/{f}"] = Module(f"{folder}/{f}", path, ast.parse(fh.read(), filename=path), False)
    return scripts


def analyse(modules: dict[str, Module], scripts: Optional[dict[str, Module]] = None) -> None:
    """Fills in each module's imports and private uses; ``scripts`` (outside the package) get their
    private uses of the package's names only."""
    for m in modules.values():
        m.defines = defined_private_names(m.tree)
    defined_anywhere: dict[str, set[str]] = {}
    for m in modules.values():
        for n in m.defines:
            defined_anywhere.setdefault(n, set()).add(m.name)
    for n in torch_private_names():
        defined_anywhere.pop(n, None)
    for m in (scripts or {}).values():
        m.defines = defined_private_names(m.tree)

    for m in list(modules.values()) + list((scripts or {}).values()):
        in_functions = function_level_nodes(m.tree)
        for node in runtime_nodes(m.tree):
            line = getattr(node, "lineno", 0)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] != PACKAGE:
                        continue
                    target = deepest_known(alias.name, modules)
                    if target:
                        m.imports.setdefault(target, line)
                        if id(node) not in in_functions:
                            m.eager.add(target)
                    bad = [p for p in alias.name.split(".") if is_private(p)]
                    if bad:
                        m.private_uses.append(f"line {line}: import {alias.name}")
            elif isinstance(node, ast.ImportFrom):
                base = resolve_from(m, node)
                if base.split(".")[0] != PACKAGE:
                    continue
                if any(is_private(p) for p in base.split(".")):
                    m.private_uses.append(f"line {line}: from {base} import ...")
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    known = sub in modules or sub == f"{PACKAGE}._C"
                    target = deepest_known(sub if known else base, modules)
                    if target:
                        m.imports.setdefault(target, line)
                    if is_private(alias.name):
                        m.private_uses.append(f"line {line}: from {base} import {alias.name}")
                    if target and id(node) not in in_functions:
                        m.eager.add(target)
            elif isinstance(node, ast.Attribute):
                name = node.attr
                owner = node.value
                if (not is_private(name) or name in m.defines or name not in defined_anywhere
                        or (isinstance(owner, ast.Name) and owner.id in ("self", "cls"))):
                    continue
                where = ", ".join(sorted(defined_anywhere[name]))
                m.private_uses.append(f"line {line}: .{name} (defined in {where})")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                name = node.args[1].value
                if is_private(name) and name not in m.defines and name in defined_anywhere:
                    where = ", ".join(sorted(defined_anywhere[name]))
                    m.private_uses.append(f"line {line}: {node.func.id}(..., {name!r}) (defined in {where})")


def import_cycles(modules: dict[str, Module]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one cycle
    through it, smallest first."""
    graph = {name: sorted(t for t in m.imports if t in modules and t != name) for name, m in modules.items()}
    index, low, on_stack, stack, comps = {}, {}, set(), [], []
    counter = [0]

    def strongconnect(v: str) -> None:
        work = [(v, iter(graph[v]))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                    advanced = True
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return [one_cycle(comp, graph) for comp in sorted(comps, key=len)]


def one_cycle(comp: list[str], graph: dict[str, list[str]]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected component (breadth first)."""
    members = set(comp)
    start = comp[0]
    prev = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in graph[v]:
            if w not in members:
                continue
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, v, start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return comp


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    mods = find_modules(ROOT)
    analyse(mods)
    return mods


@pytest.fixture(scope="module")
def examples() -> dict[str, Module]:
    mods, scripts = find_modules(ROOT), find_scripts(ROOT, "examples")
    analyse(mods, scripts)
    return scripts


def test_there_are_no_import_cycles(modules):
    cycles = import_cycles(modules)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_uses_another_modules_private_names(modules):
    bad = {m.name: m.private_uses for m in modules.values() if m.private_uses}
    assert not bad, "private names used across modules:\n" + "\n".join(
        f"{name}: {use}" for name, uses in sorted(bad.items()) for use in uses)


def test_the_layers_import_only_what_the_table_allows(modules):
    bad = layer_violations(modules)
    assert not bad, "imports the layer table does not allow:\n" + "\n".join(bad)


def test_the_layer_table_runs_bottom_up():
    seen: set[str] = set()
    for layer, _, below in LAYERS:
        assert set(below) <= seen, f"{layer} may import a layer above it: {sorted(set(below) - seen)}"
        seen.add(layer)


def test_the_examples_use_no_private_names_of_the_package(examples):
    assert examples, "no examples found"
    bad = {m.name: m.private_uses for m in examples.values() if m.private_uses}
    assert not bad, "private names of pyinfinity used by the examples:\n" + "\n".join(
        f"{name}: {use}" for name, uses in sorted(bad.items()) for use in uses)


# The checks themselves, on small made-up packages: each must catch what it is for.

def make_package(tmp_path, files: dict[str, str]) -> dict[str, Module]:
    for rel, text in files.items():
        path = tmp_path / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for d in [p for p in (tmp_path / PACKAGE).rglob("*") if p.is_dir()] + [tmp_path / PACKAGE]:
        (d / "__init__.py").touch()
    mods = find_modules(str(tmp_path))
    analyse(mods)
    return mods


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    mods = make_package(tmp_path, {
        "a.py": "from pyinfinity import b\n",
        "b.py": "def f():\n    from . import c\n",
        "c.py": "def g():\n    import pyinfinity.a\n",
    })
    assert import_cycles(mods) == [[f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.c", f"{PACKAGE}.a"]]


def test_type_checking_imports_and_the_core_do_not_count(tmp_path):
    mods = make_package(tmp_path, {
        "a.py": "from typing import TYPE_CHECKING\nfrom pyinfinity import b, _C\n",
        "b.py": "import typing\nif typing.TYPE_CHECKING:\n    from pyinfinity.a import A\nelse:\n    pass\n",
    })
    assert not import_cycles(mods)
    assert not any(m.private_uses for m in mods.values())
    mods = make_package(tmp_path, {"b.py": "if TYPE_CHECKING:\n    pass\nelse:\n    from .a import A\n"})
    assert import_cycles(mods) == [[f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.a"]]


def test_relative_and_package_imports_resolve(tmp_path):
    mods = make_package(tmp_path, {
        "sub/x.py": "from ..y import f\nfrom . import z\nfrom .. import sub\n",
        "sub/z.py": "",
        "y.py": "import pyinfinity.sub.x\n",
    })
    x = mods[f"{PACKAGE}.sub.x"]
    assert set(x.imports) == {f"{PACKAGE}.y", f"{PACKAGE}.sub.z", f"{PACKAGE}.sub"}
    assert import_cycles(mods) == [[f"{PACKAGE}.sub.x", f"{PACKAGE}.y", f"{PACKAGE}.sub.x"]]


def test_private_names_across_modules_are_found(tmp_path):
    mods = make_package(tmp_path, {
        "a.py": ("_LIMIT = 1\ndef _helper(): pass\nclass A:\n    def __init__(self):\n"
                 "        self._state = 0\n    def _check(self): return self._state\n"
                 "    def same(self, other): return other._state\n"),
        "b.py": ("from pyinfinity.a import _helper\nfrom pyinfinity import a\nfrom pyinfinity.sub import _priv\n"
                 "def f(eng):\n    eng._check()\n    a._LIMIT\n    getattr(eng, '_state')\n"
                 "    eng._not_ours\n    eng.__dict__\n    eng._state = 1\n"),
        "sub/_priv.py": "",
    })
    assert not mods[f"{PACKAGE}.a"].private_uses  # a class's own names, on another instance too
    uses = mods[f"{PACKAGE}.b"].private_uses
    assert [u.split(":", 1)[0] for u in uses].count("line 1") == 1
    assert any("import _priv" in u for u in uses)
    assert any("._check" in u for u in uses) and any("._LIMIT" in u for u in uses)
    assert any("'_state'" in u for u in uses)
    assert any(u.startswith("line 10:") and "._state" in u for u in uses)  # assigning one is using it
    assert not any("_not_ours" in u or "__dict__" in u for u in uses)  # not a name of this package


def test_a_script_using_a_private_name_of_the_package_is_found(tmp_path):
    make_package(tmp_path, {"a.py": "def _helper(): pass\nclass A:\n    def _check(self): pass\n"})
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "run.py").write_text(
        "import pyinfinity.a as a\nfrom pyinfinity.a import A\n_mine = 1\na._helper()\nA()._check()\nprint(_mine)\n")
    mods, scripts = find_modules(str(tmp_path)), find_scripts(str(tmp_path), "examples")
    analyse(mods, scripts)
    uses = scripts["examples/run.py"].private_uses
    assert sorted(u.split(":", 1)[0] for u in uses) == ["line 4", "line 5"], uses


def test_a_planted_upward_import_is_found(tmp_path):
    mods = make_package(tmp_path / "one", {
        "config_values.py": "def f():\n    from pyinfinity.zero import state\n",  # inside a function: counts
        "units.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pyinfinity.engine import E\n",
        "layout/shards.py": "import pyinfinity.plan.evaluation\n",
        "plan/evaluation.py": "from pyinfinity.layout import shards\n",  # downward: allowed
        "zero/state.py": "",
        "engine.py": "",
        "__init__.py": "def __getattr__(name):\n    from pyinfinity import engine\n",  # the face, lazily: allowed
    })
    bad = layer_violations(mods)
    assert [b.split(" line")[0] for b in bad] == [f"{PACKAGE}.config_values (leaves)",
                                                  f"{PACKAGE}.layout.shards (layout)"], bad
    assert bad[0].endswith("imports pyinfinity.zero.state (zero)"), bad
    assert bad[1].endswith("imports pyinfinity.plan.evaluation (plan)"), bad
    # the face importing the engine at import time
    mods = make_package(tmp_path / "two", {"__init__.py": "from pyinfinity import engine\n", "engine.py": ""})
    assert [b.split(" line")[0] for b in layer_violations(mods)] == [f"{PACKAGE} (face)"]
    mods = make_package(tmp_path / "three", {"stray.py": ""})
    assert f"{PACKAGE}.stray: in no layer of the table" in layer_violations(mods)


def test_an_upward_import_planted_in_a_copy_of_the_package_is_found(tmp_path):
    shutil.copytree(os.path.join(ROOT, PACKAGE), tmp_path / PACKAGE,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    target = tmp_path / PACKAGE / "layout" / "shards.py"
    target.write_text(target.read_text() + "\n\ndef _planted():\n    from pyinfinity.zero import state\n")
    mods = find_modules(str(tmp_path))
    analyse(mods)
    bad = layer_violations(mods)
    assert len(bad) == 1 and bad[0].startswith(f"{PACKAGE}.layout.shards (layout)"), bad
    assert bad[0].endswith("imports pyinfinity.zero.state (zero)"), bad
