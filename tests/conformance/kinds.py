"""The ways a ported upstream test builds its FSDP policies, and what it compares with torch alone.

Each port builds its units with :func:`policy` for every kind in :func:`kinds`: on torch alone
(the patch not applied) only ``"upstream"``, torch's own ``MixedPrecisionPolicy``; under the patch
also the library's policy with an empty map, a one-entry map, a map of every managed parameter and
a model-scoped policy (``model_policy`` with a rule claiming every parameter), each mapping to the
dtype the parameter gets anyway, so that the semantics are torch's and the patched code paths run.
A port returns ``{kind: digest(...)}``; ``conformance_suites`` checks every kind's digest under the
patch against ``"upstream"`` on torch alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision.testing import CollectiveRecorder

PATCHED_KINDS = ("upstream", "empty", "one", "mapped", "model_policy")


def kinds() -> tuple[str, ...]:
    """The kinds this process runs: every kind under the patch, ``"upstream"`` on torch alone."""
    return PATCHED_KINDS if fp.is_param_dtype_map_patch_applied() else ("upstream",)


def _managed(module: nn.Module) -> dict[str, nn.Parameter]:
    """Floating parameters a ``fully_shard(module)`` call manages (not an inner unit's)."""
    return {
        n: p
        for n, p in module.named_parameters()
        if not isinstance(p, DTensor) and p.is_floating_point()
    }


def policy(
    kind: str,
    module: nn.Module,
    root: nn.Module | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    **kw: object,
) -> MixedPrecisionPolicy:
    """The policy of kind ``kind`` for ``fully_shard(module)``; ``root``: the model the
    model-scoped policy is built for (its units are wrapped innermost first, as always)."""
    if kind == "upstream":
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, **kw)  # type: ignore[arg-type]
    if kind == "model_policy":
        return _model_policy(root if root is not None else module, param_dtype, reduce_dtype, kw)
    own = {n: param_dtype or p.dtype for n, p in _managed(module).items()}
    if kind == "empty":
        own = {}
    elif kind == "one":
        own = dict(list(own.items())[:1])
    return fp.ParamDtypeMixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, param_dtype_map=own, **kw
    )  # type: ignore[arg-type]


_MODEL_POLICIES: dict[int, MixedPrecisionPolicy] = {}


def _model_policy(
    root: nn.Module,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    kw: dict[str, object],
) -> MixedPrecisionPolicy:
    """One model-scoped policy per root, claiming every parameter in the dtype it gets anyway."""
    key = id(root)
    if key not in _MODEL_POLICIES or getattr(_MODEL_POLICIES[key], "_root", None) is not root:
        dtypes = {p.dtype for p in root.parameters() if p.is_floating_point()}
        assert param_dtype is not None or len(dtypes) == 1, dtypes
        rules = fp.PrecisionRules(
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            rules=(fp.Glob("*", dtype=param_dtype or dtypes.pop()),),
            hf_keep_in_fp32=False,
            advice="off",
            **kw,  # type: ignore[arg-type]
        )
        made = fp.model_policy(root, rules)
        object.__setattr__(made, "_root", root)
        _MODEL_POLICIES[key] = made
    return _MODEL_POLICIES[key]


def digest(
    tensors: Iterable[torch.Tensor | None], recorder: CollectiveRecorder | None = None
) -> str:
    """SHA-256 of tensors' values (DTensors: this rank's shard), dtypes and shapes, and of the
    collectives ``recorder`` saw (kind, wire dtype, bytes, group size)."""
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        t = t.detach().contiguous().cpu().reshape(-1)
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    if recorder is not None:
        for c in recorder.calls:
            h.update(f"{c.kind}{c.dtype}{c.input_bytes}{c.group_size}{c.functional}".encode())
    return h.hexdigest()


def state_digest(
    model: nn.Module, losses: Iterable[torch.Tensor], recorder: CollectiveRecorder | None = None
) -> str:
    """:func:`digest` of the losses, every parameter and every gradient of ``model``."""
    params = list(model.parameters())
    return digest([*losses, *params, *(p.grad for p in params)], recorder)
