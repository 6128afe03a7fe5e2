"""``MODEL`` as a new user gives it: a Diffusers model directory (``save_pretrained`` of a tiny
Wan), and a ``module:callable`` in the current directory; ``plan`` traces and advises both on
the inputs ``verify`` makes, and ``verify`` checks the directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_precision._cli import main

from tests.cli.test_cli import noise
from tests.support import ROOT

pytest.importorskip("diffusers", reason="diffusers is not installed (pip install '.[hf]')")

ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
}
#: The console script, as a user runs it: its sys.path starts at its own folder, not the cwd.
SCRIPT = Path(sys.executable).with_name("fsdp-precision")
WAN_KEPT = {
    "scale_shift_table",
    "condition_embedder.time_embedder.linear_1.weight",
    "blocks.0.scale_shift_table",
    "blocks.0.norm2.weight",
}


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.hf_models import wan

    path = tmp_path_factory.mktemp("wan")
    torch.manual_seed(0)
    wan().save_pretrained(path)
    return path


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["plan", *args, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def one_line_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(list(args)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fsdp-precision: error: "), lines
    return lines[0]


def test_plan_a_diffusers_directory(wan_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Planned on meta with Wan's declared keeps; the first forward runs on a tiny CPU build
    and the advisor traces the inputs verify makes (it failed with transformers' "Should have a
    `model_type` key")."""
    data = plan_json(capsys, str(wan_dir), "--units", "transformer_block")
    assert data["model"] == "WanTransformer3DModel"
    kept = {
        f"{u['name']}.{k}" if u["name"] != "<root>" else k
        for u in data["units"]
        for k in u["policy"]["param_dtype_map"]
    }
    assert WAN_KEPT <= kept, kept
    first = data["first_forward"]
    assert first["ok"] and first["how"].startswith("traced on a tiny CPU build of the same config")
    assert data["advice"]["traced"] == "traced a forward on example_inputs"
    assert data["advice"]["covered"] and data["advice"]["advice"], data["advice"]


