"""One model, every peer: applied to copies of it on each rank, measured side by side.

Per peer, on the first step (recorded, untimed): the FSDP units, the all-gathers and
reduce-scatters and their bytes (``CollectiveRecorder``), the dtype each kept parameter was
all-gathered in (``GatherProbe``), the dtypes its module computed in (the weight as the module
read it, its input, its output), the loss and every gradient against an fp32 reference (the same
model unsharded in fp32 on every rank, its gradients averaged over the ranks as FSDP averages),
and a digest of what it computed, so pairs that are bitwise equal show. Then ``steps`` training
steps, every peer stepped once per iteration in an order reversed every other iteration; a step's
time is its slowest rank's. Peak memory is measured apart, one peer per process group
(:func:`memory`), since a process's high-water mark holds every model it built.
"""

from __future__ import annotations

import copy
import fnmatch
import hashlib
import resource
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map

from fsdp_precision.testing import CollectiveRecorder, GatherProbe

BF16, FP32 = torch.bfloat16, torch.float32
SEQ, BATCH, VOCAB = 64, 4, 256

#: The models: a Qwen3-MoE whose routers are kept, a dense Llama whose norms are kept.
KEPT = {"moe": ("*.mlp.gate.weight",), "dense": ("*norm.weight",)}


def build(family: str, seed: int = 0, smoke: bool = False) -> nn.Module:
    """The family's model at its benchmark size, fp32 master weights, seeded."""
    import transformers

    size = {"vocab_size": VOCAB, "hidden_size": 64 if smoke else 128,
            "num_hidden_layers": 2 if smoke else 4, "num_attention_heads": 2,
            "num_key_value_heads": 1, "max_position_embeddings": 2 * SEQ}  # fmt: skip
    if family == "moe":
        config = transformers.Qwen3MoeConfig(
            **size, head_dim=32, intermediate_size=256, moe_intermediate_size=64,
            num_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.0,
        )  # fmt: skip
    else:
        config = transformers.LlamaConfig(**size, intermediate_size=256)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=FP32)


def kept_names(model: nn.Module, kept: Sequence[str]) -> list[str]:
    """The parameter names the globs ``kept`` claim."""
    return [n for n, _ in model.named_parameters() if any(fnmatch.fnmatchcase(n, k) for k in kept)]


