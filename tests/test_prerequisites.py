"""A missing prerequisite skips its tests only where that is honest: never under CI, never for
a package that is installed but broken (:mod:`prerequisites`)."""

from __future__ import annotations

import sys

import pytest
from prerequisites import require_binary, require_module

SKIPPED, FAILED = pytest.skip.Exception, pytest.fail.Exception


@pytest.fixture
def outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)


@pytest.fixture
def under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")


@pytest.mark.usefixtures("outside_ci")
def test_a_missing_package_skips_naming_it_and_its_extra() -> None:
    with pytest.raises(SKIPPED, match=r"^pdbroker_absent is not installed .*'\.\[engine\]'"):
        require_module("pdbroker_absent", "engine")


@pytest.mark.usefixtures("under_ci")
def test_a_missing_package_fails_under_ci() -> None:
    with pytest.raises(FAILED, match=r"^pdbroker_absent is not installed"):
        require_module("pdbroker_absent", "engine")


@pytest.mark.usefixtures("outside_ci")
def test_an_installed_package_that_does_not_import_fails_everywhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As a nixl wheel whose native libraries do not load: its distribution is there, the
    import raises ImportError."""
    monkeypatch.setitem(sys.modules, "grpc", None)  # `import grpc` now raises ImportError
    with pytest.raises(FAILED, match=r"^grpc is installed but does not import"):
        require_module("grpc", "engine", distribution="grpcio")
    monkeypatch.setitem(sys.modules, "harness.vllm.cpu_engine", None)
    with pytest.raises(FAILED, match=r"^harness\.vllm\.cpu_engine is installed but"):
        require_module("harness.vllm.cpu_engine", "vllm", distribution="grpcio")


def test_an_importable_package_is_returned() -> None:
    assert require_module("numpy", "engine").__name__ == "numpy"


@pytest.mark.usefixtures("outside_ci")
def test_a_missing_program_skips_outside_ci() -> None:
    with pytest.raises(SKIPPED, match="^pdbroker-absent is not installed: apt-get it"):
        require_binary("pdbroker-absent", "apt-get it")


@pytest.mark.usefixtures("under_ci")
def test_a_missing_program_fails_under_ci() -> None:
    with pytest.raises(FAILED, match="^pdbroker-absent is not installed"):
        require_binary("pdbroker-absent", "apt-get it")
    assert require_binary("sh", "-").endswith("/sh")
