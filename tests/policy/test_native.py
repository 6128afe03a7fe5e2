"""torch 2.15: the exact-FQN map through torch's native ``param_dtype_override_fn``, and the
patched machinery for what it cannot express.

These tests check that torch itself calls the translated override fn for expressible maps, that
the other maps (third dtypes, float64, upcasts, mixed trainable storage) run through the patched
``_init_mp_dtypes`` and ``_get_param_all_gather_inputs`` with torch's own mixed-dtype reduction,
and (negative controls) how upstream 2.15 fails without each piece. One rank, in-process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from fsdp_precision import ParamDtypeMixedPrecisionPolicy
from fsdp_precision._releases import torch_release
from fsdp_precision.testing import CollectiveRecorder, GatherProbe

from tests.support.harness import unpatched
from tests.support.models import Block, bf16, fp16, fp32, fp64

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
    from fsdp_precision._policy import native as _native

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


# Maps the native override cannot express: a third dtype, float64, an upcast of a bf16-stored
# parameter, mixed trainable storage. Each: (how the model is stored, param_dtype, the map).
def _fp32_model() -> nn.Module:
    return Block()


def _bf16_model() -> nn.Module:
    return Block().to(bf16)


def _mixed_storage_model() -> nn.Module:
    model = Block().to(bf16)
    model.norm.float()
    return model


PATCHED = [
    pytest.param(_fp32_model, bf16, {"gate.weight": fp16}, id="fp16_in_bf16_unit"),
    pytest.param(_fp32_model, bf16, {"gate.weight": fp64}, id="float64"),
    pytest.param(_bf16_model, None, {"gate.weight": fp32}, id="upcast_of_bf16_storage"),
    pytest.param(
        _mixed_storage_model, None, {"norm.weight": fp32, "norm.bias": fp32}, id="mixed_storage"
    ),
]


def _run(model: nn.Module) -> tuple[GatherProbe, CollectiveRecorder]:
    with GatherProbe(model) as probe, CollectiveRecorder() as rec:
        model(torch.randn(2, 16).to(model.up.weight.dtype)).float().sum().backward()
    return probe, rec


@pytest.mark.parametrize(("make", "param_dtype", "dtype_map"), PATCHED)
def test_what_the_native_override_cannot_express_takes_the_patched_path(
    make, param_dtype, dtype_map, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsdp_precision._policy import native as _native

    calls: list[object] = []
    monkeypatch.setattr(_native, "native_policy", lambda *a: calls.append(a))  # never used here
    model = make()
    storage = {n: p.dtype for n, p in model.named_parameters()}
    fully_shard(model, mp_policy=policy(dtype_map, param_dtype=param_dtype))
    assert calls == []
    probe, rec = _run(model)
    for name, gathered in probe.seen.items():
        assert gathered.dtype == dtype_map.get(name, param_dtype or storage[name]), name
    # One rank issues no collectives; their count and bytes are checked on 2 and 4 ranks
    # (test_parity.py, test_adversarial.py).
    assert {c.dtype for c in rec.of("reduce_scatter")} <= {fp32}
    for name, param in model.named_parameters():
        assert param.grad.dtype == storage[name], name  # each gradient in its storage dtype


def test_negative_controls_without_the_replaced_functions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each replaced 2.15 function put back to torch's: the failure is upstream 2.15's own (the
    all-gather copy-in's control needs two ranks: test_parity.py)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    from fsdp_precision._patch import registry as _install

    with monkeypatch.context() as m:
        m.setattr(
            group.FSDPParamGroup,
            "_init_mp_dtypes",
            _install.original(group.FSDPParamGroup, "_init_mp_dtypes"),
        )
        model = _mixed_storage_model()
        fully_shard(model, mp_policy=policy({"norm.weight": fp32}, param_dtype=None))
        with pytest.raises(AssertionError, match="FSDP expects uniform original parameter dtype"):
            _run(model)
    # Without the construction wrap torch gets the map's override fn nowhere, and its own
    # override refuses the upcast by itself (the error the translation never lets through).
    with pytest.raises(ValueError, match="must return None, param_dtype, or the parameter's"):
        fully_shard(
            _bf16_model(),
            mp_policy=MixedPrecisionPolicy(
                param_dtype=None, param_dtype_override_fn=lambda p: fp32
            ),
        )


def test_negative_controls() -> None:
    # Frozen parameters may keep another storage dtype (2.15's own handling, native path), and
    # an entry equal to param_dtype is a no-op: both are accepted.
    model = Block()
    model.norm.to(bf16).requires_grad_(False)
    fully_shard(model, mp_policy=policy({"up.weight": bf16, "gate.weight": fp32}))
    with GatherProbe(model) as probe:
        model(torch.randn(2, 16)).float().sum().backward()
    assert probe.seen["gate.weight"].dtype == fp32 and probe.seen["up.weight"].dtype == bf16
    # Without the patch nothing translates the map: torch ignores it (as on every release; the
    # library's policy installs the patch when built, so torch alone is the control).
    del model, probe  # the removal refuses while a wrapped module holds a mapped policy
    with unpatched():
        plain = Block()
        fully_shard(plain, mp_policy=policy(KEEP))
        with GatherProbe(plain) as probe:
            plain(torch.randn(2, 16))
        assert probe.seen["norm.weight"].dtype == bf16  # the fp32 request was dropped
        del plain, probe


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
