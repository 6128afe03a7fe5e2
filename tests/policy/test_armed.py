"""No policy of the library's applies nowhere (issue 52): a ``ParamDtypeMixedPrecisionPolicy``
that needs the patch installs it when built or unpickled, refuses to be built on a torch the patch
cannot run on, and a unit built with it stops by name once the patch is removed. In a fresh process where nothing
applied the patch (one gloo rank, the harness's unpatched kind), the README's first level with its
``apply_param_dtype_map_patch()`` line forgotten."""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import fsdp_precision as fp
from fsdp_precision._policy import armed
from fsdp_precision._releases import release_traits

from tests.support.harness import collect_cases, distributed_suite

MAP = {"kept.weight": torch.float32, "kept.bias": torch.float32}


class Block(nn.Module):
    """A bf16 layer, then a kept layer whose caller casts for it (as Qwen3-MoE's router does)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.kept = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inner(x)
        return self.kept(x.to(self.kept.weight.dtype)).to(x.dtype)


def policy(**kwargs: Any) -> fp.ParamDtypeMixedPrecisionPolicy:
    return fp.ParamDtypeMixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, **kwargs
    )


def computed(mp_policy: fp.ParamDtypeMixedPrecisionPolicy) -> dict[str, str]:
    """The dtype each layer's weight computed in, through one training step of a fresh block."""
    torch.manual_seed(0)
    block = Block()
    seen: dict[str, str] = {}
    for name in ("inner", "kept"):
        layer = block.get_submodule(name)
        layer.register_forward_pre_hook(
            lambda m, _, name=name: seen.update({name: str(m.weight.dtype)})
        )
    fully_shard(block, mp_policy=mp_policy)
    block(torch.randn(2, 8)).float().sum().backward()
    return seen


BF16 = {"inner": "torch.bfloat16", "kept": "torch.bfloat16"}
KEPT = {"inner": "torch.bfloat16", "kept": "torch.float32"}


def case_control_without_arming_the_map_applies_nowhere() -> None:
    """Negative control: with construction not arming the patch (the library before issue 52),
    the same policy reaches torch as its plain policy and the kept layer computes in bf16."""
    assert not fp.is_param_dtype_map_patch_applied()
    with armed.disarmed():
        assert computed(policy(param_dtype_map=MAP)) == BF16
    assert not fp.is_param_dtype_map_patch_applied()


def case_building_a_mapped_policy_installs_the_patch() -> None:
    assert not fp.is_param_dtype_map_patch_applied()
    mapped = policy(param_dtype_map=MAP)
    assert fp.is_param_dtype_map_patch_applied()
    assert computed(mapped) == KEPT


def case_a_unit_run_after_the_patch_was_removed_stops_by_name() -> None:
    mapped = policy(param_dtype_map=MAP)
    torch.manual_seed(0)
    block = fully_shard(Block(), mp_policy=mapped)
    block(torch.randn(2, 8)).float().sum().backward()  # under the patch: runs
    fp.remove_param_dtype_map_patch()  # torch alone, asked for
    assert not fp.is_param_dtype_map_patch_applied()
    if release_traits().native_override:  # 2.15: torch's own override runs this map: it holds
        seen: dict[str, torch.dtype] = {}
        hook = block.kept.register_forward_pre_hook(lambda m, _: seen.update(w=m.weight.dtype))
        block(torch.randn(2, 8))
        hook.remove()
        assert seen == {"w": torch.float32}
    else:
        with pytest.raises(
            fp.PolicyNotAppliedError,
            match=r"this Block was wrapped by fully_shard with a param_dtype_map \(\{'kept.weight'"
            r": 'float32', 'kept.bias': 'float32'\}\), and remove_param_dtype_map_patch\(\) has "
            r"since removed the patch .* Call apply_param_dtype_map_patch\(\) before running it",
        ):
            block(torch.randn(2, 8))
    fp.apply_param_dtype_map_patch()
    block(torch.randn(2, 8)).float().sum().backward()  # the patch back: runs again
    plain = fully_shard(Block(), mp_policy=policy())  # no map: torch's path, no check
    fp.remove_param_dtype_map_patch()
    plain(torch.randn(2, 8))


def case_an_unpickled_policy_installs_the_patch() -> None:
    """What a spawned process receives (and what a Trainer's ``training_args.bin`` holds)."""
    data = pickle.dumps(policy(param_dtype_map=MAP))
    fp.remove_param_dtype_map_patch()
    assert not fp.is_param_dtype_map_patch_applied()
    loaded = pickle.loads(data)
    assert fp.is_param_dtype_map_patch_applied()
    assert loaded == policy(param_dtype_map=MAP)
    assert computed(loaded) == KEPT


def case_casts_alone_install_the_patch() -> None:
    fp.remove_param_dtype_map_patch()
    policy(module_casts={"kept": fp.ModuleCast(torch.float32, outputs=True)})
    assert fp.is_param_dtype_map_patch_applied()


def case_an_empty_map_is_torch_path_and_installs_nothing() -> None:
    fp.remove_param_dtype_map_patch()
    plain = policy()
    assert not fp.is_param_dtype_map_patch_applied()
    assert computed(plain) == BF16
    fp.remove_param_dtype_map_patch()  # a policy without a map never blocks the removal


def case_a_torch_the_patch_cannot_run_on_refuses_the_policy() -> None:
    fp.remove_param_dtype_map_patch()
    data = pickle.dumps(policy())  # no map: loads anywhere
    mapped = pickle.dumps(policy(param_dtype_map=MAP))
    fp.remove_param_dtype_map_patch()
    version = torch.__version__
    torch.__version__ = "2.16.0.dev20261009+cpu"  # type: ignore[assignment]
    try:
        with pytest.raises(fp.UnsupportedTorchError, match=r"2\.16"):
            policy(param_dtype_map=MAP)
        pickle.loads(data)
        with pytest.warns(
            RuntimeWarning,
            match=r"loaded a ParamDtypeMixedPrecisionPolicy .* "
            r"would apply nowhere",
        ):
            pickle.loads(mapped)  # read, e.g. from a training_args.bin, on another torch
    finally:
        torch.__version__ = version  # type: ignore[assignment]
    assert not fp.is_param_dtype_map_patch_applied()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pickle.loads(mapped).param_dtype_map == MAP  # installs, no warning


CASES = collect_cases(globals())
results_unpatched, test_case = distributed_suite(1, __name__, CASES, patch=False)
