"""Architecture rules, checked on the source with ``ast`` (nothing of the packages is
imported, except in the one test that is about what an import loads).

* no import cycle between modules, nor between packages (directories);
* datadist's layers (the table below) are one-way: a module imports only modules of its
  own layer or of lower ones;
* ``ems`` never imports datadist's API layer (``datadist._*``); ``datadist.engine.*`` is
  what it builds on;
* importing any ``ems`` module loads no module of datadist's API layer, followed through
  every module it loads on the way (the package ``datadist`` itself excepted: its names
  load on first use); checked on the source, and in a fresh interpreter for ``ems``,
  ``ems.integrations.vllm`` and the pool daemon's modules;
* modules stay under :data:`MAX_MODULE_LINES` lines and functions under cyclomatic
  complexity :data:`MAX_COMPLEXITY` (radon).

Every import counts as a dependency, lazy ones inside functions and type-only ones (under
``if TYPE_CHECKING:``) included: a type-only import is still a module that must be read
to understand the importer, so no cycle may close through one either.  What a module
*loads* is another matter: its imports at module level that run (not lazy, not type-only)
and the parent packages of each module loaded.  An import names the most specific module
it reaches: ``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``; the
parent packages Python runs on the way (``a``, ``a.b``) are not counted as imports of the
importer (they are as what it loads).  Imports computed at run time
(``importlib.import_module(name)``) are not seen.
"""
from __future__ import annotations

import ast
import fnmatch
import os
import subprocess
import sys
from collections import defaultdict, deque
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple

import pytest

# ----------------------------------------------------------------------------- the rules, as data

#: datadist's layers, top to bottom; a module may import modules of its own layer or of a
#: lower one.  Patterns are ``fnmatch`` globs on dotted module names (a package is named by
#: its ``__init__``: ``datadist.engine``).  A module takes the layer of its most specific
#: matching pattern: an exact name beats any glob, a longer glob a shorter one (so
#: ``datadist.engine.link`` is the engine although ``datadist.engine.*`` is the engine base).
LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    ("entry points and adapters", (
        "datadist.integrations", "datadist.integrations.*", "datadist.bench", "datadist.bench.*",
        "datadist.__main__", "llm_datadist", "llm_datadist.*",
    )),
    ("API", ("datadist", "datadist._*")),
    ("planning", ("datadist._planning",)),
    # The API's vocabulary: status codes and exceptions, value types, keys; the planning
    # layer validates with them and raises them.
    ("API values", ("datadist._status", "datadist._objects", "datadist._types")),
    ("engine", (
        "datadist.engine", "datadist.engine.core", "datadist.engine.agent", "datadist.engine.handoff", "datadist.engine.link",
        "datadist.engine.registry", "datadist.engine.handshake", "datadist.engine.incoming",
        "datadist.engine.notes", "datadist.engine.arrivals", "datadist.engine.requests", "datadist.engine.linking",
        "datadist.engine.lookups", "datadist.engine.prepared", "datadist.engine.planning", "datadist.engine.peer_plans",
        "datadist.engine.fences",
    )),
    ("transports and executors", (
        "datadist.engine.transports", "datadist.engine.transports.*",
        "datadist.engine.executor", "datadist.engine.executor.*",
    )),
    ("engine base", ("datadist.engine.*",)),
]

#: The packages whose modules the rules walk.
PACKAGES: Tuple[str, ...] = ("datadist", "ems", "llm_datadist")

#: (d): the layers of :data:`LAYERS` that no ``ems`` module may import.
EMS_FORBIDDEN_LAYERS: Tuple[str, ...] = ("API",)

#: Modules whose import must load no module of datadist's API layer, checked in a fresh
#: interpreter (vLLM, where it is not installed, stands in as empty modules).
LOADS_NO_API: Tuple[str, ...] = ("ems", "ems.integrations.vllm", "ems.server.store", "ems.server.daemon")
#: The API-layer module that everything under ``datadist`` loads: the package, whose
#: names load on first use (``datadist/__init__.py``).
API_PACKAGE = "datadist"

#: Size and complexity limits, for the modules of these packages.
LIMITED_PACKAGES: Tuple[str, ...] = ("datadist", "ems")
MAX_MODULE_LINES = 600
MAX_COMPLEXITY = 15

ROOT = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------------- the source model


