"""Map validation at fully_shard time, on a one-rank group in the test process (no spawn)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from fsdp_precision import ParamDtypeMapError, ParamDtypeMixedPrecisionPolicy
from fsdp_precision._releases import torch_release
from fsdp_precision.testing import GatherProbe

from tests.support.models import Block, bf16, fp16, fp32, net

pytestmark = pytest.mark.usefixtures("world1")


def policy(dtype_map: dict[str, torch.dtype], reduce_dtype=fp32, param_dtype=bf16):
    return ParamDtypeMixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, param_dtype_map=dtype_map
    )


def assert_untouched(model: nn.Module, params_before: dict[str, nn.Parameter]) -> None:
    """A rejected map leaves the model exactly as it was, and fully_shard can be called again."""
    assert not isinstance(model, FSDPModule)
    for name, param in model.named_parameters():
        assert param is params_before[name] and not isinstance(param, DTensor), name
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks


ERRORS = [
    (
        {"blocks.0.norm.wieght": fp32},
        r"key 'blocks\.0\.norm\.wieght' matches no parameter managed by this fully_shard call "
        r"\(did you mean 'blocks\.0\.norm\.weight'\?\)",
    ),
    ({"blocks.0.norm.weight.": fp32}, r"did you mean 'blocks\.0\.norm\.weight'"),
    (
        {"blocks.0.norm.weight": fp32},  # a bf16 compute dtype beside fp32 needs a reduce dtype
        r"compute in different dtypes \('blocks\.0\.norm\.weight' computes in torch\.float32, "
        r".* computes in torch\.bfloat16\) but reduce_dtype is None, so no single reduce-scatter "
        r"dtype exists; set reduce_dtype",
    ),
]


@pytest.mark.parametrize(("dtype_map", "message"), ERRORS)
def test_bad_map_rejected_before_anything_changes(dtype_map, message) -> None:
    model = net()
    before = dict(model.named_parameters())
    reduce_dtype = None if "different dtypes" in message else fp32
    with pytest.raises(ParamDtypeMapError, match=message):
        fully_shard(model, mp_policy=policy(dtype_map, reduce_dtype=reduce_dtype))
    assert_untouched(model, before)
    fully_shard(model, mp_policy=policy({"blocks.0.norm.weight": fp32}))  # retry works
    assert isinstance(model.blocks[0].norm.weight, DTensor)


def test_keys_are_local_to_the_wrapped_module() -> None:
    model = net()
    with pytest.raises(ParamDtypeMapError, match=r"did you mean 'norm\.weight'"):
        fully_shard(model.blocks[0], mp_policy=policy({"blocks.0.norm.weight": fp32}))
    fully_shard(model.blocks[0], mp_policy=policy({"norm.weight": fp32, "norm.bias": fp32}))
    # The parameter now belongs to the inner unit: the root may not claim it.
    with pytest.raises(ParamDtypeMapError, match=r"belongs to an inner fully_shard unit"):
        fully_shard(model, mp_policy=policy({"blocks.0.norm.weight": fp32}))


def test_ignored_parameter_cannot_be_mapped() -> None:
    model = net()
    ignored = {model.head.bias}
    with pytest.raises(ParamDtypeMapError, match=r"'head\.bias' .* belongs to ignored_params"):
        fully_shard(model, mp_policy=policy({"head.bias": fp32}), ignored_params=ignored)


def test_grouped_call_broadcasts_a_key_to_every_member() -> None:
    model = net()
    norms = [block.norm for block in model.blocks]
    fully_shard(norms, mp_policy=policy({"weight": fp32, "bias": fp32}))
    fully_shard(model, mp_policy=policy({}))
    with GatherProbe(model) as probe:
        model(torch.randn(2, 16)).float().sum().backward()
    for i in range(2):
        assert probe.seen[f"blocks.{i}.norm.weight"].dtype == fp32
        assert probe.seen[f"blocks.{i}.norm.bias"].dtype == fp32
    assert probe.seen["blocks.0.up.weight"].dtype == bf16


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.a.weight
        return self.b(self.a(x.to(w.dtype))).float()


def test_aliases_may_share_a_dtype() -> None:
    model = Tied()
    keep = {"a.weight": fp32, "b.weight": fp32, "a.bias": fp32, "b.bias": fp32}
    fully_shard(model, mp_policy=policy(keep))
    with GatherProbe(model) as probe:
        model(torch.randn(2, 8)).sum().backward()
    assert probe.seen["a.weight"].dtype == fp32 and probe.seen["b.weight"].dtype == fp32
    assert model.a.weight.grad.dtype == fp32


def test_aliases_with_conflicting_dtypes_rejected() -> None:
    model = Tied()
    with pytest.raises(
        ParamDtypeMapError,
        match=r"one shared parameter to two dtypes: 'a\.weight' -> torch\.float32 and "
        r"'b\.weight' -> torch\.float16",
    ):
        fully_shard(model, mp_policy=policy({"a.weight": fp32, "b.weight": fp16}))


def test_frozen_parameters_need_no_reduce_dtype() -> None:
    model = Block()
    model.norm.requires_grad_(False)
    fully_shard(
        model, mp_policy=policy({"norm.weight": fp32, "norm.bias": fp32}, reduce_dtype=None)
    )
    model(torch.randn(2, 16)).float().sum().backward()
    assert model.norm.weight.grad is None and model.up.weight.grad.dtype == fp32
    # Unfreezing afterwards makes the unit's gradients mixed.
    model.norm.requires_grad_(True)
    if torch_release() == "2.15":
        # torch 2.15 defines reduce_dtype=None for mixed gradients (each follows its parameter's
        # grad_dtype, the reduction runs in the promoted dtype), and on 2.15 this unit runs on
        # torch's own reduction: it reduces in fp32. 2.11-2.14 have no such rule: caught there.
        model(torch.randn(2, 16)).float().sum().backward()
        assert model.norm.weight.grad.dtype == fp32 and model.up.weight.grad.dtype == fp32
        return
    with pytest.raises(ParamDtypeMapError, match=r"gradients in several dtypes .* no reduce_dtype"):
        model(torch.randn(2, 16)).float().sum().backward()


def test_cast_after_fully_shard_is_caught_at_first_forward() -> None:
    """The map is checked inside fully_shard; a later ``.to(dtype)`` can make it inconsistent,
    which the patched releases catch at the first forward (lazy init), before any collective."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    pinned = policy({"0.weight": fp32}, reduce_dtype=None, param_dtype=None)
    fully_shard(model, mp_policy=pinned)  # everything computes in fp32: a valid map
    model(torch.randn(2, 8)).sum().backward()  # control: runs before the cast
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fully_shard(model, mp_policy=pinned)
    model.to(torch.float64)  # 0.weight stays pinned to fp32, the rest now computes in fp64
    if torch_release() == "2.15":
        # The native override was fixed at fully_shard time; torch's own forward fails.
        with pytest.raises(RuntimeError, match="must have the same dtype"):
            model(torch.randn(2, 8, dtype=torch.float64))
        return
    with pytest.raises(
        ParamDtypeMapError,
        match=r"^trainable parameters of FSDP unit <root> compute in different dtypes "
        r"\(weight: float32, bias: float64, weight: float64, bias: float64, \.\.\.\) but "
        r"reduce_dtype is None; set reduce_dtype explicitly \(usually torch\.float32\)$",
    ):
        model(torch.randn(2, 8, dtype=torch.float64))


