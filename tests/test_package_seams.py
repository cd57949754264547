"""The package seams, read from the source (imports as the AST has them):

* the client library imports nothing of the broker's server side and nothing of the harness;
* the broker imports none of torch, nixl, vLLM, the client library or the harness, except
  lazily (inside a function, or for type checking only) in the commands that run the harness;
* the planner depends on the layout layer alone (layouts, errors, limits);
* no import cycle runs through the three packages;
* no hand-written module grows past 600 lines;
* and, run for real, the broker's serving path loads neither the client library nor the
  harness.

An import is *eager* when it runs as its module is imported: not inside a function, and not
under ``if TYPE_CHECKING:``. Every failure names the file, the line and the import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("broker", "clients", "harness")
#: Generated code (``scripts/gen_protos.sh``), outside the line limit.
GENERATED = ROOT / "broker" / "v1"
#: What the client library may import of ``broker``.
SHARED = {
    "broker",
    "broker.v1",
    "broker.v1.broker_pb2",
    "broker.v1.broker_pb2_grpc",
    "broker.wire",
    "broker.layout",
    "broker.errors",
    "broker.limits",
    "broker.models",
    "broker.row_models",
    "broker.presets",
    "broker.logs",
    "broker.tracing",
    "broker.client_security",
}
#: What the broker never imports eagerly (top-level packages).
NOT_IN_BROKER = {"torch", "nixl", "vllm", "clients", "harness"}
#: Broker commands that run the harness: they may import :data:`NOT_IN_BROKER` lazily.
HARNESS_COMMANDS = {
    f"broker.commands.{name}"
    for name in ("demo", "soak", "bench", "bench_control_plane", "bench_scale", "plan")
}
#: The planner, and the only modules of ``broker`` it may import besides its own.
PLANNER = {"broker.planner", "broker.plan_templates", "broker.compatibility"}
LAYOUT_LAYER = {"broker.layout", "broker.errors", "broker.limits"}
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


#: Every module of the three packages, by dotted name.
OURS = {module_name(path): path for package in PACKAGES for path in modules(package)}


@dataclass(frozen=True)
class Import:
    """``module`` imported by ``path`` at ``line``; ``where`` is ``module level``,
    ``in a function`` or ``type checking`` (an ``if TYPE_CHECKING:`` block)."""

    path: Path
    line: int
    module: str
    where: str

    @property
    def eager(self) -> bool:
        return self.where == "module level"

    @property
    def top(self) -> str:
        return self.module.split(".")[0]

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.module} ({self.where})"


def imports(path: Path) -> list[Import]:
    """Every import of ``path``, at any depth. ``from a import b`` imports ``a.b`` when that
    is a module of ours, else ``a``; relative imports are resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(path, node.lineno, a.name, where) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.append(Import(path, node.lineno, target if target in OURS else base, where))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for child in ast.iter_child_nodes(node):
                visit(child, "in a function")
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, "type checking" if where == "module level" else where)
            for child in node.orelse:
                visit(child, where)
        else:
            for child in ast.iter_child_nodes(node):
                visit(child, where)

    visit(ast.parse(path.read_text()), "module level")
    return list(dict.fromkeys(found))  # once per line: ``from a import b, c``


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def all_imports(package: str) -> Iterator[Import]:
    for path in modules(package):
        yield from imports(path)


def test_the_client_library_imports_only_the_shared_layer_of_the_broker() -> None:
    wrong = [
        str(i)
        for i in all_imports("clients")
        if i.top == "harness" or (i.top == "broker" and i.module not in SHARED)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_broker_imports_no_engine_library_client_or_harness_eagerly() -> None:
    """Only the commands that run the harness import those, and only lazily."""
    wrong = [
        str(i)
        for i in all_imports("broker")
        if i.top in NOT_IN_BROKER and (i.eager or module_name(i.path) not in HARNESS_COMMANDS)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_planner_imports_only_the_layout_layer() -> None:
    wrong = [
        str(i)
        for name in sorted(PLANNER)
        for i in imports(OURS[name])
        if i.top == "broker" and i.module not in LAYOUT_LAYER | PLANNER
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_among_the_packages() -> None:
    """Strongly connected components of the graph of eager imports between our modules."""
    edges = {
        name: [i for i in imports(path) if i.eager and i.module in OURS]
        for name, path in OURS.items()
    }
    graph = {name: [i.module for i in found] for name, found in edges.items()}
    cycles = [
        " -> ".join(map(str, shortest_cycle(min(component), edges, component)))
        for component in strongly_connected(graph)
        # a component of one module is a cycle only if the module imports itself
        if len(component) > 1 or any(i.module in component for i in edges[min(component)])
    ]
    assert not cycles, "import cycles (one each):\n" + "\n".join(cycles)


def shortest_cycle(start: str, edges: dict[str, list[Import]], component: set[str]) -> list[Import]:
    """The shortest chain of imports from ``start`` back to it within ``component`` (breadth
    first)."""
    reached_by: dict[str, Import | None] = {start: None}
    queue = deque([start])
    while queue:
        for i in edges[queue.popleft()]:
            if i.module == start:
                chain = [i]
                while (step := reached_by[module_name(chain[0].path)]) is not None:
                    chain.insert(0, step)
                return chain
            if i.module in component and i.module not in reached_by:
                reached_by[i.module] = i
                queue.append(i.module)
    raise AssertionError(f"{start} is on no cycle")


def strongly_connected(graph: dict[str, list[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of ``graph`` (node -> successors)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph[node]:
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


def test_strongly_connected_finds_cycles_and_only_them() -> None:
    graph = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": ["d"], "e": ["a"]}
    assert sorted(map(sorted, strongly_connected(graph))) == [["a", "b", "c"], ["d"], ["e"]]


def test_no_hand_written_module_exceeds_600_lines() -> None:
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for path in OURS.values()
        if not path.is_relative_to(GENERATED)
        and (n := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, "\n".join(long)


def test_serving_loads_neither_the_client_library_nor_the_harness() -> None:
    probe = (
        "import sys, broker.cli, broker.commands.serve, broker.server\n"
        "broker.cli.build_parser()\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'clients', 'harness', "
        "'torch', 'nixl', 'vllm'}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"
