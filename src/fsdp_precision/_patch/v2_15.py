"""torch 2.15: guarded by the sources of torch 2.15.0+cu132.

2.15 added ``MixedPrecisionPolicy.param_dtype_override_fn``; maps it can express run through it
with no change to FSDP's precision machinery, and the only wrapped function is the construction
site (validation and translation, ``_construct`` and ``_native``). Maps it cannot express are
refused by name.
Regenerate the table with ``python scripts/hash_sources.py`` in a venv holding this release;
check it with ``python scripts/hash_sources.py --check``.
"""

from __future__ import annotations

from ._traits import ReleaseTraits

TORCH_RELEASE = "2.15"

#: Where this release's FSDP2 differs from 2.13's (see ``ReleaseTraits`` for each field).
TRAITS = ReleaseTraits(
    native_override=True,
    patches_precision=False,
)

#: SHA-256 of every upstream function the patch replaces or relies on (``targets(TRAITS)``).
SOURCES: dict[str, str] = {
    "torch.distributed.fsdp._fully_shard._fsdp_init:_init_param_group": "b1b111db8b1ce04923dda06c7a4a01131dec08eddd62442675b00c5aa1cb4ab1",
    "torch.distributed.fsdp._fully_shard._fully_shard:fully_shard": "f4a5183f64ab1967f099c187465cc40889fdc3b2452fffa952f0490f59de95fb",
    "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState.init": "7c55fe63468e02d42d1c7bf32dcaf67faabf282184c66b9d172335e19d28717d",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.__init__": "9d11e3cba4c0afe172d83d24a6cb77dc11eaaa0084956d710a0862beaaf47c07",
    "torch.distributed._composable_state:_insert_module_state": "8e06113807aa1497fbaf5ed16eb3e13a8a79cb5c5ec6d3587cc59ca80655761a",
    "torch.distributed.fsdp._fully_shard._fsdp_api:MixedPrecisionPolicy._resolve_for_param": "3d420c911b3d5ad69e2eebfeb5764fdd62b3ec2bf237ff841b23ba65f20d8d11",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup._init_mp_dtypes": "dae2695e9f1c1c81c9ce6921e49173f01b48290df8bafdd76854c0c7ac7544a7",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.post_backward": "a7497129b9c769fed1aa08253b55d049de60c44d76b3688dc1bd3b56070bba8a",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.init_dtype_attrs": "1e43660bcbe9b752aaab2d7440ac06b29d254f9279aa92eff82aa06989ff4453",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.all_gather_inputs": "557221346774c69c66488ec8c9300f20eb2d1c8ba6521e9fc0233d6b866d27cc",
    "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.init_unsharded_param": "61deb3e82bf9f396e00ff855c3dc15b78d45a26166dec88e000558e8f1726050",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_param_all_gather_inputs": "c6b0c0f074dc25c46586f7e695cbc29c3070067390dc33ca093a7b674fbe316d",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_all_gather": "c7cfa65e269f630bfc0d4278026b17de519e4e35742c0b369c194ad0363c4d9b",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_all_gather_input_metadatas": "f3c7a712bd122639ec796941857ad4862130f5102eb43a955fcf44421da9d387",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_reduce": "695de1c3158df7a0772e56008bb3e8ce89ddf29b6eaef230a9f9ee98778d06ed",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_reduce_scatter_copy_in": "40de14afdb8e7a17a0a21eb59310b2f176b0a3da4cd3d6434ddae44f340fe7fa",
}
