"""torch 2.15: guarded by the sources of torch 2.15.0+cu132.

2.15 added ``MixedPrecisionPolicy.param_dtype_override_fn``; maps it can express run through it
with no change to FSDP's precision machinery (the construction site translates them,
``_patch/construct.py`` and ``_policy/native.py``). Maps it cannot express (mixed trainable storage, upcasts, third
dtypes) take the patched machinery: ``_init_mp_dtypes`` without its uniform-dtype asserts and
``_get_param_all_gather_inputs`` with one copy per target dtype; 2.15's own ``foreach_reduce``
already reduces mixed gradient dtypes and casts each back to its storage dtype.
"""

from __future__ import annotations

from fsdp_precision._releases.traits import ReleaseTraits

TORCH_RELEASE = "2.15"

#: Where this release's FSDP2 differs from 2.13's (see ``ReleaseTraits`` for each field).
TRAITS = ReleaseTraits(
    native_override=True,  # where the native override can express the map
    patches_precision=True,  # where it cannot
    mixed_dtype_reduce=True,
    defers_grad_upcast=True,
    keeps_grad_dtype=True,
    reduces_partial_grads=True,
)

SOURCES: dict[str, str] = {
    "torch.distributed.fsdp._fully_shard._fsdp_init:_init_param_group": "b1b111db8b1ce04923dda06c7a4a01131dec08eddd62442675b00c5aa1cb4ab1",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup._init_mp_dtypes": "dae2695e9f1c1c81c9ce6921e49173f01b48290df8bafdd76854c0c7ac7544a7",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_param_all_gather_inputs": "c6b0c0f074dc25c46586f7e695cbc29c3070067390dc33ca093a7b674fbe316d",
    "torch.distributed.fsdp._fully_shard._fully_shard:fully_shard": "f4a5183f64ab1967f099c187465cc40889fdc3b2452fffa952f0490f59de95fb",
    "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState.init": "7c55fe63468e02d42d1c7bf32dcaf67faabf282184c66b9d172335e19d28717d",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.__init__": "9d11e3cba4c0afe172d83d24a6cb77dc11eaaa0084956d710a0862beaaf47c07",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.lazy_init": "3effefd3dfe8d42b368f49e5527527afde2d8023dd7d8cba562968cd4ff12ea0",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup._init_reduce_scatter_param_order": "5e510721d806e47598f455cf61e22428fb730315417d49975f9d35d39abed2e0",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup._get_reduce_dtype": "156d02dff8e54fac7c90d69f1c45a6dbf76b36f44ee06267ef0c80e9988f0ade",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup._set_unsharded_grad_dtypes": "e4f73856330b1eb79ef70dd91a015783f3cecde9d953c2d8e5fc7f6c68c440bb",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup._take_unsharded_grads_to_reduce": "115bcb9e9294a567bc3f2ddbfe6275314caebc9a78f6dc1544f67ca866bd1cb3",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.unshard": "d4959dcdb1cd6e467b2225a1dc9e70269a2dc56b79e6d1851cb7449de7338fce",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.wait_for_unshard": "4a182a934e0d3ee2480db8b031b838c526690185a7e4ac3c8eccd25b3047cf4c",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.post_backward": "a7497129b9c769fed1aa08253b55d049de60c44d76b3688dc1bd3b56070bba8a",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:_get_param_module_infos": "78e81a2f40d01896563f2eaa6328ca12414eafaccb7f2008fc6c4ec1d2593de1",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.init_dtype_attrs": "1e43660bcbe9b752aaab2d7440ac06b29d254f9279aa92eff82aa06989ff4453",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.unsharded_grad_dtype": "2b1d16b3e4f56ad7639471a0abf1920f1129c4690416a3bb35ec2bf31cd52606",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.may_reduce_grad_outside_dp": "20bc1ecceb311137c858795c584cc52c39a5a89ac092d9299a7fde280ab3d25d",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.all_gather_inputs": "557221346774c69c66488ec8c9300f20eb2d1c8ba6521e9fc0233d6b866d27cc",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.init_all_gather_outputs": "6dd61980c2bd00be74b1d9770d92879e272fdb8b5c2da87b506462318048d116",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.init_unsharded_param": "61deb3e82bf9f396e00ff855c3dc15b78d45a26166dec88e000558e8f1726050",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.to_sharded_dtensor": "f41c7b27649d939182f7fdaffc79c089b1c14a033429cfb083f1d143f31a687b",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_all_gather": "c7cfa65e269f630bfc0d4278026b17de519e4e35742c0b369c194ad0363c4d9b",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_all_gather_input_metadatas": "f3c7a712bd122639ec796941857ad4862130f5102eb43a955fcf44421da9d387",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_default_all_gather_output_fn": "d890ca1e30f81d4c1551e4191c8e07351c021136b0645fb9f32b9cb1d39e88e2",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_all_gather_copy_out": "2f7f1cc8d994549a5dab9a73548485718c8749da699a16ef57706acbfd25c67a",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_reduce": "695de1c3158df7a0772e56008bb3e8ce89ddf29b6eaef230a9f9ee98778d06ed",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_default_reduce_scatter_input_fn": "346569ffec2f7facc1e29252b643bbe37cf67051e635e1e4800f8e1dc8d7704d",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_cast_and_view_sharded_grads": "af7512ebc5befb1f14ebce9df05a90fe759d37f5f9af13885eb088d8350992ed",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_reduce_scatter_copy_in": "40de14afdb8e7a17a0a21eb59310b2f176b0a3da4cd3d6434ddae44f340fe7fa",
    "torch.distributed.fsdp._fully_shard._fsdp_common:_to_dtype_if_needed": "266529c8c622bbfaa02b5028b3367afefd9779abaa1483bdf3c687884605b5d2",
    "torch.distributed._composable_state:_insert_module_state": "8e06113807aa1497fbaf5ed16eb3e13a8a79cb5c5ec6d3587cc59ca80655761a",
    "torch.distributed.fsdp._fully_shard._fsdp_api:MixedPrecisionPolicy._resolve_for_param": "3d420c911b3d5ad69e2eebfeb5764fdd62b3ec2bf237ff841b23ba65f20d8d11",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.pre_backward": "2bff56b0fbf18f1d839fe703baf2a6ecbaafe3d13b77fc0cdbb1de51db08710c",
}