@dataclass(frozen=True)
class Import:
    target: str  # the module reached
    line: int
    lazy: bool  # inside a function
    type_only: bool = False  # under ``if TYPE_CHECKING:``
    names: bool = False  # ``from target import name``, names the module defines (not its submodules)

    @property
    def note(self) -> str:
        return " (type-only)" if self.type_only else " (lazy)" if self.lazy else ""


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    source: Optional[str]  # None for an extension module (a .so or .pyi without .py)
    imports: List[Import] = field(default_factory=list)
    unresolved: List[Tuple[str, int]] = field(default_factory=list)  # internal names that name no module

    @property
    def package(self) -> str:
        """The package (directory) the module belongs to."""
        return self.name if self.is_package else self.name.rpartition(".")[0]

    def where(self, line: int) -> str:
        return f"{self.path.relative_to(ROOT)}:{line}"


def _module_name(path: Path) -> Tuple[str, bool]:
    rel = path.relative_to(ROOT)
    stem = rel.name.split(".", 1)[0]  # _native.cpython-311-x86_64-linux-gnu.so -> _native
    parts = list(rel.parent.parts)
    if stem == "__init__":
        return ".".join(parts), True
    return ".".join(parts + [stem]), False


def _discover() -> Dict[str, Module]:
    modules: Dict[str, Module] = {}
    for package in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(ROOT / package):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for filename in sorted(filenames):
                path = Path(dirpath) / filename
                if filename.endswith(".py"):
                    name, is_package = _module_name(path)
                    modules[name] = Module(name, path, is_package, path.read_text(encoding="utf-8"))
                elif filename.endswith((".pyi", ".so")):
                    name, is_package = _module_name(path)
                    modules.setdefault(name, Module(name, path, is_package, None))
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterator[Tuple[ast.stmt, bool, bool]]:
    """Every import statement with whether it is inside a function and whether it is
    type-only (in the body of an ``if TYPE_CHECKING:``; its ``else`` runs)."""
    todo: List[Tuple[ast.AST, bool, bool]] = [(tree, False, False)]
    while todo:
        node, lazy, type_only = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, lazy, type_only
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend((child, lazy, True) for child in node.body)
            todo.extend((child, lazy, type_only) for child in node.orelse)
            continue
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        todo.extend((child, inner, type_only) for child in ast.iter_child_nodes(node))


def _internal(name: str) -> bool:
    return name.split(".", 1)[0] in PACKAGES


def _resolve(modules: Dict[str, Module]) -> None:
    for module in modules.values():
        if module.source is None:
            continue
        tree = ast.parse(module.source, filename=str(module.path))
        for node, lazy, type_only in _import_nodes(tree):
            if isinstance(node, ast.Import):
                names = [(alias.name, node.lineno, False) for alias in node.names]
            else:
                assert isinstance(node, ast.ImportFrom)
                if node.level:
                    base_parts = module.package.split(".")
                    base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                names = []
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    submodule = alias.name != "*" and sub in modules
                    names.append((sub if submodule else base, node.lineno, not submodule))
            for name, line, of_names in names:
                if not _internal(name):
                    continue
                if name in modules:
                    module.imports.append(Import(name, line, lazy, type_only, of_names))
                else:
                    module.unresolved.append((name, line))


@lru_cache(maxsize=1)
def _modules() -> Dict[str, Module]:
    modules = _discover()
    _resolve(modules)
    return modules


def _edges(modules: Dict[str, Module]) -> Dict[str, Dict[str, Import]]:
    """importer -> imported -> the first import of it (for the report), every kind of
    import counted."""
    edges: Dict[str, Dict[str, Import]] = defaultdict(dict)
    for module in modules.values():
        for imp in module.imports:
            if imp.target != module.name:
                edges[module.name].setdefault(imp.target, imp)
    return edges


