"""What a kept module really computes, observed at three places (the verl seed): the dtype its
input arrives in, the dtypes of the operators inside its forward (a dispatch mode), and the
dtype it returns. One bf16 unit, a kept LayerNorm (gains: cast back) and a kept router (a
matrix kept wider: fp32 logits), on one gloo rank; the plain policy is the negative control.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fsdp_precision as fp

from tests.support.models import Block

pytestmark = pytest.mark.usefixtures("world1")
bf16, fp32 = torch.bfloat16, torch.float32


class Ops(TorchDispatchMode):
    """Each aten operator run, with its floating tensor arguments' dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        leaves, _ = tree_flatten((args, kwargs or {}))
        dtypes = tuple(
            x.dtype for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point()
        )
        self.seen.append((func.overloadpacket.__name__, dtypes))
        return func(*args, **(kwargs or {}))


class Observed:
    """The module's input dtype as the model hands it over, the operators inside its forward
    (after any boundary cast), and its output dtype as the model gets it back."""

    def __init__(self, module: nn.Module) -> None:
        self.arrived: torch.dtype | None = None
        self.returned: torch.dtype | None = None
        self.ops = Ops()
        module.register_forward_pre_hook(self._arrive, prepend=True)  # before the cast
        module.register_forward_pre_hook(self._enter)  # after it
        module.register_forward_hook(self._exit, prepend=True)  # before the cast back
        module.register_forward_hook(self._return)  # after it

    def _arrive(self, module: nn.Module, args: Any) -> None:
        self.arrived = args[0].dtype

    def _enter(self, module: nn.Module, args: Any) -> None:
        self.ops.__enter__()

    def _exit(self, module: nn.Module, args: Any, out: Any) -> None:
        self.ops.__exit__(None, None, None)

    def _return(self, module: nn.Module, args: Any, out: Any) -> None:
        self.returned = out.dtype

    def op(self, name: str) -> tuple[torch.dtype, ...]:
        found = [d for n, d in self.ops.seen if n == name]
        assert found, [n for n, _ in self.ops.seen]
        return found[0]


def observe(rules: fp.PrecisionRules) -> dict[str, Observed]:
    torch.manual_seed(0)
    block = Block()
    fp.compile_param_dtype_maps(block, rules, [block]).apply()
    seen = {name: Observed(block.get_submodule(name)) for name in ("norm", "gate", "up")}
    block(torch.randn(4, 16)).float().sum().backward()
    return seen


def test_kept_modules_compute_in_their_dtype_between_their_casts() -> None:
    rules = fp.PrecisionRules(
        param_dtype=bf16, reduce_dtype=fp32, rules=(fp.Glob("norm.*"), fp.Glob("gate.weight"))
    )
    seen = observe(rules)
    norm, gate, up = seen["norm"], seen["gate"], seen["up"]
    assert norm.arrived == bf16 and norm.op("native_layer_norm") == (fp32, fp32, fp32)
    assert norm.returned == bf16  # gains: back to the activations' dtype
    # this router casts to its weight's dtype itself, which reads fp32 inside the unit
    assert gate.arrived == fp32 and set(gate.op("mm")) == {fp32}
    assert gate.returned == fp32  # a matrix kept wider: fp32 logits, as routers expect
    assert up.arrived == bf16 and set(up.op("addmm")) == {bf16}


def test_the_plain_policy_computes_them_in_bf16() -> None:
    seen = observe(fp.PrecisionRules(param_dtype=bf16, reduce_dtype=fp32))
    assert seen["norm"].op("native_layer_norm") == (bf16, bf16, bf16)
    assert set(seen["gate"].op("mm")) == {bf16} and seen["gate"].returned == bf16
