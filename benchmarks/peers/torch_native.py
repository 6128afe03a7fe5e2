"""torch 2.15's native per-parameter override, as a torch user applies it (no fsdp-precision
patch): every unit ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32,
param_dtype_override_fn=fn)``, ``fn`` returning ``torch.float32`` for the kept parameters and
``None`` for the rest (``torch/distributed/fsdp/_fully_shard/_fsdp_api.py``: called once per
managed parameter when FSDP is applied, ``MixedPrecisionPolicy._resolve_for_param``; it may return
only ``None``, ``param_dtype`` or the parameter's original dtype, so with fp32 master weights the
kept parameters keep fp32 and nothing else is expressible). The kept parameters stay in their
units (one all-gather per unit, mixed dtypes packed as bytes); the root's policy keeps the
root's kept parameters too (Llama's final ``model.norm``).

"Forward input casting continues to use ``param_dtype``": a kept module meets bf16 activations.
The Qwen3-MoE router does not cast for itself (the first forward fails in ``F.linear``, as with
NeMo Automodel's units), and an fp32 norm returns fp32 activations to the next bf16 matmul;
:func:`wrap` adds what a user adds, :func:`peers.harness.cast_at_boundary` on each module
holding kept parameters. Runs from a torch 2.15 venv, given to ``bench_peers.py`` as
``--peer-python torch_native=/work/venvs/torch-2.15.0/bin/python``, made with::

    python3 -m venv /work/venvs/torch-2.15.0
    PIP_CONFIG_FILE=/dev/null /work/venvs/torch-2.15.0/bin/pip install torch==2.15.0
    /work/venvs/torch-2.15.0/bin/pip install --no-deps -e .
    /work/venvs/torch-2.15.0/bin/pip install -c <(echo torch==2.15.0) numpy xxhash \\
        transformers==5.24.0 safetensors pytest pytest-timeout hypothesis

(``scripts/compat.py 2.15.0`` makes its venv at the same path: reuse it, adding these.)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_precision as fp
from peers.harness import cast_at_boundary, kept_names

NAME = "torch_native"
SOURCE = (
    f"torch {torch.__version__}: MixedPrecisionPolicy(bf16, fp32, param_dtype_override_fn=kept "
    "-> fp32) on every unit, without fsdp-precision's patch"
)

#: What the first forward raises as shipped on the moe family (``tests/project/test_peers.py``).
AS_SHIPPED = "expected m1 and m2 to have the same dtype"


def available() -> str | None:
    fields = {f.name for f in dataclasses.fields(MixedPrecisionPolicy)}
    if "param_dtype_override_fn" not in fields:
        return (
            f"torch {torch.__version__} has no MixedPrecisionPolicy.param_dtype_override_fn "
            "(torch 2.15 added it): --peer-python torch_native=/work/venvs/torch-2.15.0/bin/python"
        )
    return None


def needed(owners: list[nn.Module]) -> str:
    """What :func:`wrap` adds to the modules holding kept parameters, and why."""
    if any(p.dim() > 1 for m in owners for p in m.parameters()):
        hooks = "an input-cast forward pre-hook on each kept module"
        why = "the router's bf16 input meets its fp32 weight"
    else:
        hooks = "an input cast and an output cast back to bf16 on each kept module (norms)"
        why = "the norm's fp32 output meets the next bf16 weight"
    return f"{hooks}: as shipped the first forward fails with '{AS_SHIPPED}' ({why})"


def wrap(model: nn.Module, kept: tuple[str, ...], *, as_shipped: bool = False) -> str:
    """``as_shipped``: without the hooks (the first forward fails, see :data:`AS_SHIPPED`)."""
    if fp.is_param_dtype_map_patch_applied():
        raise RuntimeError("torch_native measures torch alone: fsdp-precision's patch is applied")
    names = kept_names(model, kept)
    ids = {id(p) for n, p in model.named_parameters() if n in names}

    def override(param: nn.Parameter) -> torch.dtype | None:
        return param.dtype if id(param) in ids else None  # the fp32 master: kept in fp32

    policy = MixedPrecisionPolicy(  # type: ignore[call-arg]  # a 2.15 field
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, param_dtype_override_fn=override
    )
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if as_shipped:
        return ""
    modules = dict(model.named_modules())
    owners = [modules[o] for o in sorted({n.rpartition(".")[0] for n in names})]
    cast_at_boundary(owners)
    return needed(owners)
