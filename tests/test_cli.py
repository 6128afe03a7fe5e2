"""The ``fsdp-precision`` command line, run as users run it (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "fsdp_precision"]
TESTS = str(Path(__file__).parent)
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])),
}


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


def test_plan_json_for_a_hub_architecture_on_meta() -> None:
    pytest.importorskip("transformers")
    out = run(*CLI, "plan", "hf:deepseek_v3", "--world-size", "64", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    assert data["model"] == "DeepseekV3ForCausalLM"
    moe = next(u for u in data["units"] if u["name"] == "model.layers.3")
    assert moe["policy"]["param_dtype_map"] == {"mlp.gate.weight": "float32"}
    assert data["memory_per_rank_bytes"]["adamw_state"] > 0
    assert data["alternatives"]["separate_fp32_units"]["units"] == data["totals"]["units"] + 58


def test_plan_table_for_module_callable_with_keep_rules() -> None:
    out = run(
        *CLI,
        "plan",
        "_models:Net",
        "--min-params",
        "900",
        "--keep",
        "*norm.weight",
        "--keep",
        "*gate.weight=fp16",
        "--world-size",
        "2",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "blocks.0.gate.weight" in out.stdout and "-> float16" in out.stdout
    assert "memory per rank at world size 2" in out.stdout


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("hf:no_such_arch", "transformers knows no model_type 'no_such_arch'"),
        ("nonsense", "is not hf:<model_type>, a directory with config.json, or module:callable"),
        ("_models:Nope", "cannot import Nope from _models"),
    ],
)
def test_plan_bad_model_is_one_line(model: str, message: str) -> None:
    if model.startswith("hf:"):
        try:
            import transformers  # noqa: F401
        except ImportError:
            message = "needs Hugging Face transformers, which is not installed"
    out = run(*CLI, "plan", model)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("fsdp-precision: error: ") and message in lines[-1]
