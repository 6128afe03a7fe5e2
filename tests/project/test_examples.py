"""Every example in examples/ runs as its docstring says, at its tiny size, and prints what ran.

Each row: the file, its arguments, how many processes (``torchrun`` for 2), the packages it
needs (the test skips, naming them, where one is missing; CI installs them all, and runs the
torchtitan example in its own venv), and the line it prints when the kept parameters were
gathered in their dtype on FSDP2. An example without a row fails: none rots untested.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_precision._base.dist import free_port

EXAMPLES = Path(__file__).parents[2] / "examples"

#: (file, arguments, processes, packages, printed)
RUNS = [
    ("plan_and_wrap.py", (), 1, ("transformers",), "router gathered in torch.float32"),
    ("train_distributed.py", (), 1, ("transformers",), "step 3: loss"),
    ("trl_sft_qwen3_moe.py", (), 2, ("trl", "datasets"), "gathered in fp32 (router gates)"),
    (
        "trl_sft_qwen3_moe.py",
        ("--lora",),
        2,
        ("trl", "datasets", "peft"),
        "gathered in fp32 (router gates, adapters)",
    ),
    ("accelerate_qwen3_moe.py", (), 2, ("accelerate",), "gates and norms gathered in fp32"),
    (
        "accelerate_wan.py",
        (),
        2,
        ("accelerate", "diffusers"),
        "(scale_shift_table, time_embedder, time_proj, norm2) gathered in fp32",
    ),
    (
        "lightning_fabric_qwen3_moe.py",
        (),
        2,
        ("lightning",),
        "kept in fp32, reloaded with the trained logits",
    ),
    ("transformers_native_qwen3_moe.py", (), 2, ("transformers",), "on transformers' FSDP2"),
    (
        "torchtitan_qwen3_moe.py",
        (),
        2,
        ("torchtitan", "triton"),
        "gates in fp32, reloaded with the trained logits",
    ),
    ("elastic_resume.py", (), 2, (), "trained to step 5 on mesh [0, 1]"),
    (
        "rl_handoff_qwen3_moe.py",
        (),
        2,
        ("transformers",),
        "iteration 2: reward",  # and the engine's logits bitwise the policy's (it exits otherwise)
    ),
    (
        "rl_handoff_vllm.py",
        (),
        2,
        ("vllm",),
        "top-2 as the policy's in 2/2 layers",
    ),
    (
        "rl_replay_vllm.py",
        (),
        2,
        ("vllm",),
        "step 2: trainer routed as the engine on",
    ),
    (
        "compile_float8_checkpointing.py",
        (),
        2,
        ("transformers", "torchao"),
        "2 router gates gathered in fp32, 8 Float8Linear layers",
    ),
]


#: Runs an integration test makes already, straight through with the example's defaults (an
#: output directory given), before its resume: that test asserts the printed line on them, so
#: they are not launched twice. (file, arguments) -> the test module.
RUN_IN = {
    ("trl_sft_qwen3_moe.py", ()): "tests/integrations/test_trl_checkpoints.py",
    ("trl_sft_qwen3_moe.py", ("--lora",)): "tests/integrations/test_trl_checkpoints.py",
    ("accelerate_qwen3_moe.py", ()): "tests/integrations/test_accelerate.py",
    ("lightning_fabric_qwen3_moe.py", ()): "tests/integrations/test_lightning.py",
    ("transformers_native_qwen3_moe.py", ()): "tests/integrations/test_transformers_native.py",
    ("rl_handoff_vllm.py", ()): "tests/engines/test_vllm.py",
    ("rl_replay_vllm.py", ()): "tests/engines/test_vllm_replay_example.py",
}
LAUNCHED = [r for r in RUNS if (r[0], r[1]) not in RUN_IN]


def test_every_example_has_a_run() -> None:
    """Every example has a row; a row run in an integration test is asserted there (its
    printed line is in that test's source)."""
    assert {p.name for p in EXAMPLES.glob("*.py")} == {r[0] for r in RUNS}
    root = EXAMPLES.parent
    for name, args, _, _, printed in RUNS:
        module = RUN_IN.get((name, args))
        if module is not None:
            assert printed in (root / module).read_text(), (name, args, module)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("name", "args", "nproc", "packages", "printed"),
    LAUNCHED,
    ids=[" ".join((r[0], *r[1])) for r in LAUNCHED],
)
def test_example_runs(
    name: str, args: tuple[str, ...], nproc: int, packages: tuple[str, ...], printed: str
) -> None:
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        extra = "torchtitan" if "torchtitan" in missing else "integrations"
        pytest.skip(f"{name} needs {', '.join(missing)} (pip install 'fsdp-precision[{extra}]')")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    path = str(EXAMPLES / name)
    if nproc == 1:
        command = [sys.executable, path, *args]
    else:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        command = [sys.executable, *launcher, path, *args]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert printed in out.stdout, out.stdout[-2000:]
