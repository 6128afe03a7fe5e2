"""torch 2.11: guarded by the sources of torch 2.11.0+cu130.

2.11 builds one ``FSDPParamGroup`` per ``fully_shard`` call, makes every sharded parameter
trainable, lacks the non-floating ``param_dtype`` clamp, keeps compiled-autograd branches in
``_get_param_all_gather_inputs`` and ``foreach_reduce``, and returns six values from
``foreach_reduce``, and keeps a DTensor parameter's TP placements as ``_tp_spec``: each is a
trait below.
"""

from __future__ import annotations

from fsdp_precision._releases.traits import ReleaseTraits

TORCH_RELEASE = "2.11"

#: Where this release's FSDP2 differs from 2.13's (see ``ReleaseTraits`` for each field).
TRAITS = ReleaseTraits(
    param_group_list=False,
    keeps_requires_grad=False,
    clamps_non_floating=False,
    compiled_autograd_branches=True,
    foreach_reduce_results=6,
    spmd_meshes=False,
)

SOURCES: dict[str, str] = {
    "torch.distributed.fsdp._fully_shard._fsdp_init:_init_param_group": "46c52972a6ce72a827b460ec727441829e88305202196a032d5a176c38d7675f",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup._init_mp_dtypes": "07716440019cc2c1e782fc013adedba27e561a3de74a2ea630c962e81e113ea5",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_param_all_gather_inputs": "4310e80fb94cb723808f7c20a3d440ebc48eca7bf2e158625064e893b896b7b4",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_reduce": "5db92806bc13e8fdec6c9e33cec70580145a0d21c7e1b6d159e1230242cf3c9c",
    "torch.distributed.fsdp._fully_shard._fully_shard:fully_shard": "f4c629f0a6a693aac14aa55f182454beee57e3e7bb554ad995a719496f525ac2",
    "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState.init": "a9b1f19ad1f1e0ca43d679f9da02a5421a72537b0c4afceaeedcfd56fdead2f9",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.__init__": "3ca300254a3b197d455b493246dc82445ff1dbc7fa4175c3ece6e94b87a49b0c",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.lazy_init": "3408f4fa5aa360f499e8d0748ab28134bf1706c7c24bd732aec73124f5e14914",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.unshard": "a2ae557445de36000af35082b4024f69eabb792e2971c2005d1bcfd3e0224a8c",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.wait_for_unshard": "bcb104e8f8161bc766f2b0d57690f7ee47dd0b6ceca8fc7fa9192f18b92a0f0c",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.post_backward": "2a42e42d8dd84604537041080364e814d254da8ad8fc18a091462df8d5c2f938",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:_get_param_module_infos": "78e81a2f40d01896563f2eaa6328ca12414eafaccb7f2008fc6c4ec1d2593de1",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.init_dtype_attrs": "f08987238a96b9d2fb8c6718924b7f2f7699887bad72122f6b1485ff0329d802",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.all_gather_inputs": "b668d232ebb3b69edf3d78bd65ce96b7a92cb454165cd5e0b867bdaf0545aee7",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.init_all_gather_outputs": "b8f63117f75ac034bd450d5acb8dabc2d6addb4a2309bbeaf4c895b34f32340c",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.init_unsharded_param": "9f2d9198b3594a2741a90e928934cc2e36c23928d8f6a62580ff471e876e913e",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.to_accumulated_grad_if_needed": "9ae47f4abbfcbb214c4096fd11c174e86baf33d5f3d5c086f3ccc650d7e2a914",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.accumulate_unsharded_grad_if_needed": "0848009899924a59b8253e18e70d1d3936543385394d9c1fd26ff548ffc521c2",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.to_sharded_dtensor": "de670210d22956d797fbb56d8f0dfe23a369f5382f8ffb7fe0e0e67dd448b39a",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_all_gather": "c7cfa65e269f630bfc0d4278026b17de519e4e35742c0b369c194ad0363c4d9b",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_all_gather_input_metadatas": "f3c7a712bd122639ec796941857ad4862130f5102eb43a955fcf44421da9d387",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_all_gather_copy_out": "f3dfe376b5c14e880479f603db200955aef71cf3d36a2713ab26aaa8d06eb358",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_reduce_scatter_copy_in": "2aa11853e4e612272714159525eb3c11ddcf03687eaeb891d45293cba00749c2",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:chunk_cat": "0130933b3e395b09715ffd6e4df2175286e03e5672262522187991418b554510",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_gradient_divide_factors": "e118ec862d874f1e0dc0750533664362dfe2ae210f11dbcfe9cecaf7a5bdbc8e",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_div_if_needed": "edd9fa530b844c26a07c707a9fc1f67df94429781bb1a7d9325d056a5eec7357",
    "torch.distributed.fsdp._fully_shard._fsdp_common:_get_dim0_padded_size": "50614ac10ac0f541862db19d45a4b647586e12d21f716a2855e1a5a41b6fe6ea",
    "torch.distributed.fsdp._fully_shard._fsdp_common:_to_dtype_if_needed": "266529c8c622bbfaa02b5028b3367afefd9779abaa1483bdf3c687884605b5d2",
    "torch.distributed._composable_state:_insert_module_state": "8e06113807aa1497fbaf5ed16eb3e13a8a79cb5c5ec6d3587cc59ca80655761a",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam._get_grad_inner_tensor": "749ec40fa7f78a3417534834894a01f4d30f0502d91b80f494a07c05b1ace01f",
    "torch.distributed.fsdp._fully_shard._fsdp_common:compiled_autograd_enabled": "20d057491a117461e67bd919ddb46850f4b6760c34244acdcbd98462e48d26a2",
}
