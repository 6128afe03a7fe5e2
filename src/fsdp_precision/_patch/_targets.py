"""The upstream FSDP2 functions the 2.13-line patch replaces or relies on.

Replaced: swapped out by the patch. Relied on: called by, or mirrored in, the replacements; a
change to any of them could change what the patch means, so each is hashed too.
"""

from __future__ import annotations

_P = "torch.distributed.fsdp._fully_shard."

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
