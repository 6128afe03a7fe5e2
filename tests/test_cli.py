"""The ``fsdp-precision`` command line, run as users run it (subprocesses)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "fsdp_precision"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*args], capture_output=True, text=True, timeout=timeout, env=ENV, check=False
    )


@pytest.mark.parametrize("args", [["--help"], ["demo", "--help"]])
def test_help(args: list[str]) -> None:
    out = run(*CLI, *args)
    assert out.returncode == 0 and "usage: fsdp-precision" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "0"], "--nproc must be an integer >= 1, got 0"),
        (["--dim", "30"], "--dim must be a multiple of 4 (4 attention heads), got 30"),
    ],
)
def test_bad_options_are_one_line_errors(args: list[str], message: str) -> None:
    out = run(*CLI, "demo", *args)
    assert out.returncode == 2
    assert out.stderr.strip() == f"fsdp-precision: error: {message}"


def _check_demo_output(stdout: str) -> None:
    assert "blocks.0   bfloat16 49,536, float32 256" in stdout
    assert "5 all-gathers, 3 reduce-scatters" in stdout
    assert (
        "bitwise identical to the fp32-child-unit reference over 1 steps on all 2 ranks" in stdout
    )


@pytest.mark.distributed
def test_demo_spawns_its_own_processes() -> None:
    out = run(*CLI, "demo", "--steps", "1")
    assert out.returncode == 0, out.stderr
    _check_demo_output(out.stdout)


@pytest.mark.distributed
def test_demo_under_torchrun() -> None:
    out = run(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--standalone",
        "-m",
        "fsdp_precision",
        "demo",
        "--steps",
        "1",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    _check_demo_output(out.stdout)