def _parents(name: str) -> Iterator[str]:
    """The packages Python runs before module ``name``: ``a`` and ``a.b`` for ``a.b.c``."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        yield ".".join(parts[:i])


def _loads(modules: Dict[str, Module], start: str) -> Dict[str, Tuple[str, str]]:
    """What importing ``start`` loads of the tree: every module reached through the
    imports that run at import time (module level, not type-only) and the parent packages
    of each module loaded, with how it was reached (the module that loaded it, and the
    place or the reason)."""
    reached: Dict[str, Tuple[str, str]] = {start: ("", "")}
    queue = deque([start])
    while queue:
        here = queue.popleft()
        module = modules[here]
        nexts = [(parent, "its parent package") for parent in _parents(here)]
        nexts += [(imp.target, module.where(imp.line)) for imp in module.imports if not (imp.lazy or imp.type_only)]
        for there, why in nexts:
            if there in modules and there not in reached:
                reached[there] = (here, why)
                queue.append(there)
    return reached


def _chain(reached: Dict[str, Tuple[str, str]], end: str) -> str:
    """How ``end`` came to be loaded, from the module first imported."""
    steps = []
    while reached[end][0]:
        before, why = reached[end]
        steps.append(f"    {before} loads {end} ({why})")
        end = before
    return "\n".join(reversed(steps))


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One shortest cycle through each strongly connected component of ``graph`` with more
    than one node (Tarjan, iterative), each starting at its smallest node."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    components: List[List[str]] = []
    nodes = sorted(set(graph) | {t for ts in graph.values() for t in ts})
    for root in nodes:
        if root in index:
            continue
        work: List[Tuple[str, Iterator[str]]] = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    cycles = []
    for component in sorted(components):
        members = set(component)
        start = component[0]
        parent: Dict[str, str] = {}
        queue = deque([start])
        found: Optional[str] = None
        while queue and found is None:
            here = queue.popleft()
            for child in sorted(graph.get(here, ())):
                if child not in members:
                    continue
                if child == start:
                    found = here
                    break
                if child not in parent:
                    parent[child] = here
                    queue.append(child)
        path = [start]
        step = found
        while step is not None and step != start:
            path.insert(1, step)
            step = parent.get(step)
        cycles.append(path + [start])
    return cycles


def _layer_of(name: str) -> Optional[int]:
    best: Optional[Tuple[Tuple[int, int], int]] = None
    for layer, (_title, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if fnmatch.fnmatchcase(name, pattern):
                rank = (0 if any(c in pattern for c in "*?[") else 1, len(pattern))
                if best is None or rank > best[0]:
                    best = (rank, layer)
    return None if best is None else best[1]


def _layer_indices(titles: Sequence[str]) -> Set[int]:
    return {i for i, (title, _patterns) in enumerate(LAYERS) if title in titles}


def _layered(name: str) -> bool:
    return name == "datadist" or name.startswith("datadist.") or name.split(".", 1)[0] == "llm_datadist"


def _describe(name: str) -> str:
    layer = _layer_of(name)
    return f"{name} [{'?' if layer is None else f'{layer + 1} {LAYERS[layer][0]}'}]"


# ----------------------------------------------------------------------------- the tests


def test_the_model_sees_the_packages() -> None:
    modules = _modules()
    for must in ("datadist", "datadist.engine", "datadist.engine._native", "ems.pool._keyset", "ems.server.daemon",
                 "llm_datadist"):
        assert must in modules, f"{must} not found under {ROOT}"
    assert sum(len(m.imports) for m in modules.values()) > 100


def test_the_checkers_themselves() -> None:
    """The cycle finder and the layer lookup, on known inputs (a rule that cannot fail
    proves nothing)."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "x": {"y"}, "y": {"x"}}
    assert _cycles(graph) == [["a", "b", "c", "a"], ["x", "y", "x"]]
    assert _cycles({"a": {"b"}, "b": {"c"}}) == []
    assert _layer_of("datadist.bench.plot") == 0 and _layer_of("llm_datadist.v2.llm_types") == 0
    assert _layer_of("datadist") == 1 and _layer_of("datadist._cache_manager") == 1
    assert _layer_of("datadist._planning") == 2
    assert _layer_of("datadist._status") == 3 and _layer_of("datadist._objects") == 3
    assert _layer_of("datadist.engine") == 4 and _layer_of("datadist.engine.link") == 4
    assert _layer_of("datadist.engine.transports.tcp") == 5 and _layer_of("datadist.engine.executor") == 5
    assert _layer_of("datadist.engine.wire") == 6 and _layer_of("datadist.engine._native") == 6
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
                     "def f():\n    import c\n")
    assert sorted((n.names[0].name, lazy, type_only) for n, lazy, type_only in _import_nodes(tree)
                  if isinstance(n, ast.Import)) == [("a", False, True), ("b", False, False), ("c", True, False)]
    assert list(_parents("a.b.c")) == ["a", "a.b"]
    fake = {name: Module(name, ROOT / name, is_package=name in ("p", "p.q"), source="", imports=imports)
            for name, imports in (("p", []), ("p.q", [Import("x", 1, lazy=False)]), ("p.q.r", []),
                                  ("x", [Import("y", 2, lazy=True), Import("z", 3, lazy=False, type_only=True)]),
                                  ("y", []), ("z", []))}
    reached = _loads(fake, "p.q.r")
    assert sorted(reached) == ["p", "p.q", "p.q.r", "x"]  # no lazy or type-only import followed
    assert reached["x"][0] == "p.q" and "p.q loads x" in _chain(reached, "x")
    # ``from ... import LLMDataDist`` in the vLLM worker takes names from the package, and
    # ``from ..paged import paged_layout`` a module.
    worker = {(imp.target, imp.names) for imp in _modules()["datadist.integrations.vllm.worker"].imports}
    assert ("datadist", True) in worker and ("datadist.integrations.paged", False) not in worker


