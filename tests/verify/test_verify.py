"""``fsdp-precision verify MODEL``: run as users run it (subprocesses), plus its building blocks.

Each subprocess run is one spawned gloo group; every run is asserted on as much as it shows.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from fsdp_precision._cli import main
from fsdp_precision._verify.compare import compare, gradient_tolerance
from fsdp_precision.testing import Comparison, ParamParity, ParityReport

from tests.support import ROOT
from tests.support.hf_models import requires_transformers_5

CLI = [sys.executable, "-m", "fsdp_precision", "verify"]
TESTS = str(ROOT)  # subprocesses import tests.support
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])),
}
fp16, bf16, fp32 = torch.float16, torch.bfloat16, torch.float32


def verify(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=300, env=ENV, check=False
    )


def parse_json(out: subprocess.CompletedProcess[str]) -> tuple[int, dict[str, Any]]:
    assert out.returncode in (0, 1), out.stderr[-3000:]
    return out.returncode, json.loads(out.stdout)


#: The real architectures, started together (each run is mostly imports on one core: running
#: them side by side roughly halves the wall time on two cores).
HF_RUNS = {
    "deepseek_v3": ("hf:deepseek_v3", "--json"),
    "t5": ("hf:t5", "--precision", "fp16"),
    "gpt_oss": ("hf:gpt_oss", "--keep", "*.sinks", "--json"),
}


class Runs:
    def __init__(self) -> None:
        self.procs = {
            name: subprocess.Popen(
                [*CLI, *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=ENV,
            )
            for name, args in HF_RUNS.items()
        }
        self.done: dict[str, subprocess.CompletedProcess[str]] = {}

    def __getitem__(self, name: str) -> subprocess.CompletedProcess[str]:
        if name not in self.done:
            proc = self.procs[name]
            out, err = proc.communicate(timeout=300)
            self.done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        return self.done[name]

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="module")
def hf_runs() -> Iterator[Runs]:
    pytest.importorskip("transformers")
    runs = Runs()
    yield runs
    runs.close()


def by_fqn(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["fqn"]: p for p in data["params"]}


# --------------------------------------------------------------------------- real architectures


@pytest.mark.distributed
@requires_transformers_5
def test_deepseek_v3_router_computes_in_fp32_bitwise(hf_runs: Runs) -> None:
    code, data = parse_json(hf_runs["deepseek_v3"])
    assert code == 0 and data["ok"], data["problems"]
    assert data["model"] == "DeepseekV3ForCausalLM" and data["tiny"] and data["world_size"] == 2
    assert data["numel"] < 2_000_000 and data["loss_bitwise"] and data["output_bitwise"]
    params = by_fqn(data)
    gate = params["model.layers.1.mlp.gate.weight"]  # layer 0 is dense (first_k_dense_replace)
    assert gate["storage"] == "float32" and gate["compute"] == gate["gathered"] == "float32"
    assert gate["rule"] == "transformers _keep_in_fp32_modules_strict 'gate.weight'"
    assert gate["grad"]["bitwise"] and gate["param"]["bitwise"]
    attn = params["model.layers.1.self_attn.q_a_proj.weight"]
    assert attn["gathered"] == "bfloat16" and attn["rule"] == "default"
    assert all(p["grad"]["bitwise"] and p["param"]["bitwise"] for p in data["params"])


@pytest.mark.distributed
def test_t5_fp16_keeps_wo_in_fp32_table(hf_runs: Runs) -> None:
    out = hf_runs["t5"]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    rows = [line.split() for line in lines if line.startswith(("encoder.", "decoder."))]
    wo = [r for r in rows if ".DenseReluDense.wo." in r[0]]
    assert len(wo) == 4  # 2 encoder + 2 decoder blocks
    kept = "float32 float32 transformers _keep_in_fp32_modules 'wo' bitwise bitwise".split()
    assert all(row[1:] == kept for row in wo), wo
    others = [r for r in rows if r not in wo]
    assert others and all(r[2] == "float16" and r[-2:] == ["bitwise", "bitwise"] for r in others)
    # + shared.weight, the embedding tied to both stacks and the head
    summary = f"{len(rows) + 1} parameters: all bitwise identical to the unsharded reference"
    assert lines[-1].startswith(f"{summary} on all 2 ranks"), lines[-1]


@pytest.mark.distributed
@requires_transformers_5
def test_gpt_oss_with_a_keep_rule(hf_runs: Runs) -> None:
    code, data = parse_json(hf_runs["gpt_oss"])
    assert code == 0 and data["ok"], data["problems"]
    sinks = [p for p in data["params"] if p["fqn"].endswith(".sinks")]
    assert len(sinks) == 2
    for p in sinks:
        assert p["gathered"] == "float32" and p["rule"] == "glob '*.sinks'", p
    experts = by_fqn(data)["model.layers.0.mlp.experts.gate_up_proj"]
    assert experts["gathered"] == "bfloat16" and experts["grad"]["bitwise"]


# --------------------------------------------------------------------------- module:callable


@pytest.mark.distributed
def test_module_callable_on_three_ranks_within_tolerance() -> None:
    gate, gate_dtype = "*gate.weight=fp16", "float16"
    out = verify(
        "tests.support.verify_models:TinyNet", "--nproc", "3", "--keep", "*norm.*", "--keep", gate
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith(
        "fsdp-precision verify tests.support.verify_models:TinyNet: TinyNet (as built, 2,112 parameters), "
        "3 processes (gloo, CPU)"
    )
    assert "plan: 3 FSDP units" in lines[1]
    row = next(line.split() for line in lines if line.startswith("blocks.1.gate.weight"))
    assert row[:5] == ["blocks.1.gate.weight", "float32", gate_dtype, "glob", "'*gate.weight'"]
    assert row[-1] == "bitwise"
    eps = torch.finfo(fp32).eps
    assert lines[-1].startswith(
        "18 parameters match the unsharded reference on all 3 ranks: loss, output and parameters "
        "after the step bitwise (the reference optimizer stepped on FSDP's gradients); "
        f"gradients within {3 * eps:.2e} x max|grad|"
    ), lines[-1]


@pytest.mark.distributed
def test_negative_control_rank_dependent_forward_fails() -> None:
    """verify can fail: a forward that differs per rank makes FSDP's averaged gradient differ
    from every rank's reference (the inputs come from the module's example_inputs function)."""
    out = verify("tests.support.verify_models:RankDependent")
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "loss" in out.stdout and "(bitwise)" in out.stdout.splitlines()[2]  # rank-local
    assert "18 of 18 parameters differ from the unsharded reference" in out.stdout
    assert "  blocks.0.norm.weight: gradient differs (max |diff| " in out.stdout
    assert "... and 23 more (--json lists all)" in out.stdout
    head = next(line.split() for line in out.stdout.splitlines() if line.startswith("head.weight"))
    assert head[:4] == ["head.weight", "float32", "bfloat16", "default"]
    assert float(head[4]) > 0 and float(head[5]) > 0  # |diff| of the gradient and the parameter
    assert "fsdp-precision:" not in out.stderr  # a finding, not an error


@pytest.mark.distributed
def test_the_guard_names_a_module_used_outside_its_unit() -> None:
    out = verify("tests.support.verify_models:TrainingOnlyRead", "--min-params", "0")
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert (
        "UnitUsageError: parameter 'body.weight' was used (a read of .dtype) in the forward of "
        "<root>, outside its FSDP unit [body], which was not gathered"
    ) in out.stderr, out.stderr[-3000:]
    assert "got mixed torch.Tensor and DTensor" not in out.stderr  # not torch's own error


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["hf:no_such_arch"],
            "MODEL 'hf:no_such_arch': transformers knows no model_type 'no_such_arch' "
            "(examples: hf:llama, hf:deepseek_v3, hf:t5, hf:gpt_oss)",
        ),
        (
            ["tests.support.models:Net"],
            "MODEL 'tests.support.models:Net': verify cannot make inputs for Net; give the model a method "
            "example_inputs(self, generator) -> dict of forward keyword arguments, or define "
            "example_inputs(model, generator) next to the factory (draw only from the "
            "generator: every rank must get the same inputs)",
        ),
        (
            ["tests.support.verify_models:TinyNet", "--keep", "*norm*=int8"],
            "--keep '*norm*=int8': dtype 'int8' is not one of fp32, bf16, fp16",
        ),
        (
            ["tests.support.verify_models:TinyNet", "--nproc", "0"],
            "--nproc must be an integer >= 1, got 0",
        ),
    ],
)
def test_bad_input_is_one_line_error(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    if args[0].startswith("hf:"):
        pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(TESTS)
    assert main(["verify", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"fsdp-precision: error: {message}\n"


def test_bad_input_from_the_console_has_no_traceback() -> None:
    out = verify("tests.support.verify_models:TinyNet", "--keep", "nothing*")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        "fsdp-precision: error: precision rule glob 'nothing*' -> float32 matches no parameter "
        "of TinyNet; patterns match whole root-relative FQNs (e.g. 'blocks.0.norm.weight'); use "
        "'*' to match any prefix\n"
    )


def test_help_states_what_is_compared(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["verify", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "on 1 and 2 processes everything must be bitwise identical" in text
    assert "within N * eps(reduce dtype) * max|grad|" in text


# --------------------------------------------------------------------------- building blocks


def test_compare_bits_not_values() -> None:
    g = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    assert compare(g, g.clone()) == Comparison(True, 0.0, float(g.abs().max()))
    nudged = g.clone()
    nudged[2, 1] = torch.nextafter(g[2, 1], torch.tensor(math.inf))
    c = compare(nudged, g)
    assert not c.bitwise and c.max_abs_diff == pytest.approx(float(nudged[2, 1] - g[2, 1]))
    assert not compare(g.to(bf16), g).bitwise  # same values in another dtype: not bitwise
    nan = torch.full((2,), math.nan)
    assert compare(nan, nan.clone()).bitwise  # the same NaN bits are the same bits
    assert compare(g[:2], g).max_abs_diff == math.inf


def test_gradient_tolerance_is_bitwise_on_one_and_two_ranks() -> None:
    assert gradient_tolerance(1, fp32) is None and gradient_tolerance(2, fp32) is None
    assert gradient_tolerance(4, fp32) == 4 * torch.finfo(fp32).eps
    assert Comparison(False, 1e-7, 1.0).within(gradient_tolerance(4, fp32))
    assert not Comparison(False, 1e-5, 1.0).within(gradient_tolerance(4, fp32))
    assert not Comparison(False, 1e-30, 1.0).within(None)


def _param(**changes: Any) -> ParamParity:
    base: dict[str, Any] = dict(
        fqn="blocks.0.gate.weight",
        aliases=(),
        unit="blocks.0",
        storage=fp32,
        compute=fp32,
        gathered=fp32,
        rule="glob '*gate.weight'",
        grad=Comparison(True, 0.0, 1.0),
        param=Comparison(True, 0.0, 1.0),
    )
    return ParamParity(**{**base, **changes})


def _report(*params: ParamParity) -> ParityReport:
    return ParityReport(
        model="Net", world_size=2, rules="r", units=3, loss=1.0, reference_loss=1.0,
        loss_match=True, output_match=True, params=list(params), optimizer="AdamW(lr=0.001)",
        grads_bitwise_expected=True,
    )  # fmt: skip


def test_a_perturbed_gradient_or_gather_dtype_fails_the_report() -> None:
    assert _report(_param()).ok
    perturbed = _param(grad=Comparison(False, 2.0**-24, 1.0))
    wrong_gather = _param(fqn="norm.weight", gathered=bf16)
    report = _report(_param(fqn="head.weight"), perturbed, wrong_gather)
    assert not report.ok
    assert report.problems() == [
        f"blocks.0.gate.weight: gradient differs (max |diff| {2.0**-24:.3g})",
        "norm.weight: all-gathered in bfloat16, planned float32",
    ]
    text = report.format()
    assert "2 of 3 parameters differ from the unsharded reference (2 problems):" in text
    row = next(line.split() for line in text.splitlines() if line.startswith("norm.weight "))
    assert row[:5] == ["norm.weight", "float32", "bfloat16", "!=", "planned"]


# --------------------------------------------------------------------------- tiny configs


@pytest.mark.parametrize(
    "model_type", ["deepseek_v3", "t5", "gpt_oss", "llama", "qwen3_moe", "mixtral"]
)
def test_tiny_config_runs_a_step(model_type: str) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from fsdp_precision.testing import tiny_config

    full = AutoConfig.for_model(model_type)
    tiny = tiny_config(full)
    assert type(tiny) is type(full) and tiny is not full
    assert full.to_dict() == AutoConfig.for_model(model_type).to_dict()  # input untouched
    torch.manual_seed(0)
    auto = AutoModelForSeq2SeqLM if tiny.is_encoder_decoder else AutoModelForCausalLM
    model = auto.from_config(tiny, dtype=fp32)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    ids = torch.randint(0, tiny.vocab_size, (2, 8))
    labels = torch.randint(0, tiny.vocab_size, (2, 6)) if tiny.is_encoder_decoder else ids
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    assert torch.isfinite(out.loss)
