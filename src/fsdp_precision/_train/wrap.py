"""``wrap_model_for_training``: FSDP2 units torch can run, exact precision maps, meshes, DDP."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.parallel import DistributedDataParallel

from fsdp_precision._advise.advice import PrecisionAdvice
from fsdp_precision._advise.usage import param_usage
from fsdp_precision._base.devices import rank_device
from fsdp_precision._edges.checkpoint.state import load_model_state_dict
from fsdp_precision._plan.compile import compile_param_dtype_maps
from fsdp_precision._plan.plan import PrecisionPlan
from fsdp_precision._plan.units import choose_units
from fsdp_precision._train.config import DistributedConfig

__all__ = [
    "make_grad_scaler",
    "plan_model_for_training",
    "wrap_model_for_training",
]

logger = logging.getLogger(__name__)


def plan_model_for_training(
    model: nn.Module,
    config: DistributedConfig,
    *,
    world_size: int | None = None,
    example_inputs: Any = None,
    advice: PrecisionAdvice | None = None,
) -> PrecisionPlan:
    """The units and exact precision maps ``wrap_model_for_training`` would use, unapplied.

    Units follow ``config.fsdp_auto_wrap_policy`` and are made only where torch can run them
    (see :func:`auto_wrap_units`; ``example_inputs``, default the model's ``dummy_inputs``, feed
    the traced forward that finds parameters used outside their unit, and the precision
    advisor's). ``explain()`` lists the modules refused as units and why. Its collective
    counts follow the config's knobs:
    ``fsdp_reshard_after_forward`` (``True`` is torch's ``reshard_after_forward=None``: every
    unit but the root; ``False``: none) and the all-reduce across replicas of ``"hsdp"``.
    ``advice``: the advisor's findings, found already (as :func:`compile_param_dtype_maps`).
    """
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    choice = choose_units(
        model,
        min_params=config.fsdp_auto_wrap_min_params,
        policy=config.fsdp_auto_wrap_policy,
        block_classes=config.fsdp_transformer_block_classes,
        usage=param_usage(model, example_inputs),
    )
    units = list(choice.units)
    shard = world_size
    hsdp = config.parallel_strategy == "hsdp"
    if hsdp and config.hsdp_replicate_size:
        shard = max(1, world_size // config.hsdp_replicate_size)
    plan = compile_param_dtype_maps(
        model,
        config.precision(),
        units,
        layout=config.fsdp_layout,
        world_size=shard,
        # None is torch's heuristic for True: every unit but the root, whose parameters backward
        # needs first. An explicit True would re-gather the root in backward.
        reshard_after_forward=None if config.fsdp_reshard_after_forward else False,
        hsdp=hsdp,
        unknown_torch=config.fsdp_unknown_torch,
        example_inputs=example_inputs,  # the precision advisor's too
        advice=advice,
    )
    return replace(plan, unit_choice=choice)


def _mesh(config: DistributedConfig, device: torch.device) -> Any:
    world = dist.get_world_size()
    if config.parallel_strategy == "fsdp":
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    replicas = config.hsdp_replicate_size
    assert replicas is not None  # validated by DistributedConfig
    if world % replicas:
        raise ValueError(
            f"DistributedConfig.hsdp_replicate_size={replicas} does not divide the world size "
            f"{world}; use a divisor of {world}"
        )
    return init_device_mesh(
        device.type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
    )


def wrap_model_for_training(
    model: nn.Module,
    config: DistributedConfig,
    *,
    full_state_dict: Mapping[str, torch.Tensor] | None = None,
    example_inputs: Any = None,
) -> nn.Module:
    """Wrap ``model`` for training as ``config`` says; returns the model to train.

    ``"fsdp"``/``"hsdp"``: units by size or by transformer block, only where torch can run them
    (see :func:`auto_wrap_units`; ``example_inputs`` as in :func:`plan_model_for_training`),
    the preset expanded to exact per-unit policies (rules and the model's keep declarations
    included), 0-dim parameters replicated with averaged gradients, CPU offload, a 1-D or 2-D
    mesh. The whole plan is checked before the first ``fully_shard``: a refused plan leaves the
    model untouched. ``"ddp"``: ``DistributedDataParallel``. ``"none"``: the model.

    Large models: build the model on the meta device on every rank and pass ``full_state_dict``
    on rank 0 (any value, e.g. ``{}``, elsewhere); after sharding, every rank allocates only its
    shards and receives them from rank 0, so no rank holds more than its share plus one tensor.

    Raises ``RuntimeError`` naming what to do when no process group is initialized (except for
    ``"none"``), and ``ValueError`` for a meta-device model without ``full_state_dict``.
    """
    if not isinstance(config, DistributedConfig):
        raise TypeError(f"config must be a DistributedConfig, got {type(config).__name__}")
    if config.parallel_strategy == "none":
        return model
    if not dist.is_initialized():
        raise RuntimeError(
            f"parallel_strategy={config.parallel_strategy!r} needs a process group, and none is "
            "initialized. Launch with torchrun (torchrun --nproc_per_node N train.py) and call "
            "torch.distributed.init_process_group() first; for one CPU process: "
            "init_process_group('gloo', rank=0, world_size=1, init_method='tcp://127.0.0.1:29500')"
        )
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and full_state_dict is None:
        raise ValueError(
            "the model is on the meta device but no full_state_dict was given; pass the full "
            "state dict on rank 0 (and {} on the other ranks) so that each rank receives its "
            "shards. reset_parameters() after to_empty() would give every rank identical shards"
        )
    device = rank_device()  # the group's backend for CUDA; LOCAL_RANK made current
    if config.parallel_strategy == "ddp":
        model = model.to(device)
        return DistributedDataParallel(
            model, device_ids=[device.index] if device.index is not None else None
        )

    plan = plan_model_for_training(model, config, example_inputs=example_inputs)
    # The plan passes its reshard_after_forward (from the config) to every call.
    kwargs: dict[str, Any] = {"mesh": _mesh(config, device)}
    if config.fsdp_cpu_offload:
        # Pinned host memory needs an accelerator; on CPU-only runs there is nothing to pin.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type != "cpu")
    if not on_meta and device.type != "cpu":
        model.to(device)
    plan.apply(**kwargs)
    if config.compile_units != "off":
        _compile_units(plan, config)
    if dist.get_rank() == 0:
        totals = plan.totals()
        logger.info(
            "wrapped %s: %d FSDP units, %d all-gathers, %d reduce-scatters and %d all-reduces "
            "per step",
            type(model).__name__,
            totals["units"],
            totals["all_gathers_per_step"],
            totals["reduce_scatters_per_step"],
            totals["all_reduces_per_step"],
        )
    if on_meta:
        _fill_from_rank0(model, full_state_dict or {}, device, config.fsdp_cpu_offload)
    return model


def _compile_units(plan: PrecisionPlan, config: DistributedConfig) -> None:
    """``module.compile`` of every unit but the root (each module of a grouped call), as
    torchtitan's ``apply_compile`` compiles its blocks: FSDP's hooks run around each compiled
    forward, the dtypes kept inside it are part of the graph."""
    for unit in plan.units:
        if unit.is_root:
            continue
        for module in unit.modules:
            module.compile(backend=config.compile_units, fullgraph=config.compile_fullgraph)


def _fill_from_rank0(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor], device: torch.device, offload: bool
) -> None:
    model.to_empty(device="cpu" if offload else device)
    # Validated on rank 0, each tensor cast to the dtype its shard holds (a kept tied weight,
    # an fp32 buffer of a bf16 model), the module versions (_metadata) on every rank.
    load_model_state_dict(model, state_dict, "full")


def make_grad_scaler(config: DistributedConfig, **kwargs: Any) -> Any:
    """A loss scaler where the config computes in fp16 (the ``"fp16"`` preset, or rules with
    ``param_dtype=torch.float16``); ``None`` for bf16 and fp32.

    FSDP's ``ShardedGradScaler``: unscaling checks every rank's gradient shards and all-reduces
    the overflow flag, so an overflow on any rank skips the step on every rank alike.
    """
    if config.precision().param_dtype != torch.float16:
        return None
    return ShardedGradScaler(device=rank_device().type, **kwargs)
