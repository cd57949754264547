#!/usr/bin/env python3
"""Plant known bugs one at a time and run the deterministic tests that must catch each.

Each mutation is applied to a scratch copy of the checkout (the checkout itself is never
touched) and the named test files run there under ``CI=true``; a mutation the tests do not
fail "survived". The unmutated copy runs first: its tests must pass, or no verdict means
anything. Exit status 0 when every mutation was caught.

    . .venv/bin/activate && python scripts/mutation_check.py [NAME ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation(
        "raised limit",
        "broker/limits.py",
        "max_tp_size: int = 128",
        "max_tp_size: int = 1280",
        ("tests/test_limits.py",),
    ),
    Mutation(
        "no region check in the decode client",
        "clients/plan_check.py",
        "            if not index.covers(rows, kind):",
        "            if False:",
        ("tests/test_decode_checks.py",),
    ),
    Mutation(
        "no byte-total check in the decode client",
        "clients/plan_check.py",
        "if nbytes != plan.total_bytes:",
        "if False:",
        ("tests/test_decode_checks.py",),
    ),
    Mutation(
        "byte checker always reports 0 mismatches",
        "harness/pattern.py",
        "return mismatches, expected_state",
        "return 0, expected_state",
        ("tests/test_pattern.py",),
    ),
    Mutation(
        "oldest Mamba snapshot instead of the newest",
        "broker/planner.py",
        "p_sel, d_sel, pages = p_ids[len(p_ids) - n :], d_ids[:n], n",
        "p_sel, d_sel, pages = p_ids[:n], d_ids[:n], n",
        ("tests/test_planner.py", "tests/test_e2e.py"),
    ),
    Mutation(
        "failed reads reported DONE",
        "clients/decode.py",
        "status=pb.REPORT_STATUS_FAILED if error else pb.REPORT_STATUS_DONE,",
        "status=pb.REPORT_STATUS_DONE,",
        ("tests/test_decode_checks.py",),
    ),
    Mutation(
        "late DONE counted intact",
        "broker/transfers.py",
        "intact=event.status is ReportStatus.DONE and not ended,",
        "intact=event.status is ReportStatus.DONE,",
        ("tests/test_transfers.py", "tests/test_service.py"),
    ),
    Mutation(
        "sources released while a live plan reads them",
        "broker/transfers.py",
        "live = [self.read_deadline(plan) for plan in plans if plan.live]",
        "live = []",
        ("tests/test_transfers.py", "tests/test_service.py"),
    ),
    Mutation(
        "a unit of work that raises is kept in memory",
        "broker/store/memory.py",
        "            journal.undo()",
        "            pass",
        ("tests/test_store_contract.py",),
    ),
    Mutation(
        "transfer ids not scoped by their publisher",
        "broker/service.py",
        "if store.get_transfer((pub.engine_id, pub.transfer_id)) is not None:",
        "if store.transfers_named(pub.transfer_id):",
        ("tests/test_service.py",),
    ),
    Mutation(
        "a streamed plan loses its last message",
        "broker/convert.py",
        "for start in range(per_chunk, s.num_descriptors, per_chunk):",
        "for start in range(per_chunk, s.num_descriptors - per_chunk, per_chunk):",
        ("tests/test_plan_stream.py",),
    ),
)


def scratch_copy(into: Path) -> Path:
    """The checkout's tracked and untracked-not-ignored files, under ``into``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    tree = into / "tree"
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            target = tree / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return tree


def run_tests(tree: Path, tests: tuple[str, ...]) -> tuple[int, float]:
    env = {**os.environ, "CI": "true", "PYTHONPATH": str(tree)}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    return done.returncode, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="run only mutations whose name contains one")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.names or any(n in m.name for n in args.names)]
    survived = 0
    with tempfile.TemporaryDirectory(prefix="pdbroker-mutations-") as scratch:
        tree = scratch_copy(Path(scratch))
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        rc, seconds = run_tests(tree, tests)
        print(f"unmutated: {'pass' if rc == 0 else f'FAIL (exit {rc})'} ({seconds:.0f} s)")
        if rc != 0:
            return 2
        for m in chosen:
            path = tree / m.path
            original = path.read_text()
            if original.count(m.old) != 1:
                print(f"{m.name}: the text to mutate is not in {m.path} exactly once")
                return 2
            path.write_text(original.replace(m.old, m.new))
            rc, seconds = run_tests(tree, m.tests)
            path.write_text(original)
            caught = rc == 1  # tests failed; other codes are usage or collection errors
            survived += not caught
            verdict = "caught" if caught else f"SURVIVED (pytest exit {rc})"
            print(f"{m.name}: {verdict} by {' '.join(m.tests)} ({seconds:.0f} s)")
    print(f"{len(chosen) - survived} of {len(chosen)} mutations caught")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