def _cast(target: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        floating = isinstance(x, torch.Tensor) and x.is_floating_point()
        return x.to(target) if floating and x.dtype != target else x

    return cast


class _BoundaryCast:
    """A module's inputs cast to ``dtype``; its outputs cast back to the dtype its first
    floating input came in where ``back``."""

    def __init__(self, dtype: torch.dtype, back: bool) -> None:
        self.dtype, self.back = dtype, back
        self.incoming: list[torch.dtype] = []

    def pre(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        leaves, _ = tree_flatten((args, kwargs))
        floating = [x for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point()]
        self.incoming.append(floating[0].dtype if floating else self.dtype)
        return tree_map(_cast(self.dtype), args), tree_map(_cast(self.dtype), kwargs)

    def post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        incoming = self.incoming.pop()
        return tree_map(_cast(incoming), output) if self.back else output


def cast_at_boundary(modules: Sequence[nn.Module], dtype: torch.dtype = FP32) -> None:
    """The hooks a user adds to a peer that keeps weights in ``dtype`` but not the activations
    (NeMo Automodel's fp32 child units, torch 2.15's override): each module's floating inputs
    cast to ``dtype``; the outputs of a module holding only gains (norms: 1-D weights, their
    output the next matmul's input) cast back to the dtype they came in. A router's logits stay
    in ``dtype``, as with the library's boundary casts."""
    for module in modules:
        gains = all(p.dim() <= 1 for p in module.parameters())
        hooks = _BoundaryCast(dtype, back=gains)
        module.register_forward_pre_hook(hooks.pre, with_kwargs=True)
        module.register_forward_hook(hooks.post, with_kwargs=True)


def device() -> torch.device:
    """This rank's GPU where there is one (NCCL), else the CPU (gloo)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def batch(step: int) -> torch.Tensor:
    """Different tokens on every rank and step."""
    g = torch.Generator().manual_seed(10_000 * step + dist.get_rank())
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device())


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


class Computed:
    """Forward hooks on the modules holding kept parameters: the dtypes they computed in."""

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        self.seen: dict[str, dict[str, str]] = {}
        modules = dict(model.named_modules())
        owners = sorted({n.rpartition(".")[0] for n in names})
        self.handles = [modules[o].register_forward_hook(self._hook(o)) for o in owners]

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if name in self.seen:
                return
            out = output[0] if isinstance(output, tuple) else output
            floating = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
            weight = next(iter(module.parameters(recurse=False)), None)
            self.seen[name] = {
                "weight": str(weight.dtype).removeprefix("torch.") if weight is not None else "",
                "input": str(floating[0].dtype).removeprefix("torch.") if floating else "",
                "output": str(out.dtype).removeprefix("torch.")
                if isinstance(out, torch.Tensor)
                else "",
            }

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> torch.Tensor:
    ids = batch(step)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach().float()


def reference_backward(model: nn.Module, step: int) -> torch.Tensor:
    """Forward and backward of the unsharded fp32 model on this rank's batch, the gradients then
    averaged over the ranks as FSDP averages them; the loss."""
    ids = batch(step)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= dist.get_world_size()
    return loss.detach()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def synced(seconds: float) -> float:
    """The slowest rank's time."""
    t = torch.tensor([seconds], device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def measure(
    peers: Sequence[ModuleType], family: str, steps: int, smoke: bool = False
) -> dict[str, Any]:
    """Every rank: the peers applied to copies of one model, measured (see the module)."""
    base = build(family, smoke=smoke).to(device())
    kept = KEPT[family]
    names = kept_names(base, kept)
    # The fp32 reference, trained alongside: its step-0 gradients are what every peer's are
    # compared with, its last loss what theirs is.
    reference = copy.deepcopy(base)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    ref_loss = reference_backward(reference, 0)
    ref_grads = {
        n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        for n, p in reference.named_parameters()
    }
    ref_optim.step()
    ref_optim.zero_grad()
    runs: dict[str, dict[str, Any]] = {}
    models: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    for peer in peers:
        model = copy.deepcopy(base)
        needed = peer.wrap(model, kept)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        models[peer.NAME] = (model, optim)
        with CollectiveRecorder() as rec, GatherProbe(model) as probe:
            computed = Computed(model, names)
            ids = batch(0)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            computed.close()
        grads = {n: g for n, p in model.named_parameters() if (g := full(p.grad)) is not None}
        gathered = {
            str(probe.seen[n].dtype).removeprefix("torch.") for n in names if n in probe.seen
        }
        digest = hashlib.sha256()
        for n in sorted(grads):
            digest.update(grads[n].float().cpu().numpy().tobytes())
        digest.update(loss.detach().float().cpu().numpy().tobytes())
        optim.step()
        optim.zero_grad()
        runs[peer.NAME] = {
            "source": peer.SOURCE,
            "needed": needed,
            "units": sum(isinstance(m, FSDPModule) for m in model.modules()),
            "all_gathers": rec.count("all_gather"),
            "reduce_scatters": rec.count("reduce_scatter"),
            "all_gather_bytes": sum(c.output_bytes for c in rec.of("all_gather")),
            "reduce_scatter_bytes": sum(c.input_bytes for c in rec.of("reduce_scatter")),
            "gathered": sorted(gathered),
            "computed": computed.seen,
            "loss_error": float((loss.detach().float() - ref_loss).abs()),
            "grad_error": relative(torch.cat([g.reshape(-1) for g in grads.values()]),
                                   torch.cat([ref_grads[n].reshape(-1) for n in grads])),
            "kept_grad_error": max(relative(grads[n], ref_grads[n]) for n in names),
            "digest": digest.hexdigest(),
            "times": [],
        }  # fmt: skip
    for step in range(1, steps + 1):
        order = list(models) if step % 2 else list(reversed(models))
        for name in order:
            model, optim = models[name]
            dist.barrier()
            start = now()
            loss = train_step(model, optim, step)
            runs[name]["times"].append(synced(now() - start))
            runs[name]["last_loss"] = float(loss)
        ref_last = float(reference_backward(reference, step))
        ref_optim.step()
        ref_optim.zero_grad()
    for run in runs.values():
        run["last_loss_error"] = abs(run.pop("last_loss", ref_loss) - ref_last) if steps else 0.0
    return runs


def memory(peer: ModuleType, family: str, steps: int, smoke: bool = False) -> dict[str, Any]:
    """Every rank: one peer alone in this process group, ``steps`` steps: the peak RSS of each
    rank (MiB), and the same just before the model was built (imports, the process group)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model = build(family, smoke=smoke).to(device())
    peer.wrap(model, KEPT[family])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        train_step(model, optim, step)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    gpu = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    both: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(both, (before, peak, gpu))
    return {
        "before_mib": [b for b, _, _ in both],
        "peak_mib": [p for _, p, _ in both],
        "gpu_peak_mib": [g for _, _, g in both],
    }
