"""torch 2.14: guarded by the sources of torch 2.14.1+cu130.

2.14 changed FSDPParamGroup._init_mp_dtypes (frozen-only units take floating parameters),
FSDPParamGroup.post_backward (an spmd no-typecheck context around the same foreach_reduce call)
and FSDPParam.init_unsharded_param (spmd_types); none changes what the patch replaces or
expects: the traits are 2.13's.
"""

from __future__ import annotations

from fsdp_precision._releases.traits import ReleaseTraits

TORCH_RELEASE = "2.14"

#: 2.13's behaviour in every trait (the defaults of ``ReleaseTraits``).
TRAITS = ReleaseTraits()

SOURCES: dict[str, str] = {
    "torch.distributed.fsdp._fully_shard._fsdp_init:_init_param_group": "b1b111db8b1ce04923dda06c7a4a01131dec08eddd62442675b00c5aa1cb4ab1",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup._init_mp_dtypes": "83d6abbae6e51f91092ab16e3cdfc19aa6b9f65d836a6274201e32bbcc4cce87",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_param_all_gather_inputs": "c6b0c0f074dc25c46586f7e695cbc29c3070067390dc33ca093a7b674fbe316d",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_reduce": "2a4c1c0d3b3d120c13bfaba70b8fa37eb6cee21251a4030b72634f9c767f202f",
    "torch.distributed.fsdp._fully_shard._fully_shard:fully_shard": "9d1b26f5d5bf92ba130741bc97996d9d70d7968a9f95a8c75e9e805a7a6d5e0a",
    "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState.init": "6d80514721333938d3934247a62e83c4b646a2ea158b7dd5dcf49e21bdbc9d86",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.__init__": "f6f927effc8fd6970fcd8db0bc5cf8e41705a13ecc069beda166c1625014e07e",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.lazy_init": "c8e668c4ffe73fa1d387ca69b1c33e971b21b164cbb908a31f72fb44b6917946",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.unshard": "3061885784d5caffe273917618d0d5af26aa96562cdfc6934cf054bbd870dddb",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.wait_for_unshard": "068dd26aced4de32baa645ab4cf55cdb2f25d567137ca4883630f2bb5a1c9976",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.post_backward": "936b708fb7570c86bb32ada1dc2226bc61052277a384848ce46e49611261f2da",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:_get_param_module_infos": "78e81a2f40d01896563f2eaa6328ca12414eafaccb7f2008fc6c4ec1d2593de1",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.init_dtype_attrs": "135a4416af1a1c55020e1c26b9d89974e434fd9cc62a64764a557583ffe7a871",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.all_gather_inputs": "557221346774c69c66488ec8c9300f20eb2d1c8ba6521e9fc0233d6b866d27cc",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.init_all_gather_outputs": "6dd61980c2bd00be74b1d9770d92879e272fdb8b5c2da87b506462318048d116",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.init_unsharded_param": "8433dfef4c396fbb88958159818f8d64b863dcef34235d064fc84cb8bb88da52",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.to_accumulated_grad_if_needed": "9ae47f4abbfcbb214c4096fd11c174e86baf33d5f3d5c086f3ccc650d7e2a914",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.accumulate_unsharded_grad_if_needed": "0848009899924a59b8253e18e70d1d3936543385394d9c1fd26ff548ffc521c2",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.to_sharded_dtensor": "de670210d22956d797fbb56d8f0dfe23a369f5382f8ffb7fe0e0e67dd448b39a",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_all_gather": "c7cfa65e269f630bfc0d4278026b17de519e4e35742c0b369c194ad0363c4d9b",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_all_gather_input_metadatas": "f3c7a712bd122639ec796941857ad4862130f5102eb43a955fcf44421da9d387",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_all_gather_copy_out": "e0307941a9a3e970dd72f8e680bdde21735d2efc43489dc894880a8f055f9bd2",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_reduce_scatter_copy_in": "2aa11853e4e612272714159525eb3c11ddcf03687eaeb891d45293cba00749c2",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:chunk_cat": "0130933b3e395b09715ffd6e4df2175286e03e5672262522187991418b554510",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_gradient_divide_factors": "81b4b5e377eda5a635c46aa24bce4e04221e223fb020dab64f4ee6c9bcb1176d",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_div_if_needed": "edd9fa530b844c26a07c707a9fc1f67df94429781bb1a7d9325d056a5eec7357",
    "torch.distributed.fsdp._fully_shard._fsdp_common:_get_dim0_padded_size": "50614ac10ac0f541862db19d45a4b647586e12d21f716a2855e1a5a41b6fe6ea",
    "torch.distributed.fsdp._fully_shard._fsdp_common:_to_dtype_if_needed": "266529c8c622bbfaa02b5028b3367afefd9779abaa1483bdf3c687884605b5d2",
    "torch.distributed._composable_state:_insert_module_state": "8e06113807aa1497fbaf5ed16eb3e13a8a79cb5c5ec6d3587cc59ca80655761a",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam._get_grad_inner_tensor": "dfd44256b466de8df0dd078102afc52f95d43734de24e88db9b4c0695ffdd230",
}
