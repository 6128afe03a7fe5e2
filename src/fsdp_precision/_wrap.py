"""``wrap_model_for_training``: size-based FSDP2 units, exact precision maps, meshes, DDP."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_precision._compile import compile_param_dtype_maps
from fsdp_precision._config import DistributedConfig
from fsdp_precision._records import PrecisionPlan

__all__ = [
    "auto_wrap_units",
    "make_grad_scaler",
    "plan_model_for_training",
    "wrap_model_for_training",
]

logger = logging.getLogger(__name__)


def _no_split_names(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def auto_wrap_units(model: nn.Module, min_params: int) -> list[nn.Module]:
    """Bottom-up size-based units, in ``fully_shard`` order (innermost first, the root last).

    A module becomes a unit when the parameters under it that no child unit took reach
    ``min_params``. Modules whose class is declared in any ``_no_split_modules`` are never split
    (no unit inside them); a module is never a unit when one of its parameters is tied to a
    module outside it (torch cannot shard a parameter across units); containers (``ModuleList``,
    ``ModuleDict``, ``ParameterList``, ``ParameterDict``) are never units (nobody calls them, so
    their parameters would never be gathered). What they hold stays with the parent.
    """
    if min_params < 0:
        raise ValueError(f"min_params must be >= 0, got {min_params}")
    no_split = _no_split_names(model)
    owners: dict[int, set[int]] = {}
    numel: dict[int, int] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), set()).add(id(module))
                numel[id(param)] = param.numel()

    units: list[nn.Module] = []
    assigned: set[int] = set()

    def subtree(module: nn.Module) -> tuple[set[int], set[int]]:
        modules = {id(m) for m in module.modules()}
        params = {pid for pid, own in owners.items() if own & modules}
        return modules, params

    def visit(module: nn.Module, is_root: bool) -> set[int]:
        # Containers are never called, so FSDP's hooks would never gather their parameters:
        # what they hold belongs to the module that reads it.
        container = isinstance(
            module, (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
        )
        if type(module).__name__ in no_split and not is_root:
            remaining = subtree(module)[1]
        else:
            remaining = {id(p) for p in module._parameters.values() if p is not None}
            for child in module.children():
                remaining |= visit(child, False)
        remaining -= assigned
        if is_root or container or not remaining:
            return remaining
        if sum(numel[pid] for pid in remaining) < min_params:
            return remaining
        modules, _ = subtree(module)
        if any(not owners[pid] <= modules for pid in remaining):  # tied outside: not a unit
            return remaining
        units.append(module)
        assigned.update(remaining)
        return set()

    visit(model, True)
    units.append(model)
    return units


def plan_model_for_training(
    model: nn.Module, config: DistributedConfig, *, world_size: int | None = None
) -> PrecisionPlan:
    """The units and exact precision maps ``wrap_model_for_training`` would use, unapplied.

    Its collective counts follow the config's knobs: ``fsdp_reshard_after_forward`` (``True`` is
    torch's ``reshard_after_forward=None``: every unit but the root; ``False``: none) and the
    all-reduce across replicas of ``"hsdp"``.
    """
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    units = auto_wrap_units(model, config.fsdp_auto_wrap_min_params)
    shard = world_size
    hsdp = config.parallel_strategy == "hsdp"
    if hsdp and config.hsdp_replicate_size:
        shard = max(1, world_size // config.hsdp_replicate_size)
    return compile_param_dtype_maps(
        model,
        config.precision(),
        units,
        world_size=shard,
        # None is torch's heuristic for True: every unit but the root, whose parameters backward
        # needs first. An explicit True would re-gather the root in backward.
        reshard_after_forward=None if config.fsdp_reshard_after_forward else False,
        hsdp=hsdp,
    )


def _device() -> torch.device:
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _mesh(config: DistributedConfig, device: torch.device) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

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
) -> nn.Module:
    """Wrap ``model`` for training as ``config`` says; returns the model to train.

    ``"fsdp"``/``"hsdp"``: bottom-up size-based units (see :func:`auto_wrap_units`), the preset
    expanded to exact per-unit policies (rules and the model's keep declarations included), CPU
    offload, a 1-D or 2-D mesh. ``"ddp"``: ``DistributedDataParallel``. ``"none"``: the model.

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
    device = _device()
    if config.parallel_strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(device)
        return DistributedDataParallel(
            model, device_ids=[device.index] if device.index is not None else None
        )

    from torch.distributed.fsdp import CPUOffloadPolicy

    plan = plan_model_for_training(model, config)
    # The plan passes its reshard_after_forward (from the config) to every call.
    kwargs: dict[str, Any] = {"mesh": _mesh(config, device)}
    if config.fsdp_cpu_offload:
        # Pinned host memory needs an accelerator; on CPU-only runs there is nothing to pin.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type != "cpu")
    if not on_meta and device.type != "cpu":
        model.to(device)
    plan.apply(**kwargs)
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


def _fill_from_rank0(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor], device: torch.device, offload: bool
) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device="cpu" if offload else device)
    set_model_state_dict(
        model,
        dict(state_dict),
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )


def make_grad_scaler(config: DistributedConfig, **kwargs: Any) -> Any:
    """A loss scaler for ``fsdp_mixed_precision="fp16"`` (``None`` for bf16 and fp32).

    FSDP's ``ShardedGradScaler``: unscaling checks every rank's gradient shards and all-reduces
    the overflow flag, so an overflow on any rank skips the step on every rank alike.
    """
    if config.fsdp_mixed_precision != "fp16":
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    device = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    return ShardedGradScaler(device=device, **kwargs)
