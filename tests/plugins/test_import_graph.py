"""Our import graph: no cycles, and the layering the design asks for.

Every `import` of our modules counts: those inside functions (a lazy import is still a
dependency) and those under `if TYPE_CHECKING:` (a type named in a signature is one too).
"""
import ast
from pathlib import Path

ROOT = Path(__file__).parents[2]
# repository folder -> the package it installs as
FOLDERS = {"runtime": "runtime", "plugins": "runtime.plugins", "platforms": "runtime.platforms",
           "attention_backends": "runtime.attention_backends",
           "quantization": "runtime.quantization"}
# user-facing front ends, which may use each other (`runtime bench` reuses the CLI's flags)
FRONT_ENDS = ("runtime.cli", "runtime.bench")


def _modules() -> dict[str, Path]:
    modules = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if "__pycache__" in parts or (folder == "runtime" and parts[0] in FOLDERS):
                continue
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Our modules that `path` imports. `from pkg import sub` depends on the submodule only."""
    found = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                subs = {f"{child.module}.{a.name}" for a in child.names} & MODULES.keys()
                found.update(subs)
                if len(subs) < len(child.names):
                    found.add(child.module)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found & MODULES.keys()


def _graph(level: int | None = None) -> dict[str, set[str]]:
    """module -> the modules it imports; with `level`, grouped into packages of that depth."""
    group = (lambda m: m) if level is None else (lambda m: ".".join(m.split(".")[:level]))
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        for target in _imports(path):
            a, b = group(module), group(target)
            if a != b:
                graph.setdefault(a, set()).add(b)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return cycles


def _show(graph: dict[str, set[str]], cycles: list[list[str]]) -> str:
    return "\n".join(f"{a} -> {sorted(graph.get(a, set()) & set(c))}" for c in cycles for a in c)


def test_no_module_imports_itself_through_others():
    graph = _graph()
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + _show(graph, cycles)


def test_no_package_cycles_in_the_engine():
    engine = {a: {b for b in bs if not b.startswith(FRONT_ENDS)}
              for a, bs in _graph(level=2).items() if not a.startswith(FRONT_ENDS)}
    cycles = _cycles(engine)
    assert not cycles, "package cycles:\n" + _show(engine, cycles)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_platforms_import_only_the_contract_backends_and_quantization():
    allowed = ("runtime.plugins", "runtime.platforms", "runtime.attention_backends",
               "runtime.quantization")
    wrong = {m: sorted(t for t in _imports(p) if not t.startswith(allowed))
             for m, p in MODULES.items() if m.startswith("runtime.platforms")}
    assert not {m: t for m, t in wrong.items() if t}, wrong


def test_the_contract_imports_nothing_of_the_engine():
    wrong = {m: sorted(t for t in _imports(p) if not t.startswith(
                 ("runtime.plugins", "runtime.attention_backends")))
             for m, p in MODULES.items() if m.startswith("runtime.plugins")}
    assert not {m: t for m, t in wrong.items() if t}, wrong


def test_the_config_sits_at_the_bottom():
    """The engine's config and the model's facts import only each other and the contract."""
    allowed = ("runtime.config", "runtime.model_config", "runtime.plugins",
               "runtime.attention_backends.base")
    wrong = {m: sorted(t for t in _imports(p) if not t.startswith(allowed))
             for m, p in MODULES.items()
             if m.startswith(("runtime.config", "runtime.model_config"))}
    assert not {m: t for m, t in wrong.items() if t}, wrong