def test_plan_names_the_inputs_the_block_units_round(
    wan_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With the timestep projection kept, Wan's blocks receive fp32 ``temb`` and rotary tables
    that their units' input cast rounds: the plan names each with its producer and suggests the
    names, and with ``--uncast-inputs`` lists them left fp32."""
    args = [
        str(wan_dir),
        "--units",
        "transformer_block",
        "--keep",
        "condition_embedder.time_proj.*",
    ]
    assert main(["plan", *args]) == 0
    out = capsys.readouterr().out
    assert "blocks.0: temb (float32 from condition_embedder.time_proj) -> bfloat16" in out
    assert "blocks.1: rotary_emb (float32 from rope) -> bfloat16" in out
    # the caller's own fp32 timestep, into the root unit, is suggested too
    assert "--uncast-inputs timestep,temb,rotary_emb" in out
    data = plan_json(capsys, *args, "--uncast-inputs", "timestep,temb,rotary_emb")
    rounded = data["first_forward"]["rounded_inputs"]
    blocks = [r for r in rounded if r["unit"].startswith("blocks.")]
    assert len(blocks) == 4 and all(r["uncast"] and r["dtype"] == "float32" for r in blocks)
    assert {u["name"] for u in data["units"] if u["uncast_inputs"]} >= {"blocks.0", "blocks.1"}


def test_plan_applies_the_advice_traced_on_a_diffusers_model(
    wan_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With size-based units (plan_model_for_training), --advice apply needs the inputs at
    compile time: it stopped at "needs a traced forward, and got none" for a model without
    dummy_inputs, inputs or not."""
    data = plan_json(capsys, str(wan_dir), "--advice", "apply")
    assert data["rules"].endswith("then the advice"), data["rules"]
    assert data["parameter_uses"] == "traced a forward on example_inputs"
    assert "advice (gain) '*scale_shift_table'" in data["rule_claims"], data["rule_claims"]


@pytest.mark.distributed
def test_verify_a_diffusers_directory(wan_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "fsdp_precision", "verify", str(wan_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert noise(out.stderr) == []  # the parent and both ranks resolve the class quietly
    data = json.loads(out.stdout)
    assert (data["model"], data["tiny"], data["world_size"]) == ("WanTransformer3DModel", True, 2)
    assert data["ok"] and data["loss_bitwise"]
    gathered = {p["fqn"]: p["gathered"] for p in data["params"]}
    assert all(gathered[f] == "float32" for f in WAN_KEPT), gathered
    assert gathered["blocks.0.attn1.to_q.weight"] == "bfloat16"


def test_a_class_without_input_builder_plans_untraced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from diffusers import AutoencoderKL

    AutoencoderKL(block_out_channels=(8,), norm_num_groups=4).save_pretrained(tmp_path)
    data = plan_json(capsys, str(tmp_path))
    assert data["model"] == "AutoencoderKL"
    how = data["first_forward"]["how"]
    assert (
        how.startswith("not traced: MODEL ")
        and (
            "no input builder for the Diffusers class AutoencoderKL (known: WanTransformer3DModel, "
        )
        in how
    ), how


def test_a_unets_nested_blocks_are_planned_innermost_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A UNet declares its up blocks and the resnet blocks inside them (_no_split_modules): the
    inner units come first, as fully_shard needs (verify's default units refused it at apply:
    "unit up_blocks.0.resnets.0 is planned after unit up_blocks.0, which contains it")."""
    from fsdp_precision._cli.diffusers_models import DiffusersConfig, build

    config = DiffusersConfig(
        "unet", "UNet2DConditionModel", {"_class_name": "UNet2DConditionModel"}
    )
    build(config, torch.device("cpu"), tiny=True, dtype=None).save_pretrained(tmp_path)
    data = plan_json(capsys, str(tmp_path), "--units", "transformer_block", "--no-trace")
    names = [u["name"] for u in data["units"]]
    assert names.index("up_blocks.0.resnets.1") < names.index("up_blocks.0"), names
    for i, name in enumerate(names):  # no unit after one that contains it
        assert not any(name.startswith(f"{outer}.") for outer in names[:i]), (name, names)


def _config(path: Path, **data: Any) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(data))
    return str(path)


def test_bad_diffusers_directories_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import diffusers

    spec = _config(tmp_path / "nope", _class_name="NoSuchTransformer3DModel")
    assert (
        f"MODEL {spec!r}: diffusers {diffusers.__version__} has no class "
        "'NoSuchTransformer3DModel' (config.json's _class_name); fix _class_name, or install a "
        "diffusers release that has it"
    ) in one_line_error(capsys, "plan", spec)
    spec = _config(tmp_path / "scheduler", _class_name="FlowMatchEulerDiscreteScheduler")
    assert (
        "'FlowMatchEulerDiscreteScheduler' (config.json's _class_name) is not a Diffusers model "
        "(ModelMixin); pass the directory of a model"
    ) in one_line_error(capsys, "verify", spec)
    pipeline = tmp_path / "pipeline"
    _config(pipeline / "transformer", _class_name="WanTransformer3DModel")
    (pipeline / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    assert (
        f"MODEL {str(pipeline)!r} is a Diffusers pipeline (model_index.json), not a model; pass "
        "one of its model subfolders: transformer"
    ) in one_line_error(capsys, "plan", str(pipeline))
    monkeypatch.setitem(sys.modules, "diffusers", None)  # as if it were not installed
    spec = _config(tmp_path / "wan", _class_name="WanTransformer3DModel")
    assert (
        f"MODEL {spec!r} is a Diffusers model directory (_class_name 'WanTransformer3DModel'), "
        "which needs diffusers, not installed; pip install 'fsdp-precision[hf]'"
    ) in one_line_error(capsys, "plan", spec)


FACTORY = """
import torch
import torch.nn as nn


class Mine(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.body(x))

    def example_inputs(self, generator):
        return {"x": torch.randn(2, 8, generator=generator)}


def build():
    return Mine()
"""


@pytest.mark.skipif(not SCRIPT.is_file(), reason="the fsdp-precision console script is absent")
def test_module_callable_in_the_current_directory_plans_traced(tmp_path: Path) -> None:
    """As a user runs it: a module beside them is found (it was "No module named"), and the plan
    traces and advises on the model's example_inputs (it said only transformers models are
    traced)."""
    (tmp_path / "mymodels.py").write_text(FACTORY)
    out = subprocess.run(
        [str(SCRIPT), "plan", "mymodels:build", "--keep", "norm.*"],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    kept = [ln.split() for ln in lines if ln.endswith("by glob 'norm.*'")]
    assert [k[0] for k in kept] == ["norm.weight", "norm.bias"], lines
    assert (
        "first forward: runs (traced on the model's meta build, in the planned compute dtypes)"
        in lines
    )
    assert "precision advice (traced a forward on example_inputs):" in lines


def test_a_bad_uncast_inputs_name_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line_error(capsys, "plan", "hf:llama", "--no-trace", "--uncast-inputs", "temb.x")
    assert (
        "--uncast-inputs: PrecisionRules.uncast_inputs entries are forward argument names" in line
    )
    assert "'temb.x'" in line