def test_every_internal_import_names_a_module() -> None:
    """An import of ours that names no module is a broken import, and a blind spot of the
    rules below."""
    broken = [f"{m.where(line)}: {m.name} imports {name}" for m in _modules().values() for name, line in m.unresolved]
    assert not broken, "imports naming no module of the tree:\n" + "\n".join(broken)


def _cycle_report(cycles: List[List[str]], edges: Dict[str, Dict[str, Import]],
                  modules: Dict[str, Module]) -> str:
    lines = []
    for cycle in cycles:
        lines.append(" -> ".join(cycle))
        for a, b in zip(cycle, cycle[1:]):
            if a in modules and b in edges.get(a, {}):
                imp = edges[a][b]
                lines.append(f"    {modules[a].where(imp.line)}: {a} imports {b}{imp.note}")
    return "\n".join(lines)


def test_no_import_cycle_between_modules() -> None:
    modules = _modules()
    edges = _edges(modules)
    cycles = _cycles({a: set(bs) for a, bs in edges.items()})
    assert not cycles, "import cycles between modules:\n" + _cycle_report(cycles, edges, modules)


def test_layers_are_one_way() -> None:
    modules = _modules()
    unplaced = sorted(name for name in modules if _layered(name) and _layer_of(name) is None)
    assert not unplaced, f"modules in no layer of LAYERS: {unplaced}"
    violations = []
    for importer, targets in sorted(_edges(modules).items()):
        if not _layered(importer):
            continue
        for target, imp in sorted(targets.items()):
            if not _layered(target):
                continue
            lower, upper = _layer_of(importer), _layer_of(target)
            assert lower is not None and upper is not None
            if upper < lower:
                violations.append(f"{modules[importer].where(imp.line)}: {_describe(importer)} imports "
                                  f"{_describe(target)}{imp.note}")
    assert not violations, "imports of a higher layer:\n" + "\n".join(violations)


def test_no_import_cycle_between_packages() -> None:
    """Packages are directories.  An import of an ancestor package's module (the engine
    importing ``datadist._status``) is left to the layer rule; every other import between
    two packages makes an edge, and the edges must not close a cycle."""
    modules = _modules()
    graph: Dict[str, Set[str]] = defaultdict(set)
    witness: Dict[Tuple[str, str], str] = {}
    for importer, targets in _edges(modules).items():
        src = modules[importer].package
        for target, imp in targets.items():
            dst = modules[target].package
            if dst == src or src.startswith(dst + "."):
                continue
            graph[src].add(dst)
            witness.setdefault((src, dst), f"{modules[importer].where(imp.line)}: {importer} imports {target}")
    cycles = _cycles(graph)
    report = []
    for cycle in cycles:
        report.append(" -> ".join(cycle))
        report.extend(f"    {witness[(a, b)]}" for a, b in zip(cycle, cycle[1:]))
    assert not cycles, "import cycles between packages:\n" + "\n".join(report)


def test_ems_does_not_import_the_datadist_api() -> None:
    modules = _modules()
    forbidden = _layer_indices(EMS_FORBIDDEN_LAYERS)
    violations = []
    for importer, targets in sorted(_edges(modules).items()):
        if importer.split(".", 1)[0] != "ems":
            continue
        for target, imp in sorted(targets.items()):
            if _layered(target) and _layer_of(target) in forbidden:
                violations.append(f"{modules[importer].where(imp.line)}: {importer} imports "
                                  f"{_describe(target)}{imp.note}")
    assert not violations, "ems importing datadist's API layer (it may use datadist.engine.*):\n" + "\n".join(violations)


