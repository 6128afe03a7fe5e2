"""torchtitan's router (0.3.0, ``models/common/moe.py``: ``with torch.autocast(device_type,
dtype=torch.float32): scores = self.gate(x)``): the uniform policy, each kept module's forward
under fp32 autocast. The weight is all-gathered in bf16 and, on a GPU, upcast for an fp32 matmul;
CPU autocast refuses float32 ("In CPU autocast, but the target dtype is not supported. Disabling
autocast."), so on CPU the module computes in bf16."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn

from peers import torch_uniform

NAME = "torchtitan_autocast"
SOURCE = "torchtitan 0.3.0's router: the gate under torch.autocast(dtype=float32), uniform units"


def available() -> str | None:
    return None


class _Autocast:
    def __init__(self, module: nn.Module) -> None:
        self.forward = module.forward
        self.device = "cpu"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # CPU: autocast to fp32 is refused
            with torch.autocast(device_type=self.device, dtype=torch.float32):
                return self.forward(*args, **kwargs)


def wrap(model: nn.Module, kept: tuple[str, ...]) -> str:
    from peers.harness import kept_names

    owners = {n.rpartition(".")[0] for n in kept_names(model, kept)}
    device = next(model.parameters()).device.type
    for name, module in model.named_modules():
        if name in owners:
            wrapped = _Autocast(module)
            wrapped.device = device
            module.forward = wrapped  # type: ignore[method-assign]
    torch_uniform.wrap(model, kept)
    return "" if device != "cpu" else "on CPU, autocast to float32 is disabled (torch warns)"
