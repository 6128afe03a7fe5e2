"""A torch the patch does not know (simulated: another version string, or one changed upstream
source) never stops a run that asks to go on: by default the refusal names what differs and the
option; with ``unknown_torch="public_api"`` the plan, ``model_policy`` and
``wrap_model_for_training`` train with separate units (no patch), bitwise the patched run, and
warn with the extra collectives. On 2 CPU ranks (gloo)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import fsdp_precision as fp
from fsdp_precision._releases import release_module
from fsdp_precision._releases.status import patch_status

from tests.support.harness import collect_cases, distributed_suite
from tests.support.models import Net, inputs, local, loss_of

RULES = fp.PrecisionRules(rules=(fp.Glob("*norm.*"), fp.Glob("*gate.weight")), advice="off")
CHANGED = "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup._init_mp_dtypes"


def train(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        loss = loss_of(model(inputs(step)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, [local(p).detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


def assert_bitwise(a: tuple[list[torch.Tensor], list[torch.Tensor]], b: tuple[list, list]) -> None:
    for x, y in zip(a[0] + a[1], b[0] + b[1], strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)


def net() -> Net:
    torch.manual_seed(0)
    return Net()


def by_plan(model: Net, **kwargs: object) -> fp.PrecisionPlan:
    return fp.compile_param_dtype_maps(model, RULES, [*model.blocks, model], **kwargs)  # type: ignore[arg-type]


def by_model_policy(model: Net, **kwargs: object) -> Net:
    policy = fp.model_policy(model, RULES, **kwargs)  # type: ignore[arg-type]
    for unit in (*model.blocks, model):
        fully_shard(unit, mp_policy=policy)
    return model


def by_wrap(model: Net, **kwargs: object) -> nn.Module:
    config = fp.DistributedConfig(
        fsdp_mixed_precision=RULES,
        fsdp_auto_wrap_min_params=500,  # a unit per block (~900 parameters), kept ones inside
        **kwargs,  # type: ignore[arg-type]
    )
    return fp.wrap_model_for_training(model, config)


PATHS: dict[str, Callable[..., nn.Module]] = {
    "plan": lambda m, **kw: by_plan(m, **kw).apply(),
    "model_policy": by_model_policy,
    "wrap_model_for_training": by_wrap,
}
OPTION = {
    "plan": {"unknown_torch": "public_api"},
    "model_policy": {"unknown_torch": "public_api"},
    "wrap_model_for_training": {"fsdp_unknown_torch": "public_api"},
}


@contextmanager
def unknown(how: str) -> Iterator[None]:
    """The patch removed and torch made unknown: another version, or one changed source."""
    fp.remove_param_dtype_map_patch()
    version, sources = torch.__version__, release_module().SOURCES
    saved = sources[CHANGED]
    try:
        if how == "version":
            torch.__version__ = "2.16.0.dev20261009+cpu"  # type: ignore[assignment]
        else:
            sources[CHANGED] = "0" * 64
        yield
    finally:
        torch.__version__ = version  # type: ignore[assignment]
        sources[CHANGED] = saved
        fp.apply_param_dtype_map_patch()


@contextmanager
def warnings_logged() -> Iterator[list[str]]:
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("fsdp_precision")
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


def _case(how: str) -> None:
    patched = {path: train(make(net())) for path, make in PATHS.items()}
    with unknown(how):
        status = patch_status()
        assert not status.usable
        if how == "version":
            assert "2.16.0.dev20261009+cpu (release 2.16) is not a supported release" in (
                status.reason()
            )
            default = (fp.UnsupportedTorchError, r"no patch for torch 2\.16\.0\.dev.*unknown_torch")
        else:
            assert len(status.differing) == 1 and status.differing[0].startswith(f"{CHANGED} (")
            count = len(release_module().SOURCES)
            default = (
                fp.PatchIntegrityError,
                rf"1 of the {count} .*_init_mp_dtypes.*unknown_torch",
            )
        for path, make in PATHS.items():
            with pytest.raises(default[0], match=default[1]):  # the default refuses, naming why
                make(net())
            with warnings_logged() as seen:
                run = train(make(net(), **OPTION[path]))
            assert_bitwise(run, patched[path])  # the public-API layout, bitwise the patched one
            if path != "model_policy":  # the plan's warning: rank 0 logs it
                assert any("more all-gathers" in s for s in seen) or torch.distributed.get_rank()
        plan = by_plan(net(), unknown_torch="public_api")
        assert plan.fallback is not None and "planned the public-API layout" in plan.fallback
        assert plan.explain().splitlines()[2].startswith("public-API layout: ")
        assert any(u.separate_unit for u in plan.units)


def case_a_release_the_patch_does_not_know() -> None:
    _case("version")


def case_a_release_with_one_changed_upstream_function() -> None:
    _case("source")


CASES = collect_cases(globals())

results, test_unknown_release = distributed_suite(2, __name__, CASES)


def test_the_option_takes_only_its_values() -> None:
    with pytest.raises(
        ValueError, match=r"unknown_torch must be 'refuse' or 'public_api', got 'go'"
    ):
        fp.compile_param_dtype_maps(net(), RULES, unknown_torch="go")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fsdp_unknown_torch is 'go'; use 'refuse' or"):
        fp.DistributedConfig(fsdp_unknown_torch="go")  # type: ignore[arg-type]
