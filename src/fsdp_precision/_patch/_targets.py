"""The upstream FSDP2 functions each implementation replaces or relies on.

Replaced: swapped out by the patch. Relied on: called by, or mirrored in, the replacements (or,
on 2.15, the native machinery the translated map runs through); a change to any of them could
change what the patch means, so each is hashed too. Every release module hashes exactly the
targets of its ``IMPLEMENTATION`` (``targets(module.IMPLEMENTATION)``).
"""

from __future__ import annotations

_P = "torch.distributed.fsdp._fully_shard."

#: Relied on by the construction wrapper every implementation shares (``_common``).
_CONSTRUCTION: tuple[str, ...] = (
    _P + "_fully_shard:fully_shard",
    _P + "_fsdp_state:FSDPState.init",
    _P + "_fsdp_param_group:FSDPParamGroup.__init__",
    "torch.distributed._composable_state:_insert_module_state",
)

REPLACED: tuple[str, ...] = (
    _P + "_fsdp_init:_init_param_group",
    _P + "_fsdp_param_group:FSDPParamGroup._init_mp_dtypes",
    _P + "_fsdp_collectives:_get_param_all_gather_inputs",
    _P + "_fsdp_collectives:foreach_reduce",
)

RELIED_ON: tuple[str, ...] = (
    _P + "_fully_shard:fully_shard",
    _P + "_fsdp_state:FSDPState.init",
    _P + "_fsdp_param_group:FSDPParamGroup.__init__",
    _P + "_fsdp_param_group:FSDPParamGroup.lazy_init",
    _P + "_fsdp_param_group:FSDPParamGroup.unshard",
    _P + "_fsdp_param_group:FSDPParamGroup.wait_for_unshard",
    _P + "_fsdp_param_group:FSDPParamGroup.post_backward",
    _P + "_fsdp_param_group:_get_param_module_infos",
    _P + "_fsdp_param:FSDPParam.init_dtype_attrs",
    _P + "_fsdp_param:FSDPParam.all_gather_inputs",
    _P + "_fsdp_param:FSDPParam.init_all_gather_outputs",
    _P + "_fsdp_param:FSDPParam.init_unsharded_param",
    _P + "_fsdp_param:FSDPParam.to_accumulated_grad_if_needed",
    _P + "_fsdp_param:FSDPParam.accumulate_unsharded_grad_if_needed",
    _P + "_fsdp_param:FSDPParam.to_sharded_dtensor",
    _P + "_fsdp_collectives:foreach_all_gather",
    _P + "_fsdp_collectives:_get_all_gather_input_metadatas",
    _P + "_fsdp_collectives:foreach_all_gather_copy_out",
    _P + "_fsdp_collectives:foreach_reduce_scatter_copy_in",
    _P + "_fsdp_collectives:chunk_cat",
    _P + "_fsdp_collectives:_get_gradient_divide_factors",
    _P + "_fsdp_collectives:_div_if_needed",
    _P + "_fsdp_common:_get_dim0_padded_size",
    _P + "_fsdp_common:_to_dtype_if_needed",
    "torch.distributed._composable_state:_insert_module_state",
)

#: torch 2.15: only the construction site is wrapped; the rest is torch's native per-parameter
#: override, whose every step is relied on.
REPLACED_V2_15: tuple[str, ...] = (_P + "_fsdp_init:_init_param_group",)

RELIED_ON_V2_15: tuple[str, ...] = _CONSTRUCTION + (
    _P + "_fsdp_api:MixedPrecisionPolicy._resolve_for_param",  # param_dtype_override_fn
    _P + "_fsdp_param_group:FSDPParamGroup._init_mp_dtypes",
    _P + "_fsdp_param_group:FSDPParamGroup.post_backward",
    _P + "_fsdp_param:FSDPParam.init_dtype_attrs",
    _P + "_fsdp_param:FSDPParam.all_gather_inputs",
    _P + "_fsdp_param:FSDPParam.init_unsharded_param",
    _P + "_fsdp_collectives:_get_param_all_gather_inputs",
    _P + "_fsdp_collectives:foreach_all_gather",
    _P + "_fsdp_collectives:_get_all_gather_input_metadatas",
    _P + "_fsdp_collectives:foreach_reduce",
    _P + "_fsdp_collectives:foreach_reduce_scatter_copy_in",
)

#: torch 2.11: the 2.13 targets, plus the compiled-autograd switch its replacements consult.
RELIED_ON_V2_11: tuple[str, ...] = RELIED_ON + (_P + "_fsdp_common:compiled_autograd_enabled",)

#: implementation module -> every target its release modules must hash (replaced first).
TARGETS: dict[str, tuple[str, ...]] = {
    "_impl_v2_11": REPLACED + RELIED_ON_V2_11,
    "_impl_v2_12": REPLACED + RELIED_ON,
    "_impl_v2_13": REPLACED + RELIED_ON,
    "_impl_v2_15": REPLACED_V2_15 + RELIED_ON_V2_15,
}


def targets(implementation: str) -> tuple[str, ...]:
    """The targets an implementation's release modules hash, e.g. ``targets("_impl_v2_13")``."""
    try:
        return TARGETS[implementation]
    except KeyError:
        known = ", ".join(sorted(TARGETS))
        raise ValueError(
            f"no target list for implementation {implementation!r}; known: {known}. Add one to "
            "fsdp_precision/_patch/_targets.py"
        ) from None
