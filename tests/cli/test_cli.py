"""The ``fsdp-precision`` command line, run as users run it (subprocesses)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_precision._base.quiet import IMPORT_NOISE

from tests.support import ROOT
from tests.support.hf_models import requires_transformers_5

CLI = [sys.executable, "-m", "fsdp_precision"]
TESTS = str(ROOT)  # subprocesses import tests.support
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])),
}


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*args], capture_output=True, text=True, timeout=timeout, env=ENV, check=False
    )


def noise(stderr: str) -> list[str]:
    """The lines of ``stderr`` that the import of an optional package logs for its own
    developers (torchao's CUDA kernels, torch's pytree deprecation, ...)."""
    return [s for s in stderr.splitlines() if any(p.search(s) for p in IMPORT_NOISE.values())]


@pytest.mark.parametrize("args", [["--help"], ["demo", "--help"]])
def test_help(args: list[str]) -> None:
    out = run(*CLI, *args)
    assert out.returncode == 0 and "usage: fsdp-precision" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "0"], "--nproc must be an integer >= 1, got 0"),
        (["--steps", "1"], "--steps must be an integer >= 2, got 1"),
        (["--resume-nproc", "0"], "--resume-nproc must be an integer >= 1, got 0"),
        (["--dim", "30"], "--dim must be a multiple of 4 (4 attention heads), got 30"),
        (["--model", "gpt2"], "--model 'gpt2' is not one of auto, builtin, hf:deepseek_v3"),
        (["--keep", "*norm.weight=int8"], "--keep '*norm.weight=int8': dtype 'int8' is not one"),
        (
            ["--model", "builtin", "--keep", "nothing.here"],
            "precision rule glob 'nothing.here' -> float32 matches no parameter of TinyDecoder",
        ),
        (["--output-dir", __file__], "exists and is not a directory"),
    ],
)
def test_bad_demo_options_are_one_line_errors(args: list[str], message: str, capsys) -> None:
    # In process: every one of these is refused before a process is started.
    from fsdp_precision._cli import main

    assert main(["demo", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fsdp-precision: error: "), lines
    assert message in lines[0]


def _check_builtin_demo(stdout: str) -> None:
    # Per unit, the dtypes observed on the gathered parameters (FSDP hooks, not the plan).
    assert "blocks.0   bfloat16 49,536, float32 256" in stdout
    assert "<root>     bfloat16 32,768, float32 64" in stdout
    assert (
        "5 all-gathers + 3 reduce-scatters per forward+backward (separate fp32 units: 19 + 10)"
        in stdout
    )
    assert "parity      vs separate fp32 units: bitwise identical" in stdout
    assert "resumed     on 1 process: bitwise identical to the uninterrupted run" in stdout


@pytest.mark.distributed
def test_demo_trains_checkpoints_and_resumes_bitwise(tmp_path: Path) -> None:
    out = run(*CLI, "demo", "--model", "builtin", "--steps", "2", "--output-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    _check_builtin_demo(out.stdout)
    assert "checkpoint  sharded, step 1, " in out.stdout and f"kept in {tmp_path}" in out.stdout
    from fsdp_precision.checkpoint import read_checkpoint_metadata

    meta = read_checkpoint_metadata(tmp_path / "checkpoint")
    assert (meta["step"], meta["world_size"], meta["state_dict_type"]) == (1, 2, "sharded")
    resume = json.loads((tmp_path / "resume.json").read_text())
    assert resume["world_size"] == 1 and resume["differ"] == []
    assert resume["losses"] == resume["expected_losses"] and len(resume["losses"]) == 1


@pytest.mark.distributed
def test_demo_default_model_is_deepseek_v3_with_its_router_in_fp32() -> None:
    pytest.importorskip("transformers")
    out = run(*CLI, "demo", "--steps", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert noise(out.stderr) == []  # every rank builds the model quietly (issue 48)
    assert "model: DeepseekV3ForCausalLM (transformers" in out.stdout
    assert "model.layers.1 bfloat16 44,736, float32 256" in out.stdout  # the router, gathered fp32
    assert "model.layers.0 bfloat16 38,592 " in out.stdout  # the dense layer has no router
    assert (
        "7 all-gathers + 4 reduce-scatters per forward+backward (separate fp32 units: 11 + 6)"
        in out.stdout
    )
    assert "parity      vs separate fp32 units: bitwise identical" in out.stdout
    assert "resumed     on 1 process: bitwise identical to the uninterrupted run" in out.stdout
    assert "removed (keep it with --output-dir DIR)" in out.stdout


@pytest.mark.distributed
def test_demo_under_torchrun_resumes_on_spawned_processes() -> None:
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
        "--model",
        "builtin",
        "--steps",
        "2",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    _check_builtin_demo(out.stdout)


@pytest.mark.distributed
def test_demo_names_a_kept_module_that_does_not_cast_its_inputs() -> None:
    # The negative control of the demo's own checks: a rule the model cannot honour fails
    # loudly, with the reason, instead of training with promoted activations.
    # A kept matrix returns its outputs in fp32 under boundary="auto"; the next bf16 matmul
    # refuses them, and the note names the module and the fix.
    out = run(*CLI, "demo", "--model", "builtin", "--keep", "*qkv.weight", "--steps", "2")
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert lines[-2].startswith("fsdp-precision: demo failed: RuntimeError: expected m1 and m2")
    assert lines[-1].startswith("fsdp-precision: this dtype mismatch in the Block came after")
    assert "'qkv' (Linear) returned float32 for bfloat16 inputs" in lines[-1]
    assert "boundary='inputs_outputs'" in lines[-1]


def _resume_result(*, nproc: int, resume_nproc: int, losses, expected, differ):
    from fsdp_precision._cli.demo.results import ResumeResult

    return ResumeResult(
        world_size=resume_nproc, checkpoint_step=2, checkpoint_world_size=nproc,
        checkpoint_files=3, checkpoint_bytes=2048, losses=losses, expected_losses=expected,
        parameters=3, differ=differ, max_abs_diff=0.01 if differ else 0.0, seconds=1.0,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("nproc", "resume_nproc", "losses", "differ", "ok"),
    [
        (2, 1, [3.0, 2.0], [], True),  # bitwise
        (2, 1, [3.0, 2.0], ["w"], False),  # one parameter differs where bitwise is expected
        (2, 1, [3.0, 2.0000001], [], False),  # a loss differs where bitwise is expected
        (3, 2, [3.0, 2.0000001], ["w"], True),  # 3 and 2 ranks sum in another order: tolerance
        (3, 2, [3.0, 2.1], ["w"], False),  # beyond the tolerance
    ],
)
def test_demo_resume_verdict(nproc, resume_nproc, losses, differ, ok):
    result = _resume_result(
        nproc=nproc, resume_nproc=resume_nproc, losses=losses, expected=[3.0, 2.0], differ=differ
    )
    assert result.ok is ok
    assert result.bitwise_expected == ({nproc, resume_nproc} <= {1, 2})


@requires_transformers_5
def test_plan_json_for_a_hub_architecture_on_meta() -> None:
    pytest.importorskip("transformers")
    out = run(*CLI, "plan", "hf:deepseek_v3", "--world-size", "64", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr == ""  # not a line of the packages' import noise (issue 48)
    data = json.loads(out.stdout)
    assert data["model"] == "DeepseekV3ForCausalLM"
    moe = next(u for u in data["units"] if u["name"] == "model.layers.3")
    assert moe["policy"]["param_dtype_map"] == {"mlp.gate.weight": "float32"}
    assert data["memory_per_rank_bytes"]["adamw_state"] > 0
    assert data["alternatives"]["separate_units"]["units"] == data["totals"]["units"] + 58


@requires_transformers_5
def test_plan_advises_qwen3_moe_router_gates_and_applies_them() -> None:
    pytest.importorskip("transformers")
    out = run(*CLI, "plan", "hf:qwen3_moe", "--no-trace")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    at = lines.index("precision advice (traced a forward on Qwen3MoeForCausalLM.dummy_inputs):")
    assert lines[at + 1].split() == ["router", "24", "params", 'Glob("*.mlp.gate.weight")']
    assert (
        lines[at + 2]
        .strip()
        .startswith(
            "model.layers.0.mlp.gate.weight: linear -> softmax -> topk in model.layers.0.mlp.gate "
            "(Qwen3MoeTopKRouter): its scores pick the experts"
        )
    )
    applied = run(*CLI, "plan", "hf:qwen3_moe", "--no-trace", "--advice", "apply", "--json")
    assert applied.returncode == 0, applied.stderr[-2000:]
    data = json.loads(applied.stdout)
    assert data["rule_claims"]["advice (router) '*.mlp.gate.weight'"] == 24
    layer = next(u for u in data["units"] if u["name"] == "model.layers.0")
    assert layer["policy"]["param_dtype_map"] == {"mlp.gate.weight": "float32"}
    assert data["advice"]["advice"][0]["kind"] == "norm"  # what is left computing in bf16
    bad = run(*CLI, "plan", "hf:qwen3_moe", "--advice", "always")
    assert bad.returncode == 2 and "invalid choice: 'always'" in bad.stderr


def test_plan_table_for_module_callable_with_keep_rules() -> None:
    out = run(
        *CLI,
        "plan",
        "tests.support.models:Net",
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
        ("tests.support.models:Nope", "cannot import Nope from tests.support.models"),
        ("math:pi", "math.pi is a float, not a callable; pass module:factory"),
        ("{bad_config}", "its config.json cannot be read (It looks like the config file"),
        (
            "{refused_config}",  # the config class's validator refuses the value (issue 48)
            "transformers refuses its config.json (ValueError: The hidden size (-5) is not a "
            "multiple of the number of attention heads (32).); fix that value in config.json",
        ),
    ],
)
def test_plan_bad_model_is_one_line(
    model: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each is the user's mistake: exit code 2 and one line (a crash would exit 1). The first
    runs as users run it (a subprocess: the process's exit code); the others in this process,
    through the same ``main`` the command calls (a subprocess each cost seconds of imports)."""
    if model.startswith(("hf:", "{")):
        try:
            import transformers  # noqa: F401
        except ImportError:
            message = "needs Hugging Face transformers, which is not installed"
    if model == "{bad_config}":
        (tmp_path / "config.json").write_text("{not json")
        model = str(tmp_path)
    if model == "{refused_config}":
        if requires_transformers_5.args[0]:  # its condition: transformers before 5
            pytest.skip("transformers 4.x's config classes validate no values")
        (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": -5}')
        model = str(tmp_path)
    if model == "hf:no_such_arch":
        out = run(*CLI, "plan", model)
        returncode, stderr = out.returncode, out.stderr
    else:
        from fsdp_precision._cli import main

        returncode, stderr = main(["plan", model]), capsys.readouterr().err
    assert returncode == 2
    lines = stderr.strip().splitlines()
    assert lines[-1].startswith("fsdp-precision: error: ") and message in lines[-1]


def test_a_users_own_import_still_logs_what_it_logs() -> None:
    """Control of the quiet CLI: the noise is only dropped where the library imports; the same
    import in the user's code logs it (where this machine has any: torchao installed, its CUDA
    kernels unloadable, a torch that deprecates its Enum registrations)."""
    pytest.importorskip("transformers")
    user = run(sys.executable, "-c", "import fsdp_precision, transformers; transformers.LlamaModel")
    assert user.returncode == 0, user.stderr[-2000:]
    if importlib.util.find_spec("torchao") is not None and _torch_deprecates_enum_constants():
        assert noise(user.stderr), user.stderr


def _torch_deprecates_enum_constants() -> bool:
    import inspect

    import torch.utils._pytree as pytree

    return "is an Enum subclass" in inspect.getsource(pytree)


def test_a_failure_is_reported_as_one_clean_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A failure (not the user's input) exits 1 with its last line, unindented (it was printed
    as ``plan failed:     ValueError: ...``)."""
    import fsdp_precision._cli.plan as plan_cli
    from fsdp_precision._cli import main

    def fails(opts: object) -> int:
        raise RuntimeError("Class validation error for validator 'v':\n    KeyError: 'x'")

    monkeypatch.setattr(plan_cli, "run_plan", fails)
    assert main(["plan", "tests.support.models:Net"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fsdp-precision: plan failed: KeyError: 'x'"], err


@pytest.mark.parametrize(
    ("model", "unit", "expected_map"),
    [
        # t5-small's blocks are under the 10M auto-wrap threshold: one root unit, wo kept.
        ("hf:t5", "<root>", {"encoder.block.0.layer.1.DenseReluDense.wo.weight": "float32"}),
        # gpt-oss declares its norms for fp16 (_keep_in_fp32_modules).
        (
            "hf:gpt_oss",
            "model.layers.0",
            {"input_layernorm.weight": "float32", "post_attention_layernorm.weight": "float32"},
        ),
    ],
)
def test_plan_json_for_t5_and_gpt_oss_at_fp16(
    model: str, unit: str, expected_map: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    from fsdp_precision._cli import main

    assert main(["plan", model, "--precision", "fp16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    got = next(u for u in data["units"] if u["name"] == unit)["policy"]["param_dtype_map"]
    assert expected_map.items() <= got.items(), got
    assert all(dtype == "float32" for dtype in got.values())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nproc": 0}, r"--nproc must be an integer >= 1, got 0"),
        ({"steps": True}, r"--steps must be an integer >= 2, got True"),
        ({"resume_nproc": 0}, r"--resume-nproc must be an integer >= 1, got 0"),
        ({"precision": "fp32"}, r"--precision must be bf16 or fp16, got 'fp32'"),
        ({"keep": ("*x=fp8",)}, r"--keep '\*x=fp8': dtype 'fp8' is not one of fp32, bf16, fp16"),
        ({"model": "hf:llama"}, r"--model 'hf:llama' is not one of auto, builtin, hf:deepseek_v3"),
    ],
)
def test_demo_options_are_validated_on_construction(kwargs: dict[str, Any], message: str) -> None:
    from fsdp_precision._cli.demo.command import DemoOptions

    with pytest.raises(ValueError, match=message):
        DemoOptions(**{"model": "builtin", **kwargs})


def test_demo_reference_refuses_a_map_separate_units_cannot_express() -> None:
    # Keeping a Linear's weight but not its bias: no fully_shard unit of its own can hold both
    # dtypes, so the demo says why it skips the reference (and runs the resume check only).
    import torch.nn as nn

    from fsdp_precision import Glob, ParamDtypeMapError, PrecisionRules, compile_param_dtype_maps
    from fsdp_precision.testing import wrap_separate_units

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    plan = compile_param_dtype_maps(
        model, PrecisionRules(rules=(Glob("0.weight"),), hf_keep_in_fp32=False), [model]
    )
    with pytest.raises(ParamDtypeMapError, match=r"separate units cannot express this plan: "):
        wrap_separate_units(model, plan)
    assert not hasattr(model, "_get_fsdp_state")  # refused before anything was wrapped


@pytest.mark.parametrize(
    ("device", "world", "bitwise"),
    [
        ("cpu", 4, True),
        ("cuda", 1, True),
        ("cuda", 2, True),
        ("cuda", 3, False),
        ("cuda", 8, False),
    ],
)
def test_demo_parity_is_bitwise_where_both_layouts_sum_alike(device, world, bitwise):
    """On NCCL from 3 ranks on the reduce-scatter's order depends on a gradient's offset, which
    differs between the layouts: the demo checks within a tolerance there, and says so."""
    from fsdp_precision._cli.demo.job import _close
    from fsdp_precision._cli.demo.results import PARITY_RTOL, parity_is_bitwise_expected

    assert parity_is_bitwise_expected(device, world) is bitwise
    one = torch.tensor([1.0, 2.0])
    assert _close(one, one * (1 + PARITY_RTOL / 2)) and not _close(one, one * (1 + 2 * PARITY_RTOL))
    assert not _close(one, one.to(torch.bfloat16))  # dtypes still must match


@pytest.mark.parametrize(
    ("env", "cuda", "devices", "nccl"),
    [
        ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}, True, 1, False),  # one GPU, two ranks
        ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}, True, 1, False),  # ... the same answer
        ({"LOCAL_WORLD_SIZE": "8"}, True, 8, True),
        ({"WORLD_SIZE": "2"}, True, 4, True),
        ({"LOCAL_WORLD_SIZE": "2"}, False, 0, False),
    ],
)
def test_demo_decides_its_backend_once_for_every_rank(env, cuda, devices, nccl):
    """Per rank (``LOCAL_RANK < device_count``) a one-GPU machine put rank 0 on NCCL and rank 1
    on gloo, and the first collective hung (issue 53)."""
    from fsdp_precision._cli.demo.command import demo_uses_cuda

    assert demo_uses_cuda(env, cuda, devices) is nccl
