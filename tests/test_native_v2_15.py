"""torch 2.15: the exact-FQN map through torch's native ``param_dtype_override_fn``.

On 2.15 the patch wraps only the construction site; these tests check that torch itself calls the
translated override fn, that what 2.15 cannot express is refused by name before anything is
sharded, and (negative controls) what happens without the translation. One rank, in-process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision import ParamDtypeMapError, ParamDtypeMixedPrecisionPolicy
from fsdp_precision._patch import torch_release
from fsdp_precision.testing import CollectiveRecorder, GatherProbe

from _models import Block, bf16, fp16, fp32, fp64

pytestmark = [
    pytest.mark.skipif(
        torch_release() != "2.15", reason="param_dtype_override_fn exists from torch 2.15 on"
    ),
    pytest.mark.usefixtures("world1"),
]

KEEP = {"norm.weight": fp32, "norm.bias": fp32, "gate.weight": fp32}


def policy(dtype_map, reduce_dtype=fp32, param_dtype=bf16) -> ParamDtypeMixedPrecisionPolicy:
    return ParamDtypeMixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, param_dtype_map=dtype_map
    )


def assert_untouched(model: nn.Module, before: dict[str, nn.Parameter]) -> None:
    assert not isinstance(model, FSDPModule)
    for name, param in model.named_parameters():
        assert param is before[name] and not isinstance(param, DTensor), name
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks


def test_torch_calls_the_translated_override_fn(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_precision._patch import _native

    seen: list[tuple[torch.Size, torch.dtype | None]] = []
    original_call = _native.ParamDtypeOverride.__call__

    def spy(self, param):  # records what torch asks and what the map answers
        answer = original_call(self, param)
        seen.append((param.shape, answer))
        return answer

    monkeypatch.setattr(_native.ParamDtypeOverride, "__call__", spy)
    model = Block()
    fully_shard(model, mp_policy=policy(KEEP))
    # Once per managed parameter, at fully_shard time, by torch's FSDPParamGroup.__init__.
    assert len(seen) == len(list(model.parameters()))
    assert sorted(str(d) for _, d in seen) == sorted(
        ["torch.float32"] * 3 + ["None"] * (len(seen) - 3)
    )
    with GatherProbe(model) as probe, CollectiveRecorder() as rec:
        model(torch.randn(2, 16)).float().sum().backward()
    for name, gathered in probe.seen.items():
        assert gathered.dtype == KEEP.get(name, bf16), (name, gathered.dtype)
    assert {c.dtype for c in rec.of("reduce_scatter")} <= {fp32}
    for name, param in model.named_parameters():
        assert param.grad.dtype == fp32, name


def test_map_equals_a_hand_written_override_fn() -> None:
    """Bitwise: the translated map == torch's own policy with the same override by hand."""
    torch.manual_seed(0)
    ours, ref = Block(), Block()
    ref.load_state_dict(ours.state_dict())
    keep_ids = {id(ref.norm.weight), id(ref.norm.bias), id(ref.gate.weight)}
    fully_shard(ours, mp_policy=policy(KEEP))
    native = MixedPrecisionPolicy(
        param_dtype=bf16,
        reduce_dtype=fp32,
        param_dtype_override_fn=lambda p: fp32 if id(p) in keep_ids else None,
    )
    fully_shard(ref, mp_policy=native)
    x = torch.randn(3, 16)
    out_ours, out_ref = ours(x), ref(x)
    assert out_ours.dtype == out_ref.dtype and torch.equal(out_ours, out_ref)
    out_ours.float().sum().backward()
    out_ref.float().sum().backward()
    for (name, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters()):
        assert torch.equal(a.grad.to_local(), b.grad.to_local()), name


INEXPRESSIBLE = [
    (
        {"norm.weight": fp16},
        r"param_dtype_map entries \{'norm\.weight': torch\.float16\} cannot be expressed on "
        r"torch 2\.15\.\S+: its native MixedPrecisionPolicy\.param_dtype_override_fn allows only "
        r"param_dtype \(torch\.bfloat16\) or the parameter's storage dtype \('norm\.weight' is "
        r"stored in torch\.float32\)\. Store those parameters in the mapped dtype, give them "
        r"their own fully_shard unit with that param_dtype, or use torch 2\.11-2\.14",
    ),
    ({"norm.bias": fp64}, r"entries \{'norm\.bias': torch\.float64\} cannot be expressed"),
    (
        {"gate.weight": torch.float8_e4m3fn, "norm.weight": fp32},
        r"entries \{'gate\.weight': torch\.float8_e4m3fn\} cannot be expressed",
    ),
]


@pytest.mark.parametrize(("dtype_map", "message"), INEXPRESSIBLE)
def test_inexpressible_maps_are_refused_by_name(dtype_map, message) -> None:
    model = Block()
    before = dict(model.named_parameters())
    with pytest.raises(ParamDtypeMapError, match=message):
        fully_shard(model, mp_policy=policy(dtype_map))
    assert_untouched(model, before)
    fully_shard(model, mp_policy=policy(KEEP))  # an expressible map on the same model works
    assert isinstance(model.norm.weight, DTensor)


def test_mixed_trainable_storage_is_refused_by_name() -> None:
    model = Block().to(bf16)
    model.norm.float()
    before = dict(model.named_parameters())
    with pytest.raises(
        ParamDtypeMapError,
        match=r"trainable parameters of one fully_shard unit have mixed storage dtypes "
        r"\('norm\.weight' is stored in torch\.float32, 'up\.weight' is stored in "
        r"torch\.bfloat16\); torch 2\.15\.\S+ requires one storage dtype per unit",
    ):
        fully_shard(model, mp_policy=policy({"norm.weight": fp32}, param_dtype=None))
    assert_untouched(model, before)


def test_negative_controls() -> None:
    # Frozen parameters may keep another storage dtype (2.15 only checks trainable ones), and
    # an entry equal to param_dtype is a no-op: both are accepted.
    model = Block()
    model.norm.to(bf16).requires_grad_(False)
    fully_shard(model, mp_policy=policy({"up.weight": bf16, "gate.weight": fp32}))
    with GatherProbe(model) as probe:
        model(torch.randn(2, 16)).float().sum().backward()
    assert probe.seen["gate.weight"].dtype == fp32 and probe.seen["up.weight"].dtype == bf16
    # Without the patch nothing translates the map: torch ignores it (as on every release).
    fp.remove_param_dtype_map_patch()
    try:
        plain = Block()
        fully_shard(plain, mp_policy=policy(KEEP))
        with GatherProbe(plain) as probe:
            plain(torch.randn(2, 16))
        assert probe.seen["norm.weight"].dtype == bf16  # the fp32 request was dropped
    finally:
        fp.apply_param_dtype_map_patch()


def test_map_and_native_override_fn_together_rejected() -> None:
    with pytest.raises(ValueError, match=r"takes param_dtype_map or param_dtype_override_fn, not"):
        ParamDtypeMixedPrecisionPolicy(
            param_dtype=bf16,
            param_dtype_map={"norm.weight": fp32},
            param_dtype_override_fn=lambda p: None,
        )
    # Either alone is fine; torch's own replace() (FSDPState.init) keeps the subclass valid.
    alone = ParamDtypeMixedPrecisionPolicy(param_dtype=bf16, param_dtype_override_fn=lambda p: None)
    assert alone.param_dtype_map == {}
    model = Block()
    fully_shard(model, mp_policy=ParamDtypeMixedPrecisionPolicy(param_dtype=bf16))
    model(torch.randn(2, 16))
