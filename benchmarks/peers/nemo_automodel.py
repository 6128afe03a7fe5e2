"""NeMo Automodel's ``fully_shard_by_dtype`` (0.7.0,
``nemo_automodel/components/distributed/parallelizer_utils.py``): per decoder layer, the
parameters are grouped by compute dtype and the minority group's maximal uniform subtrees get
FSDP2 units of their own (``param_dtype=fp32, reduce_dtype=fp32, cast_forward_inputs=False``),
then the layer one with the policy; the root is ``fully_shard(model, mesh, mp_policy)``, as its
parallelizers (``components/models/nemotron_v3/parallelization.py``, ``recipes/llm/
train_dspark.py``) call it. ``fp32_compute_module_names`` are substrings of the layer's parameter
names (its users pass ``_keep_in_fp32_modules_strict``): the kept globs without their leading
``*``/``.``. A kept parameter outside every decoder layer (Llama's final ``model.norm``) is in the
root unit and computes in bf16, as NeMo's own root wrap does.

As shipped the fp32 child units do not cast their inputs (NeMo: "matched callable modules must
cast their own inputs"), and transformers' modules do not: the Qwen3-MoE router's first forward
fails in ``F.linear`` (:data:`AS_SHIPPED`), and an fp32 norm returns fp32 activations to the next
bf16 matmul. :func:`wrap` adds what a user adds: :func:`peers.harness.cast_at_boundary` on each
fp32 child unit. NeMo Automodel patches torch's FSDP2 internals from its parallelizers (not from
``fully_shard_by_dtype``): it runs from its own venv, given to ``bench_peers.py`` as
``--peer-python nemo_automodel=/work/venvs/nemo/bin/python``, made with::

    python3 -m venv /work/venvs/nemo
    /work/venvs/nemo/bin/pip install torch==2.13.0
    /work/venvs/nemo/bin/pip install -c <(echo torch==2.13.0) nemo_automodel==0.7.0
    /work/venvs/nemo/bin/pip install --no-deps -e .
    /work/venvs/nemo/bin/pip install -c <(echo torch==2.13.0) pytest pytest-timeout hypothesis

(NeMo pins transformers 5.18.0, which builds the benchmark's models bit for bit as 5.24.0 does.)
"""

from __future__ import annotations

import importlib.metadata

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from peers.harness import cast_at_boundary

NAME = "nemo_automodel"
VERSION = "0.7.0"


def _version() -> str:
    try:
        return importlib.metadata.version("nemo_automodel")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


SOURCE = (
    f"NeMo Automodel {_version()}: fully_shard_by_dtype(layer, mesh, MixedPrecisionPolicy(bf16, "
    "fp32), None, fp32_compute_module_names=...) per decoder layer, fully_shard(model) at the root"
)

#: What the first forward raises as shipped, on both families (``tests/project/test_peers.py``).
AS_SHIPPED = "expected m1 and m2 to have the same dtype"


def needed(units: list[nn.Module]) -> str:
    """What :func:`wrap` adds to the fp32 child ``units``, and why."""
    if any(p.dim() > 1 for u in units for p in u.parameters()):
        hooks = "an input-cast forward pre-hook on each fp32 child unit"
        why = "the router's bf16 input meets its fp32 weight"
    else:
        hooks = "an input cast and an output cast back to bf16 on each fp32 child unit (norms)"
        why = "the norm's fp32 output meets the next bf16 weight"
    return f"{hooks}: as shipped the first forward fails with '{AS_SHIPPED}' ({why})"


def available() -> str | None:
    try:
        from nemo_automodel.components.distributed import parallelizer_utils  # noqa: F401
    except ImportError as e:
        return (
            f"nemo_automodel is not importable here ({e}): run it from its own venv, "
            "--peer-python nemo_automodel=/work/venvs/nemo/bin/python"
        )
    if _version() != VERSION:
        return f"nemo_automodel {_version()} is installed; this peer measures {VERSION}"
    return None


def substrings(kept: tuple[str, ...]) -> tuple[str, ...]:
    """The globs as the substrings ``fp32_compute_module_names`` matches ("*.mlp.gate.weight"
    -> "mlp.gate.weight")."""
    out = tuple(k.lstrip("*.") for k in kept)
    for glob, sub in zip(kept, out, strict=True):
        if any(c in sub for c in "*?[") or not sub:
            raise ValueError(f"kept glob {glob!r} is not '*' followed by a name: no substring")
    return out


def wrap(model: nn.Module, kept: tuple[str, ...], *, as_shipped: bool = False) -> str:
    """``as_shipped``: without the hooks (the first forward fails, see :data:`AS_SHIPPED`)."""
    from nemo_automodel.components.distributed.parallelizer_utils import fully_shard_by_dtype

    device = next(model.parameters()).device.type
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = list(model.model.layers)
    for layer in layers:
        fully_shard_by_dtype(layer, mesh, policy, None, fp32_compute_module_names=substrings(kept))
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if as_shipped:
        return ""
    # fully_shard_by_dtype's fp32 child units: the units inside a layer that are not the layer
    fp32_units = [
        m
        for layer in layers
        for m in layer.modules()
        if isinstance(m, FSDPModule) and m is not layer
    ]
    cast_at_boundary(fp32_units)
    return needed(fp32_units)
