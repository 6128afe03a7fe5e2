"""No tensor of the library's lands on a default device (issue 53): every tensor it creates on the
training path takes its device from the mesh, the process group or the tensor it works on. On a
CPU machine a stray CPU tensor is invisible (every device is the CPU), so the main paths run on
2 gloo ranks under a ``TorchFunctionMode`` that records every factory call (``torch.zeros``,
``torch.tensor``, ...) made from the library's own source without a ``device``: on GPUs each
would be a CPU tensor in a CUDA computation, or a CPU tensor handed to NCCL.

Host-side by design, and left out: the CLI (it builds CPU inputs), the advisor (a CPU
analysis), the offline export (it reads checkpoints on the host) and the engines' read-back."""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.overrides import TorchFunctionMode

import fsdp_precision as fp
from fsdp_precision import checkpoint

from tests.support.harness import collect_cases, distributed_suite
from tests.support.models import Net, inputs, loss_of

SRC = Path(fp.__file__).resolve().parent
HOST_BY_DESIGN = ("_cli", "_advise", "_edges/offline.py", "_engines/readback.py")
FACTORIES = {
    torch.empty, torch.zeros, torch.ones, torch.full, torch.tensor, torch.as_tensor,
    torch.arange, torch.randn, torch.rand, torch.randint, torch.empty_strided, torch.eye,
}  # fmt: skip


def _library_frame(frame: FrameType | None) -> str | None:
    """``file:line`` of the calling frame where it is the library's own code (calls torch makes
    inside its own functions, DCP's say, are torch's)."""
    if frame is None:
        return None
    path = Path(frame.f_code.co_filename).resolve()
    if SRC not in path.parents:
        return None
    relative = path.relative_to(SRC).as_posix()
    if any(relative.startswith(p) for p in HOST_BY_DESIGN):
        return None
    return f"{relative}:{frame.f_lineno}"


class Strays(TorchFunctionMode):
    """Records factory calls without a ``device`` made from the library's source."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            where = _library_frame(sys._getframe(1))
            if where is not None:
                self.found.append(f"{where} {func.__name__}")
        return func(*args, **kwargs)


class WithScalar(Net):
    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.logit_scale


def case_control_a_stray_in_library_source_is_caught() -> None:
    """The detector itself: a factory call compiled as if in the library's source is found."""
    namespace: dict[str, Any] = {"torch": torch}
    exec(
        compile("def made():\n    return torch.zeros(3)\n", str(SRC / "_base" / "x.py"), "exec"),
        namespace,
    )  # noqa: E501, S102
    with Strays() as strays:
        namespace["made"]()
        torch.zeros(3)  # the test's own: not the library's
    assert strays.found == ["_base/x.py:2 zeros"], strays.found


def case_the_training_path_creates_no_tensor_on_a_default_device(tmp: str = "") -> None:
    torch.manual_seed(0)
    model = WithScalar()
    rules = fp.PrecisionRules(rules=(fp.Glob("*gate.weight"), fp.Glob("*norm.*")), advice="off")
    out = Path(f"/tmp/fsdp-precision-strays-{dist.get_world_size()}")
    with Strays() as strays:
        config = fp.DistributedConfig(fsdp_mixed_precision=rules, fsdp_auto_wrap_min_params=300)
        wrapped = fp.wrap_model_for_training(model, config)
        optim = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
        for step in range(2):
            loss_of(wrapped(inputs(step))).backward()
            optim.step()
            optim.zero_grad()
        checkpoint.save_checkpoint(out / "ckpt", wrapped, optim, step=2)
        checkpoint.load_checkpoint(out / "ckpt", wrapped, optim)
        names = [name for name, _ in fp.full_weights(wrapped)]
        checkpoint.export_safetensors(wrapped, out / "export")
    assert names and "logit_scale" in names
    assert strays.found == [], strays.found


CASES = collect_cases(globals())
results, test_device_strays = distributed_suite(2, __name__, CASES)