class WithExtras(nn.Module):
    def __init__(self, extra: torch.Tensor, trainable: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.lin = nn.Linear(8, 8)
        self.extra = nn.Parameter(extra, requires_grad=trainable)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x)) + self.extra.real.float().sum()


EXTRAS = {
    "int64": torch.arange(6),
    "bool": torch.ones(6, dtype=torch.bool),
    "complex64": torch.randn(6, dtype=torch.complex64),
}


@pytest.mark.parametrize("kind", EXTRAS)
@pytest.mark.parametrize("ignored", [False, True], ids=["frozen", "ignored"])
def test_non_floating_parameters_coexist_frozen_or_ignored(kind: str, ignored: bool) -> None:
    model = WithExtras(EXTRAS[kind].clone())
    keep = {"norm.weight": fp32, "norm.bias": fp32}
    if torch_release() == "2.11" and not ignored and kind != "complex64":
        # torch 2.11's FSDP2 makes every sharded parameter trainable, which integral and boolean
        # tensors cannot be (2.12 keeps requires_grad): the error says so and names the way out.
        with pytest.raises(
            ParamDtypeMapError,
            match=rf"cannot manage non-floating parameters \('extra' \({kind}\)\).*ignored_params",
        ):
            fully_shard(model, mp_policy=policy(keep))
        return
    fully_shard(model, mp_policy=policy(keep), ignored_params={model.extra} if ignored else None)
    with GatherProbe(model) as probe:
        model(torch.randn(2, 8)).float().sum().backward()
    assert probe.seen["extra"].dtype == EXTRAS[kind].dtype
    assert probe.seen["norm.weight"].dtype == fp32
    assert torch.equal(model.extra.full_tensor() if not ignored else model.extra, EXTRAS[kind])


def test_non_floating_parameter_cannot_be_mapped() -> None:
    model = WithExtras(torch.arange(6))
    with pytest.raises(
        ParamDtypeMapError, match=r"key 'extra' names a int64 parameter; .*ignored_params"
    ):
        fully_shard(model, mp_policy=policy({"extra": fp32}))


def test_trainable_complex_parameter_in_a_mixed_unit_rejected() -> None:
    model = WithExtras(torch.randn(6, dtype=torch.complex64), trainable=True)
    with pytest.raises(
        ParamDtypeMapError, match=r"trainable complex parameter 'extra' .* ignored_params"
    ):
        fully_shard(model, mp_policy=policy({"norm.weight": fp32, "norm.bias": fp32}))