def _api_module(name: str) -> bool:
    """A module of datadist's API layer other than the package itself."""
    return name != API_PACKAGE and _layered(name) and _layer_of(name) in _layer_indices(("API",))


def test_ems_modules_load_no_datadist_api_module() -> None:
    """Followed through everything an import loads: an ``ems`` module reaching, say,
    ``datadist.integrations.vllm.base`` loads that package's ``__init__``, and whatever
    it imports.  Taking names from the package ``datadist`` (``from datadist import
    Cache``) loads the API-layer module that defines them."""
    modules = _modules()
    violations = []
    for name in sorted(modules):
        if name.split(".", 1)[0] != "ems" or modules[name].source is None:
            continue
        reached = _loads(modules, name)
        for api in sorted(m for m in reached if _api_module(m)):
            violations.append(f"importing {name} loads {api}:\n{_chain(reached, api)}")
        for importer in sorted(reached):
            line = next((imp.line for imp in modules[importer].imports if imp.target == API_PACKAGE and imp.names
                         and not (imp.lazy or imp.type_only)), None)
            if line is not None:
                violations.append(f"importing {name} loads datadist's API layer: {modules[importer].where(line)} "
                                  f"takes names from {API_PACKAGE}\n{_chain(reached, importer)}")
    assert not violations, "ems modules loading datadist's API layer:\n" + "\n".join(violations)


#: Run first in the interpreter of :func:`test_importing_loads_no_datadist_api_module`:
#: where vLLM is not installed, every ``vllm`` module is an empty one whose attributes are
#: classes (what the connectors import from it is names, subclassed or used in annotations).
_VLLM_STAND_IN = """
import importlib.abc, importlib.machinery, importlib.util, sys, types

class _Anything(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})

class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Anything(name, (), {})
        setattr(self, name, value)
        return value

class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "vllm":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []

if importlib.util.find_spec("vllm") is None:
    sys.meta_path.append(_Finder())
"""


@pytest.mark.parametrize("module", LOADS_NO_API)
def test_importing_loads_no_datadist_api_module(module: str) -> None:
    code = f"{_VLLM_STAND_IN}\nimport {module}\nprint('\\n'.join(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = set(proc.stdout.split())
    assert module in loaded, proc.stdout
    api = sorted(m for m in loaded if _api_module(m))
    assert not api, f"importing {module} loads datadist's API-layer modules {api}"


def _limited() -> List[Module]:
    return [m for m in _modules().values()
            if m.source is not None and m.name.split(".", 1)[0] in LIMITED_PACKAGES]


def test_modules_stay_small() -> None:
    big = sorted((len(m.source.splitlines()), m.name) for m in _limited()
                 if m.source is not None and len(m.source.splitlines()) > MAX_MODULE_LINES)
    assert not big, f"modules over {MAX_MODULE_LINES} lines: " + ", ".join(f"{n} ({lines})" for lines, n in big)


def _blocks(blocks: Sequence[object], prefix: str = "") -> Iterator[Tuple[str, object]]:
    """Every function, method and closure radon found, with a qualified name."""
    for block in blocks:
        name = f"{prefix}{getattr(block, 'name')}"
        if hasattr(block, "methods"):  # a class
            yield from _blocks(getattr(block, "methods"), name + ".")
            yield from _blocks(getattr(block, "inner_classes", []), name + ".")
        else:
            yield name, block
            yield from _blocks(getattr(block, "closures", []), name + ".")


def test_functions_stay_simple() -> None:
    complexity = pytest.importorskip("radon.complexity")
    over = []
    for module in _limited():
        assert module.source is not None
        # Top-level functions and classes only: cc_visit also lists every method on its own.
        top = [b for b in complexity.cc_visit(module.source) if not getattr(b, "is_method", False)]
        for name, block in _blocks(top):
            score = getattr(block, "complexity")
            if score > MAX_COMPLEXITY:
                over.append((score, f"{module.where(getattr(block, 'lineno'))}: {module.name}.{name}"))
    over.sort(reverse=True)
    assert not over, (f"functions over cyclomatic complexity {MAX_COMPLEXITY}:\n"
                      + "\n".join(f"    {score:3d}  {where}" for score, where in over))
