"""The package seams: the client library imports nothing of the broker's server side and
nothing of the harness; the broker's serving path loads neither; no hand-written module of
either package grows past 600 lines."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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
    "broker.presets",
    "broker.logs",
    "broker.tracing",
    "broker.client_security",
}
MAX_LINES = 600


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (``from broker import tracing`` counts as
    ``broker.tracing``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_the_client_library_imports_only_the_shared_layer_of_the_broker() -> None:
    wrong = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in modules("clients")
        for name in imports(path)
        if name.split(".")[0] == "harness"
        or (name.split(".")[0] == "broker" and name not in SHARED and _is_module(name))
    }
    assert not wrong, sorted(wrong)


def _is_module(name: str) -> bool:
    """Whether ``name`` is a module of ``broker`` (not a name imported from one)."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or path.is_dir()


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


def test_no_module_of_the_client_library_or_the_harness_exceeds_600_lines() -> None:
    long = {
        f"{path.relative_to(ROOT)}: {n}"
        for package in ("clients", "harness")
        for path in modules(package)
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, sorted(long)
