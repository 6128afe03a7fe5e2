"""Pieces every implementation shares verbatim: the install registry and the construction wrap.

All of it relies only on ``_init_param_group(state, params, modules, mesh_info,
post_forward_mesh_info, device, shard_placement_fn, mp_policy, offload_policy, ...)`` (the same
leading parameters on every supported release; 2.12 appended ``reshard_after_forward``; each
release module hashes it) and on the composable-state
registration that ``fully_shard`` does before it (``FSDPState.init``, also hashed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.nn as nn
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
from torch.distributed._composable_state import _module_state_mapping
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_precision._policy import ParamDtypeMixedPrecisionPolicy

#: Index of ``mp_policy`` in ``_init_param_group``'s positional arguments after
#: ``(state, params, modules)``: (mesh_info, post_forward_mesh_info, device, shard_placement_fn,
#: mp_policy, offload_policy[, reshard_after_forward (2.12+)]).
_MP_POLICY_INDEX = 4


class Replacements:
    """Swap attributes of torch modules or classes in and out, remembering the originals."""

    def __init__(self) -> None:
        self.originals: dict[tuple[Any, str], Any] = {}

    def original(self, owner: Any, name: str) -> Any:
        """The attribute ``owner.name`` held before :meth:`install`."""
        return self.originals[(owner, name)]

    def install(self, replacements: Sequence[tuple[Any, str, Any]]) -> None:
        """Swap every ``(owner, name, replacement)`` in; idempotent."""
        if self.originals:
            return
        for owner, name, _ in replacements:
            self.originals[(owner, name)] = owner.__dict__[name]
        for owner, name, replacement in replacements:
            setattr(owner, name, replacement)

    def uninstall(self) -> None:
        """Restore the originals; idempotent."""
        for (owner, name), original in list(self.originals.items()):
            setattr(owner, name, original)
        self.originals.clear()

    def is_installed(self, replacements: Sequence[tuple[Any, str, Any]]) -> bool:
        """Whether every replacement is in place."""
        return bool(self.originals) and all(
            owner.__dict__[name] is replacement for owner, name, replacement in replacements
        )


def has_map(policy: MixedPrecisionPolicy) -> bool:
    """Whether ``policy`` is a ``ParamDtypeMixedPrecisionPolicy`` with a non-empty map."""
    return isinstance(policy, ParamDtypeMixedPrecisionPolicy) and len(policy.param_dtype_map) > 0


def bind_mp_policy(args: Sequence[Any], kwargs: dict[str, Any]) -> MixedPrecisionPolicy:
    """``mp_policy`` from ``_init_param_group``'s arguments after ``(state, params, modules)``."""
    if "mp_policy" in kwargs:
        return kwargs["mp_policy"]  # type: ignore[no-any-return]
    return args[_MP_POLICY_INDEX]  # type: ignore[no-any-return]


def rebind_mp_policy(
    args: Sequence[Any], kwargs: dict[str, Any], policy: MixedPrecisionPolicy
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The same arguments with ``mp_policy`` replaced."""
    if "mp_policy" in kwargs:
        return tuple(args), {**kwargs, "mp_policy": policy}
    new_args = list(args)
    new_args[_MP_POLICY_INDEX] = policy
    return tuple(new_args), kwargs


def undo_state_init(state: Any, modules: tuple[nn.Module, ...]) -> None:
    """Undo what ``fully_shard`` did before ``_init_param_group``, so the call can be retried.

    Parameters are untouched at this point; only the FSDP state, its registration and the forward
    hooks that ``FSDPState.init`` added are removed.
    """
    for name in ("_pre_forward_hook_handle", "_post_forward_hook_handle"):
        handle = getattr(state, name, None)
        if handle is not None:
            handle.remove()
    for module in modules:
        _module_state_mapping.pop(module, None)
        all_state = module.__dict__.get(STATE_KEY)
        if isinstance(all_state, dict):
            for func in [f for f in all_state if getattr(f, "__name__", "") == "fully_shard"]:
                del all_state[func]
        registry = module.__dict__.get(REGISTRY_KEY)
        if isinstance(registry, dict):
            registry.pop("fully_shard", None)
