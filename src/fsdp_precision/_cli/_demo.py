"""``fsdp-precision demo``: train a small transformer with a mixed map on N processes and check it.

The demo launches its own processes (gloo on CPU, NCCL when each rank has a GPU) or runs inside
``torchrun``. Every rank trains two copies of one model side by side:

* mapped: one FSDP unit per block and the root, norms and the router mapped to fp32 by exact FQN;
* reference: the public-API workaround, every kept module its own unit with ``param_dtype=None``;

and checks that losses, every sharded gradient and every parameter after AdamW are bitwise equal.
"""

from __future__ import annotations

import copy
import os
import socket
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_precision._dtypes import dtype_name
from fsdp_precision._observe import CollectiveRecorder, GatherProbe
from fsdp_precision._patch import apply_param_dtype_map_patch
from fsdp_precision._policy import ParamDtypeMixedPrecisionPolicy

from ._tiny import KEEP_IN_FP32, TinyConfig, TinyDecoder

__all__ = ["DemoOptions", "run"]


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    """What the demo runs."""

    nproc: int = 2
    steps: int = 3
    dim: int = 64
    depth: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (("nproc", 1), ("steps", 1), ("dim", 8), ("depth", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"--{name} must be an integer >= {low}, got {value!r}")
        if self.dim % 4:
            raise ValueError(f"--dim must be a multiple of 4 (4 attention heads), got {self.dim}")


@dataclass
class UnitRow:
    name: str
    gathered: dict[str, int] = field(default_factory=dict)  # compute dtype -> numel
    forward_bytes: int = 0
    forward_gathers: int = 0
    wire: str = ""


# --------------------------------------------------------------------------- launch


def run(opts: DemoOptions) -> int:
    """Run the demo: under torchrun in this process, else spawn ``opts.nproc`` processes."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_rank(opts, launched=False)
    from torch.multiprocessing.spawn import start_processes

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start_processes(  # type: ignore[no-untyped-call]
        _spawned, args=(opts, port), nprocs=opts.nproc, join=True, start_method="spawn"
    )
    return 0


def _spawned(rank: int, opts: DemoOptions, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(opts.nproc),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    code = _run_rank(opts, launched=True)
    if code:
        sys.exit(code)


def _run_rank(opts: DemoOptions, *, launched: bool) -> int:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > local_rank
    if use_cuda:
        torch.cuda.set_device(local_rank)
    backend = "nccl" if use_cuda else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    try:
        device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        if not use_cuda:
            torch.set_num_threads(1)
        ok = _train_and_check(opts, device, backend)
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


# --------------------------------------------------------------------------- the job


def _say(*lines: str) -> None:
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)


def _wrap_mapped(model: TinyDecoder) -> list[tuple[str, nn.Module]]:
    from torch.distributed.fsdp import fully_shard

    keep = dict.fromkeys(KEEP_IN_FP32, torch.float32)
    for block in model.blocks:
        policy = ParamDtypeMixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, param_dtype_map=keep
        )
        fully_shard(block, mp_policy=policy)
    root = ParamDtypeMixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        param_dtype_map={"norm.weight": torch.float32},
    )
    fully_shard(model, mp_policy=root)
    return [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)] + [("<root>", model)]


def _wrap_reference(model: TinyDecoder) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fp32_unit = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    bf16_unit = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        for name in ("attn_norm", "mlp_norm", "router"):
            fully_shard(getattr(block, name), mp_policy=fp32_unit)
        fully_shard(block, mp_policy=bf16_unit)
    fully_shard(model.norm, mp_policy=fp32_unit)
    fully_shard(model, mp_policy=bf16_unit)


def _local(t: Any) -> torch.Tensor:
    out: torch.Tensor = t.to_local() if hasattr(t, "to_local") else t
    return out


def _train_and_check(opts: DemoOptions, device: torch.device, backend: str) -> bool:
    apply_param_dtype_map_patch()
    world = dist.get_world_size()
    cfg = TinyConfig(dim=opts.dim, depth=opts.depth)
    torch.manual_seed(opts.seed)
    with torch.device(device):
        base = TinyDecoder(cfg)
    ours, ref = copy.deepcopy(base), copy.deepcopy(base)
    n_params = sum(p.numel() for p in base.parameters())
    fqns = [n for n, _ in base.named_parameters()]
    _say(
        f"fsdp-precision demo: {world} processes ({backend}, {device.type}), "
        f"torch {torch.__version__}",
        f"model: TinyDecoder dim={cfg.dim} depth={cfg.depth} experts={cfg.experts} "
        f"({n_params:,} parameters, fp32 master weights)",
        "policy: bf16 compute, fp32 reduce; mapped to fp32 by exact FQN: "
        + ", ".join(f"blocks.*.{k}" for k in KEEP_IN_FP32)
        + ", norm.weight",
        "",
    )
    units = _wrap_mapped(ours)
    _wrap_reference(ref)

    rows = {name: UnitRow(name) for name, _ in units}
    current: list[str] = []

    def marker(name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            current.append(name)

        return hook

    handles = [m.register_forward_pre_hook(marker(n), prepend=True) for n, m in units]

    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    mismatches: list[str] = []
    losses: list[tuple[float, float, bool]] = []
    counts: dict[str, tuple[int, int]] = {}
    for step in range(opts.steps):
        g = torch.Generator().manual_seed(opts.seed * 1000 + step * 100 + dist.get_rank())
        tokens = torch.randint(0, cfg.vocab, (4, cfg.seq + 1), generator=g).to(device)
        probe = GatherProbe(ours) if step == 0 else None
        with CollectiveRecorder() as rec_ours:
            loss_ours = ours.loss(tokens)
            if step == 0:
                _attribute_forward(rec_ours, current, rows)
            loss_ours.backward()  # type: ignore[no-untyped-call]
        with CollectiveRecorder() as rec_ref:
            loss_ref = ref.loss(tokens)
            loss_ref.backward()  # type: ignore[no-untyped-call]
        if probe is not None:
            probe.remove()
            _fill_gathered(rows, probe, units)
            counts = {
                "mapped": (rec_ours.count("all_gather"), rec_ours.count("reduce_scatter")),
                "reference": (rec_ref.count("all_gather"), rec_ref.count("reduce_scatter")),
            }
        same_loss = torch.equal(loss_ours, loss_ref)
        if not same_loss:
            mismatches.append(f"step {step + 1}: loss")
        for name, po, pr in zip(fqns, ours.parameters(), ref.parameters(), strict=True):
            go, gr = _local(po.grad), _local(pr.grad)
            if go.dtype != gr.dtype or not torch.equal(go, gr):
                mismatches.append(f"step {step + 1}: grad {name}")
        opt_ours.step()
        opt_ref.step()
        opt_ours.zero_grad()
        opt_ref.zero_grad()
        for name, po, pr in zip(fqns, ours.parameters(), ref.parameters(), strict=True):
            if not torch.equal(_local(po), _local(pr)):
                mismatches.append(f"step {step + 1}: param {name}")
        losses.append((loss_ours.item(), loss_ref.item(), same_loss))
    for h in handles:
        h.remove()

    _print_units(rows, counts)
    _say(f"{'step':>4}  {'loss (mapped)':>16}  {'loss (fp32 units)':>18}  bitwise")
    for i, (lo, lr, same) in enumerate(losses, 1):
        _say(f"{i:>4}  {lo:>16.8f}  {lr:>18.8f}  {'yes' if same else 'NO'}")
    flag = torch.tensor([0 if mismatches else 1], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    ok = bool(flag.item())
    if ok:
        _say(
            "",
            f"parity: loss, {len(fqns)} sharded gradients and {len(fqns)} parameters bitwise "
            f"identical to the fp32-child-unit reference over {opts.steps} steps on all "
            f"{world} ranks",
        )
    else:
        print(f"rank {dist.get_rank()}: parity FAILED: " + "; ".join(mismatches[:8]), flush=True)
    return ok


def _attribute_forward(
    rec: CollectiveRecorder, current: list[str], rows: dict[str, UnitRow]
) -> None:
    # Forward all-gathers happen in order, one per unit, right after its pre-forward marker.
    gathers = rec.of("all_gather")
    for name, gather in zip(current, gathers, strict=False):  # backward gathers follow
        row = rows[name]
        row.forward_bytes += gather.output_bytes
        row.forward_gathers += 1
        row.wire = dtype_name(gather.dtype)


def _fill_gathered(
    rows: dict[str, UnitRow], probe: GatherProbe, units: list[tuple[str, nn.Module]]
) -> None:
    block_names = [name for name, _ in units if name != "<root>"]
    for fqn, seen in probe.seen.items():
        owner = next((b for b in block_names if fqn.startswith(b + ".")), "<root>")
        gathered = rows[owner].gathered
        key = dtype_name(seen.dtype)
        gathered[key] = gathered.get(key, 0) + seen.numel


def _print_units(rows: dict[str, UnitRow], counts: dict[str, tuple[int, int]]) -> None:
    header = (
        f"{'FSDP unit':<10} {'all-gathered params by dtype (numel)':<40} "
        f"{'bytes/all-gather':>16}  wire"
    )
    lines = [header, "-" * len(header)]
    for row in rows.values():
        dtypes = ", ".join(f"{k} {v:,}" for k, v in sorted(row.gathered.items()))
        lines.append(f"{row.name:<10} {dtypes:<40} {row.forward_bytes:>16,}  {row.wire}")
    (ag, rs), (ag_ref, rs_ref) = counts["mapped"], counts["reference"]
    lines += [
        "",
        f"collectives per training step: {ag} all-gathers, {rs} reduce-scatters "
        f"(one all-gather per unit per unshard, one reduce-scatter per unit)",
        f"  separate fp32 child units instead: {ag_ref} all-gathers, {rs_ref} reduce-scatters "
        f"(+{ag_ref - ag} and +{rs_ref - rs})",
        "",
    ]
    _say(*lines)
