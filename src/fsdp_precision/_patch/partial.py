"""``FSDPParam._get_grad_inner_tensor``: a gradient reduced outside FSDP's mesh dims, in the
reduce dtype.

On a 2-D mesh (FSDP x TP), a parameter replicated over the TP dim whose gradient autograd leaves
``Partial`` there (a norm under sequence parallelism, a router gate or bias replicated on TP) is
all-reduced over the TP dim by this function (``grad.redistribute``) before FSDP's reduce-scatter.
Torch redistributes the gradient in its compute dtype: with ``param_dtype=bfloat16,
reduce_dtype=float32`` that all-reduce runs in bf16 (pytorch #190626), and only the reduce-scatter
after it honours ``reduce_dtype``. Here the gradient is cast to the parameter's reduce dtype
first, then handed to torch's function unchanged, so every reduction of it runs in that dtype.
Every unit takes it, mapped or not: an unmapped unit's ``reduce_dtype`` is the same promise.

The gradient leaves in the reduce dtype, beside the unit's other gradients in their compute
dtype: ``foreach_reduce`` (``_patch.reduce``) reduces a unit whose gradients arrive in several
dtypes in the unit's reduce dtype. Release traits: ``reduces_partial_grads`` (2.15 makes
autograd produce such gradients in their reduce dtype itself, ``may_reduce_grad_outside_dp``, so
there this function is not replaced) and ``spmd_meshes`` (2.12: the target placements are
``_unsharded_dtensor_spec``'s, and on a full SPMD mesh the DP dims stay ``Partial`` for the
reduce-scatter; 2.11: ``_tp_spec``'s). Not covered: torch 2.14's ``spmd_types`` path, which
hands FSDP a plain local gradient (no ``Partial`` placement to see).
"""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
from torch.distributed.tensor import DTensor

from fsdp_precision._patch import registry

__all__ = ["get_grad_inner_tensor", "reduces_partial"]


def get_grad_inner_tensor(self: FSDPParam, grad: torch.Tensor) -> torch.Tensor:
    """Torch's ``_get_grad_inner_tensor``, given the gradient in the parameter's reduce dtype
    where it reduces a ``Partial`` mesh dim."""
    if isinstance(grad, AsyncCollectiveTensor):  # as torch's does first
        grad = grad.wait()
    reduce_dtype = self.reduce_dtype  # None: the gradient's own dtype is the reduce dtype
    if (
        isinstance(grad, DTensor)
        and reduce_dtype not in (None, grad.dtype)
        and reduces_partial(self, grad)
    ):
        grad = grad.to(reduce_dtype)
    original = registry.original(FSDPParam, "_get_grad_inner_tensor")
    return original(self, grad)  # type: ignore[no-any-return]


def reduces_partial(fsdp_param: FSDPParam, grad: DTensor) -> bool:
    """Whether torch's function reduces one of ``grad``'s ``Partial`` mesh dims: a dim whose
    target placement is not ``Partial``, other than the DP dims of a full SPMD mesh (2.12 on),
    which stay ``Partial`` for the reduce-scatter."""
    if registry.traits().spmd_meshes:
        spec = fsdp_param._unsharded_dtensor_spec
        spmd = fsdp_param.mesh_info.is_spmd_mesh
        kept = set(fsdp_param._dp_dim_indices) if spmd else set()
    else:  # 2.11
        spec, kept = getattr(fsdp_param, "_tp_spec"), set()  # noqa: B009 (absent from 2.12 stubs)
    if spec is None or len(spec.placements) != len(grad.placements):
        return False  # torch's function raises its own error
    return any(
        have.is_partial() and not want.is_partial() and dim not in kept
        for dim, (have, want) in enumerate(zip(grad.placements, spec.placements, strict=True))
    )
