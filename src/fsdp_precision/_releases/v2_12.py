"""torch 2.12: guarded by the sources of torch 2.12.1+cu130.

2.12 introduced per-parameter meshes (a list of groups), ``requires_grad`` kept by ``FSDPParam``
and the non-floating clamp, and removed the compiled-autograd branches; ``foreach_reduce`` still
returns six values. The other relied-on changes up to 2.13 (``FSDPParamGroup.__init__``/
``lazy_init``/``post_backward``: reduce-scatter buffer recycling and unused-parameter zero
gradients; ``init_all_gather_outputs``: ``force_recreate``; ``_get_gradient_divide_factors``:
PREMUL_SUM construction) do not change what the patch does.
"""

from __future__ import annotations

from fsdp_precision._releases.traits import ReleaseTraits

TORCH_RELEASE = "2.12"

#: Where this release's FSDP2 differs from 2.13's (see ``ReleaseTraits`` for each field).
TRAITS = ReleaseTraits(
    foreach_reduce_results=6,
)

SOURCES: dict[str, str] = {
    "torch.distributed.fsdp._fully_shard._fsdp_init:_init_param_group": "b1b111db8b1ce04923dda06c7a4a01131dec08eddd62442675b00c5aa1cb4ab1",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup._init_mp_dtypes": "07716440019cc2c1e782fc013adedba27e561a3de74a2ea630c962e81e113ea5",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_param_all_gather_inputs": "c6b0c0f074dc25c46586f7e695cbc29c3070067390dc33ca093a7b674fbe316d",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_reduce": "92991a5ffbfe555a3524097f2a67d9263e8ca68c2eba970b59b9ce9e97b35cad",
    "torch.distributed.fsdp._fully_shard._fully_shard:fully_shard": "c921dd4e68cacf46dc76cb97a790db29a883c551ac8f05e3be602196f5b3ee38",
    "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState.init": "d6a4697dfa6bf8163e767306fbc2ab9d5c1712c80c4e0e615c47f0b951599840",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.__init__": "8dcdb9c77bb1e8c1cdecb1b77ca5d5b67f8f64e703f7c1c73f13a980ffffbd13",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.lazy_init": "3408f4fa5aa360f499e8d0748ab28134bf1706c7c24bd732aec73124f5e14914",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.unshard": "a2ae557445de36000af35082b4024f69eabb792e2971c2005d1bcfd3e0224a8c",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.wait_for_unshard": "bcb104e8f8161bc766f2b0d57690f7ee47dd0b6ceca8fc7fa9192f18b92a0f0c",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.post_backward": "e5e8ce1f969eba1c09c34f9d3763b0c2fc507256cdb9fbb2361ceeffd3a30ffc",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:_get_param_module_infos": "78e81a2f40d01896563f2eaa6328ca12414eafaccb7f2008fc6c4ec1d2593de1",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.init_dtype_attrs": "135a4416af1a1c55020e1c26b9d89974e434fd9cc62a64764a557583ffe7a871",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.all_gather_inputs": "557221346774c69c66488ec8c9300f20eb2d1c8ba6521e9fc0233d6b866d27cc",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.init_all_gather_outputs": "b8f63117f75ac034bd450d5acb8dabc2d6addb4a2309bbeaf4c895b34f32340c",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.init_unsharded_param": "4b263a549d0bc59951fa083b0c2fcf3483b2e89f291411c6e92a842e44206043",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.to_accumulated_grad_if_needed": "9ae47f4abbfcbb214c4096fd11c174e86baf33d5f3d5c086f3ccc650d7e2a914",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.accumulate_unsharded_grad_if_needed": "0848009899924a59b8253e18e70d1d3936543385394d9c1fd26ff548ffc521c2",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.to_sharded_dtensor": "de670210d22956d797fbb56d8f0dfe23a369f5382f8ffb7fe0e0e67dd448b39a",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_all_gather": "c7cfa65e269f630bfc0d4278026b17de519e4e35742c0b369c194ad0363c4d9b",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_all_gather_input_metadatas": "f3c7a712bd122639ec796941857ad4862130f5102eb43a955fcf44421da9d387",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_all_gather_copy_out": "fed41a564b8d09e44ebf2815982eabb42efd64d67323695ef71d569b061ce0de",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_reduce_scatter_copy_in": "2aa11853e4e612272714159525eb3c11ddcf03687eaeb891d45293cba00749c2",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:chunk_cat": "0130933b3e395b09715ffd6e4df2175286e03e5672262522187991418b554510",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_gradient_divide_factors": "e118ec862d874f1e0dc0750533664362dfe2ae210f11dbcfe9cecaf7a5bdbc8e",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_div_if_needed": "edd9fa530b844c26a07c707a9fc1f67df94429781bb1a7d9325d056a5eec7357",
    "torch.distributed.fsdp._fully_shard._fsdp_common:_get_dim0_padded_size": "50614ac10ac0f541862db19d45a4b647586e12d21f716a2855e1a5a41b6fe6ea",
    "torch.distributed.fsdp._fully_shard._fsdp_common:_to_dtype_if_needed": "266529c8c622bbfaa02b5028b3367afefd9779abaa1483bdf3c687884605b5d2",
    "torch.distributed._composable_state:_insert_module_state": "8e06113807aa1497fbaf5ed16eb3e13a8a79cb5c5ec6d3587cc59ca80655761a",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam._get_grad_inner_tensor": "5c33e5c3d58cb5f1972d9d0d317776cb278da68d13ac28953dc0289ec7396282",
}
