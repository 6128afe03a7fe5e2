"""What differs between the supported torch releases, as data, the rules derived from it, and
what each release hashes.

A release module (``v2_11.py`` ... ``v2_15.py``) holds its name, its ``SOURCES`` hash table and
one :class:`ReleaseTraits` record. The patch's implementation modules (``construct``,
``mp_dtypes``, ``gather``, ``reduce``) and the planner read the record of the installed release
instead of existing once per release. Pure data: importing this module touches no torch
internals.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["ReleaseTraits", "hashed_functions"]


@dataclass(frozen=True, kw_only=True)
class ReleaseTraits:
    """The upstream behaviours the patch depends on that changed between releases.

    Each field names the release that introduced the behaviour it records. The defaults are
    torch 2.13's behaviour (the release the replaced functions mirror; 2.14 has the same traits):
    a release module names only where its release differs.
    """

    #: 2.12: ``_init_param_group`` builds a list of groups, ``state._fsdp_param_groups``
    #: (per-parameter meshes); 2.11 builds one group, ``state._fsdp_param_group``.
    param_group_list: bool = True
    #: 2.12: ``FSDPParam`` keeps ``requires_grad``; 2.11 makes every sharded parameter trainable,
    #: so it cannot manage integral or boolean parameters (a mapped unit says so up front).
    keeps_requires_grad: bool = True
    #: 2.12: ``FSDPParam.init_dtype_attrs`` clamps ``param_dtype`` to None for non-floating
    #: parameters; on 2.11 mapped units apply the clamp themselves.
    clamps_non_floating: bool = True
    #: 2.11 only (2.12 removed them): compiled-autograd branches in
    #: ``_get_param_all_gather_inputs`` (per-parameter inputs) and ``foreach_reduce`` (no
    #: post-accumulate-grad hooks), behind ``_fsdp_common.compiled_autograd_enabled``.
    compiled_autograd_branches: bool = False
    #: 2.13: ``foreach_reduce`` returns seven values (``post_reduce_stream`` third); six before.
    foreach_reduce_results: int = 7
    #: 2.15: ``MixedPrecisionPolicy.param_dtype_override_fn``; the construction wrap translates
    #: the map into it where it can express the map.
    native_override: bool = False
    #: The patch replaces FSDP2's precision machinery for mapped units (``_init_mp_dtypes``,
    #: ``_get_param_all_gather_inputs``, and without ``mixed_dtype_reduce`` ``foreach_reduce``).
    #: With ``native_override`` too (2.15), only for maps the native override cannot express.
    patches_precision: bool = True
    #: 2.15: ``foreach_reduce`` takes gradients of several dtypes (``fsdp::chunk_cat_mixed_dtype``
    #: casts them into the reduce dtype as it copies) and casts each run back to its parameter's
    #: ``sharded_grad_dtype``; ``FSDPParam`` carries ``grad_dtype`` (``unsharded_grad_dtype``),
    #: the group keeps ``_fsdp_params_with_wider_grad_dtype`` and promotes ``reduce_dtype=None``
    #: over the gradient dtypes. torch's ``foreach_reduce`` is then kept (wrapped only to leave a
    #: mapped call's 0-size gradients out of its copy-in), and ``mp_dtypes`` sets that group
    #: state instead of ``_orig_dtype``.
    mixed_dtype_reduce: bool = False
    #: 2.15: ``FSDPParamGroup.pre_backward`` clears ``grad_dtype`` on every unsharded parameter
    #: whose gradient dtype (``unsharded_grad_dtype``: the reduce dtype, else the storage dtype)
    #: is wider than its compute dtype (``_set_unsharded_grad_dtypes(defer_upcast=True)``). Its
    #: gradient then keeps the dtype autograd produces (a kernel's fp32 weight gradient stays
    #: fp32; several uses are summed as autograd sums them) and the reduce-scatter copy-in
    #: upcasts it. Before 2.15 autograd casts each gradient to the parameter's dtype first. The
    #: unsharded reference (``_reference``) emulates it; the patch changes nothing here.
    defers_grad_upcast: bool = False
    #: 2.15: ``fully_shard`` keeps a parameter's ``Tensor.grad_dtype`` on the sharded parameter
    #: it builds; before, it is dropped (pytorch #172074), which the construction wrap refuses.
    keeps_grad_dtype: bool = False
    #: 2.15: a gradient that FSDP reduces over mesh dims outside its own (``Partial`` on the TP
    #: dim of an FSDP x TP mesh: a replicated norm, bias or router gate) is produced in the
    #: reduce dtype (``FSDPParam.may_reduce_grad_outside_dp`` keeps it out of the deferred
    #: upcast), so ``_get_grad_inner_tensor``'s all-reduce honours ``reduce_dtype``. Before,
    #: that all-reduce runs in the compute dtype (pytorch #190626); the patch replaces
    #: ``_get_grad_inner_tensor`` (``_patch/partial.py``) on every unit, mapped or not.
    reduces_partial_grads: bool = False
    #: 2.12: ``FSDPParam`` keeps the unsharded parameter's placements on every mesh dim as
    #: ``_unsharded_dtensor_spec`` and, on a full SPMD mesh (``mesh_info.is_spmd_mesh``), leaves
    #: the DP dims ``Partial`` for the reduce-scatter (``_dp_dim_indices``); 2.11 keeps the TP
    #: placements as ``_tp_spec``.
    spmd_meshes: bool = True

    def __post_init__(self) -> None:
        if self.foreach_reduce_results not in (6, 7):
            raise ValueError(
                f"ReleaseTraits.foreach_reduce_results is {self.foreach_reduce_results!r}; "
                "torch's foreach_reduce returns 6 values (2.11, 2.12) or 7 (2.13 on)"
            )
        if self.mixed_dtype_reduce and self.foreach_reduce_results != 7:
            raise ValueError(
                "ReleaseTraits.mixed_dtype_reduce (2.15) needs foreach_reduce_results=7, "
                f"got {self.foreach_reduce_results!r}"
            )
        if self.defers_grad_upcast and not self.mixed_dtype_reduce:
            raise ValueError(
                "ReleaseTraits.defers_grad_upcast (2.15) needs mixed_dtype_reduce: only a "
                "reduce-scatter that takes several gradient dtypes can upcast them itself"
            )
        if not (self.native_override or self.patches_precision):
            raise ValueError(
                "ReleaseTraits needs native_override or patches_precision (or both): with "
                "neither, nothing would honour the map"
            )

    # ------------------------------------------------------------------ rules derived from them

    def default_reduce_dtype(self, trainable_storage: Iterable[torch.dtype]) -> torch.dtype | None:
        """The dtype a unit without ``reduce_dtype`` reduces in when it is not each gradient's
        compute dtype: on 2.15 (``mixed_dtype_reduce``) the promotion of its trainable
        parameters' storage dtypes, as ``FSDPParamGroup._get_reduce_dtype`` computes it (fp32
        for fp32-stored parameters computing in bf16). ``None`` before 2.15 (the compute dtype),
        without trainable parameters, and where the dtypes do not promote (float8: torch's own
        reduce would fail too)."""
        dtypes = set(trainable_storage)
        if not self.mixed_dtype_reduce or not dtypes:
            return None
        try:
            return functools.reduce(torch.promote_types, dtypes)
        except RuntimeError:
            return None

    def defers_upcast(self, grad_dtype: torch.dtype, compute_dtype: torch.dtype) -> bool:
        """Whether this release leaves a trainable parameter's gradient in the dtype autograd
        produces, for the reduce-scatter to upcast (``defers_grad_upcast``, 2.15): its gradient
        dtype (the unit's reduce dtype, else its storage dtype) is a wider floating dtype than its
        compute dtype (``_fsdp_params_with_wider_grad_dtype``)."""
        return (
            self.defers_grad_upcast
            and grad_dtype.is_floating_point
            and compute_dtype.is_floating_point
            and grad_dtype.itemsize > compute_dtype.itemsize
        )


_P = "torch.distributed.fsdp._fully_shard."

#: Replaced on every release: the construction site (``_construct``).
CONSTRUCTION_REPLACED: tuple[str, ...] = (_P + "_fsdp_init:_init_param_group",)

#: Replaced where ``patches_precision``: ``_mp_dtypes``, ``_gather``.
PRECISION_REPLACED: tuple[str, ...] = (
    _P + "_fsdp_param_group:FSDPParamGroup._init_mp_dtypes",
    _P + "_fsdp_collectives:_get_param_all_gather_inputs",
)

#: Replaced where ``patches_precision`` without ``mixed_dtype_reduce`` (2.11-2.14): ``_reduce``.
REDUCE_REPLACED: tuple[str, ...] = (_P + "_fsdp_collectives:foreach_reduce",)

#: Replaced where not ``reduces_partial_grads`` (2.11-2.14): ``_partial``.
PARTIAL_REPLACED: tuple[str, ...] = (_P + "_fsdp_param:FSDPParam._get_grad_inner_tensor",)

#: Relied on by the construction wrap (``FSDPState.init``'s registration that ``_construct``
#: undoes, the call into ``FSDPParamGroup``).
_CONSTRUCTION_RELIED_ON: tuple[str, ...] = (
    _P + "_fully_shard:fully_shard",
    _P + "_fsdp_state:FSDPState.init",
    _P + "_fsdp_param_group:FSDPParamGroup.__init__",
)

#: Relied on where ``patches_precision``: called by, or mirrored in, the replacements.
PRECISION_RELIED_ON: tuple[str, ...] = _CONSTRUCTION_RELIED_ON + (
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

#: Relied on where ``patches_precision`` and ``mixed_dtype_reduce`` (2.15): what the replaced
#: ``_init_mp_dtypes`` and ``_get_param_all_gather_inputs`` feed, mirror or call, and torch's
#: mixed-dtype reduction they leave in place.
MIXED_REDUCE_RELIED_ON: tuple[str, ...] = (
    *_CONSTRUCTION_RELIED_ON,
    _P + "_fsdp_param_group:FSDPParamGroup.lazy_init",
    _P + "_fsdp_param_group:FSDPParamGroup._init_reduce_scatter_param_order",
    _P + "_fsdp_param_group:FSDPParamGroup._get_reduce_dtype",
    _P + "_fsdp_param_group:FSDPParamGroup._set_unsharded_grad_dtypes",
    _P + "_fsdp_param_group:FSDPParamGroup._take_unsharded_grads_to_reduce",
    _P + "_fsdp_param_group:FSDPParamGroup.unshard",
    _P + "_fsdp_param_group:FSDPParamGroup.wait_for_unshard",
    _P + "_fsdp_param_group:FSDPParamGroup.post_backward",
    _P + "_fsdp_param_group:_get_param_module_infos",
    _P + "_fsdp_param:FSDPParam.init_dtype_attrs",
    _P + "_fsdp_param:FSDPParam.unsharded_grad_dtype",
    _P + "_fsdp_param:FSDPParam.may_reduce_grad_outside_dp",
    _P + "_fsdp_param:FSDPParam.all_gather_inputs",
    _P + "_fsdp_param:FSDPParam.init_all_gather_outputs",
    _P + "_fsdp_param:FSDPParam.init_unsharded_param",
    _P + "_fsdp_param:FSDPParam.to_sharded_dtensor",
    _P + "_fsdp_collectives:foreach_all_gather",
    _P + "_fsdp_collectives:_get_all_gather_input_metadatas",
    _P + "_fsdp_collectives:_default_all_gather_output_fn",
    _P + "_fsdp_collectives:foreach_all_gather_copy_out",
    _P + "_fsdp_collectives:foreach_reduce",
    _P + "_fsdp_collectives:_default_reduce_scatter_input_fn",
    _P + "_fsdp_collectives:_cast_and_view_sharded_grads",
    _P + "_fsdp_collectives:foreach_reduce_scatter_copy_in",
    _P + "_fsdp_common:_to_dtype_if_needed",
    "torch.distributed._composable_state:_insert_module_state",
)

#: Relied on where ``defers_grad_upcast`` (2.15): the call that clears ``grad_dtype`` for the
#: backward (the function it calls, ``_set_unsharded_grad_dtypes``, is hashed with the reduce).
DEFERRED_UPCAST_RELIED_ON: tuple[str, ...] = (
    _P + "_fsdp_param_group:FSDPParamGroup.pre_backward",
    _P + "_fsdp_param_group:FSDPParamGroup._set_unsharded_grad_dtypes",
)

#: Relied on where ``compiled_autograd_branches`` (2.11): the switch the replacements consult.
COMPILED_AUTOGRAD_RELIED_ON: tuple[str, ...] = (_P + "_fsdp_common:compiled_autograd_enabled",)

#: Relied on where ``native_override`` (2.15): the native machinery the translated map runs
#: through, every step of it.
NATIVE_RELIED_ON: tuple[str, ...] = (
    *_CONSTRUCTION_RELIED_ON,
    "torch.distributed._composable_state:_insert_module_state",
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


def hashed_functions(traits: ReleaseTraits) -> tuple[str, ...]:
    """Every upstream function a release with ``traits`` hashes, replaced ones first.

    The order is that of the release modules' ``SOURCES`` tables (``scripts/hash_sources.py``
    prints them in this order); a target listed by two groups appears once, where first listed.
    """
    groups = [CONSTRUCTION_REPLACED]
    if traits.patches_precision and traits.mixed_dtype_reduce:
        groups += [PRECISION_REPLACED, MIXED_REDUCE_RELIED_ON]
    elif traits.patches_precision:
        groups += [PRECISION_REPLACED, REDUCE_REPLACED, PRECISION_RELIED_ON]
    if not traits.reduces_partial_grads:
        groups.append(PARTIAL_REPLACED)
    if traits.compiled_autograd_branches:
        groups.append(COMPILED_AUTOGRAD_RELIED_ON)
    if traits.native_override:
        groups.append(NATIVE_RELIED_ON)
    if traits.defers_grad_upcast:
        groups.append(DEFERRED_UPCAST_RELIED_ON)
    return tuple(dict.fromkeys(target for group in groups for target in group))
