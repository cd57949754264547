"""What long commands print on stderr: the progress line, and which library logs get through."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

from prerequisites import require_module

from broker.console import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_plain_stream_gets_every_phase_and_updates_now_and_then() -> None:
    out = io.StringIO()
    with Progress("pdbroker soak", out, interval_s=60) as progress:
        progress.phase("starting")
        progress.update("load 1/5 s")  # within the interval of the phase: dropped
        progress.phase("draining")
        progress.interval_s = 0
        progress.update("load 5/5 s")
    assert out.getvalue() == (
        "pdbroker soak [0 s] starting\n"
        "pdbroker soak [0 s] draining\n"
        "pdbroker soak [0 s] load 5/5 s\n"
    )


def test_a_terminal_gets_one_line_rewritten_and_cleared_at_the_end() -> None:
    out = Terminal()
    with Progress("pdbroker bench bytes", out, interval_s=60) as progress:
        progress.phase("model 1/3: " + "x" * 200)
        progress.update("model 1/3: half")
        progress.close()  # before the result is printed
        text = out.getvalue()
    assert text == (
        "\r\x1b[K"
        + ("pdbroker bench bytes [0 s] model 1/3: " + "x" * 200)[:79]
        + "\r\x1b[Kpdbroker bench bytes [0 s] model 1/3: half"
        + "\r\x1b[K"
    )
    assert out.getvalue() == text  # closed once: leaving the block writes nothing more
    assert "\n" not in text


def test_the_seconds_since_the_start_lead_each_line() -> None:
    out = io.StringIO()
    progress = Progress("pdbroker bench transfer", out)
    progress.started -= 12.4
    progress.phase("reads")
    assert out.getvalue() == "pdbroker bench transfer [12 s] reads\n"


LIBRARY_NOISE = """
import logging, os, sys, warnings
from broker.console import quiet_libraries
quiet_libraries(verbose=sys.argv[1] == "verbose")
logging.getLogger("vllm.platforms.cpu").warning("vllm warning")
logging.getLogger("vllm.config").info("vllm info")
logging.getLogger("vllm.engine").error("vllm error")
logging.getLogger("transformers.configuration_utils").warning("transformers warning")
logging.getLogger("clients.decode").warning("our warning")
warnings.warn_explicit("torch user warning", UserWarning, "torch/cuda/__init__.py", 1,
                       module="torch.cuda")
warnings.warn_explicit("our user warning", UserWarning, "harness/soak.py", 1,
                       module="harness.soak")
print(os.environ.get("TORCH_LOGS"), os.environ.get("VLLM_LOGGING_LEVEL"))
"""


#: What :func:`quiet_libraries` sets unless already set (an earlier test may have).
QUIETED_BY_ENVIRONMENT = ("TORCH_LOGS", "VLLM_LOGGING_LEVEL", "TRANSFORMERS_VERBOSITY")


def unquieted_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in QUIETED_BY_ENVIRONMENT}


def library_noise(mode: str) -> tuple[str, str]:
    proc = subprocess.run(
        [sys.executable, "-c", LIBRARY_NOISE, mode],
        capture_output=True,
        text=True,
        check=True,
        env=unquieted_environment(),
    )
    return proc.stdout, proc.stderr


def test_quiet_libraries_drops_their_logs_and_warnings_but_not_errors_or_ours() -> None:
    out, err = library_noise("quiet")
    assert out.split() == ["-all", "ERROR"]  # what processes started later inherit
    assert "vllm error" in err and "our warning" in err and "our user warning" in err
    for noise in ("vllm warning", "vllm info", "transformers warning", "torch user warning"):
        assert noise not in err


def test_verbose_shows_the_libraries_down_to_info() -> None:
    out, err = library_noise("verbose")
    assert out.split() == ["None", "None"]
    for line in ("vllm warning", "vllm info", "vllm error", "transformers warning"):
        assert line in err
    assert "torch user warning" in err and "our warning" in err


def bench(*argv: str, timeout: float = 300) -> tuple[dict, list[str]]:
    """``pdbroker bench ARGV --json`` as a process: its stdout parsed, its stderr lines."""
    proc = subprocess.run(
        [sys.executable, "-m", "broker.cli", "bench", *argv, "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        env=unquieted_environment(),
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr.splitlines()


def test_bench_progress_goes_to_stderr_and_json_alone_to_stdout() -> None:
    result, err = bench("descriptors", "--tokens", "1024")
    assert len(result["descriptors"]) == 8
    assert [line.split("] ", 1)[1] for line in err] == [
        "pair 1/4: nemotron-3-nano tp2->tp2",
        "pair 2/4: nemotron-3-nano tp1->tp2",
        "pair 3/4: qwen3.5-27b tp1->tp8",
        "pair 4/4: qwen3.5-27b tp4->tp4",
    ]
    assert all(line.startswith("pdbroker bench descriptors [") for line in err)


def test_bench_planner_prints_no_vllm_or_torch_logs_without_verbose() -> None:
    """Importing vLLM and torch and building vLLM's connector log dozens of lines at INFO and
    WARNING; without ``-v`` stderr holds the progress alone."""
    require_module("vllm", "vllm")
    result, err = bench(
        "planner",
        "--iterations",
        "3",
        "--trials",
        "1",
        "--scenario",
        "nemotron-3-nano 32k tp2->tp2",
    )
    assert result["planner"][0]["vllm_warm_median_us"] > 0
    assert err and all(line.startswith("pdbroker bench planner [") for line in err), err
    assert "importing vLLM" in err[0]
