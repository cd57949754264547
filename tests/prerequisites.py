"""What a test needs from the machine, and what happens when it is missing.

A missing prerequisite skips the test with a reason that names it and how to get it (``-ra``
prints every reason in the summary), except where it cannot be missing honestly:

- under CI (``CI=true``), where ``.ci/run`` installs everything the suite uses, so a skip
  would count a layer of the suite that never ran as passed;
- for a Python package whose distribution is installed but does not import (a broken
  install, such as a ``nixl`` wheel whose native libraries do not load).

Those are failures, with the same message.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import shutil
from types import ModuleType
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI") == "true"


def unavailable(reason: str, *, broken: bool = False) -> NoReturn:
    """Skip the calling test (or module, at import time) because of ``reason``; fail instead
    under CI or when ``broken``. Never returns."""
    if broken or in_ci():
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def require_module(name: str, extra: str, distribution: str | None = None) -> ModuleType:
    """Import and return ``name``, which needs the extra ``extra`` (the distribution
    ``distribution``, by default the one named as ``name``'s top-level package), or skip or
    fail."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if _installed(distribution or name.split(".")[0]):
            unavailable(
                f"{name} is installed but does not import ({exc}); reinstall it with "
                f"pip install -e '.[{extra}]'",
                broken=True,
            )
        unavailable(
            f"{name} is not installed ({exc}); pip install -e '.[{extra}]' "
            "(bash scripts/test.sh installs every extra)"
        )


def require_binary(name: str, how: str) -> str:
    """The path of the program ``name``, or skip or fail saying ``how`` to get it."""
    path = shutil.which(name)
    if path is None:
        unavailable(f"{name} is not installed: {how}")
    return path
