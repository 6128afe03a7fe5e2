"""The demo's reference: the same model wrapped the public-API way, every module holding kept
parameters its own FSDP unit (what users do without this library). Until the separate-units
builder lands in :mod:`fsdp_precision.testing`, the demo builds it here."""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp_precision._plan import PrecisionPlan

__all__ = ["wrap_reference"]


def wrap_reference(ref: nn.Module, plan: PrecisionPlan, names: dict[int, str]) -> str | None:
    """Wrap ``ref`` the public-API way: every module holding kept parameters its own unit with
    ``param_dtype`` = their compute dtype (``None`` for their storage dtype) and no input cast,
    then the planned units with plain policies. Returns why it cannot, or ``None``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kept: dict[str, torch.dtype] = {}
    storage: dict[str, torch.dtype] = {}
    for unit in plan.units:
        for p in unit.params:
            for fqn in (p.fqn, *p.aliases):
                storage[fqn] = p.storage
                if p.rule != "default":
                    kept[fqn] = p.compute
    owners: dict[str, torch.dtype] = {}
    for fqn, dtype in kept.items():
        module = fqn.rpartition(".")[0]
        inside = [f for f in storage if f.startswith(module + ".") or not module]
        if any(kept.get(f) != dtype for f in inside):
            return (
                f"separate units cannot express this map ({module or 'the root'} also holds "
                "parameters in another dtype)"
            )
        owners[module] = dtype
    unit_modules = {names[id(m)] for u in plan.units for m in u.modules}
    for module, dtype in owners.items():
        if module in unit_modules:
            continue  # an all-kept unit: its planned policy below keeps it
        same = all(storage[f] == dtype for f in kept if f.startswith(module + "."))
        policy = MixedPrecisionPolicy(
            param_dtype=None if same else dtype,
            reduce_dtype=torch.float32,
            cast_forward_inputs=False,
        )
        fully_shard(ref.get_submodule(module), mp_policy=policy)
    for unit in plan.units:
        modules = [ref.get_submodule(names[id(m)]) for m in unit.modules]
        name = names[id(unit.modules[0])]
        param_dtype = owners.get(name, unit.policy.param_dtype)
        if name in owners and all(storage[f] == param_dtype for f in kept if f.startswith(name)):
            param_dtype = None
        policy = MixedPrecisionPolicy(
            param_dtype=param_dtype,
            reduce_dtype=unit.policy.reduce_dtype,
            output_dtype=unit.policy.output_dtype,
            cast_forward_inputs=unit.policy.cast_forward_inputs,
        )
        fully_shard(modules if len(modules) > 1 else modules[0], mp_policy=policy)
    return None
