"""``fsdp-precision demo``: a real distributed training job with exact per-parameter precision.

Two phases, each in its own processes (gloo on CPU, NCCL when every rank has a GPU):

1. **train** on ``nproc`` ranks: the model is wrapped by :func:`wrap_model_for_training` (units
   and exact maps compiled from the precision rules), and, side by side on the same batches, a
   copy wrapped the public-API way (every kept module its own FSDP unit). Losses, every sharded
   gradient and every parameter after each AdamW step are compared bitwise. A sharded checkpoint
   is saved halfway; the final state of this uninterrupted run is kept for phase 2.
2. **resume** on ``resume_nproc`` ranks: a fresh model loads the sharded checkpoint (DCP
   resharding), trains the remaining steps on the same batches, and its losses and final
   parameters are compared with the uninterrupted run.

The global batch is a fixed list of micro-batches, split across however many ranks there are,
with the loss scaled so that the averaged gradient is the same sum at every world size: between 1
and 2 ranks that sum is computed in the same order, so the resumed run is bitwise identical.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_precision._checkpoint import load_checkpoint, model_state_dict, save_checkpoint
from fsdp_precision._config import DistributedConfig
from fsdp_precision._dtypes import dtype_name
from fsdp_precision._observe import CollectiveRecorder, GatherProbe
from fsdp_precision._plan import PrecisionPlan
from fsdp_precision._wrap import _no_split_names, plan_model_for_training, wrap_model_for_training

from ._demo_model import DemoModel, demo_model, micro_batch, micro_batches_per_step
from ._launch import is_rank0, launch, process_group, under_torchrun
from ._plan_cmd import _parse_rule
from ._progress import Progress

__all__ = ["DemoOptions", "run"]

_TRAIN, _RESUME = "train.json", "resume.json"
_CHECKPOINT, _UNINTERRUPTED = "checkpoint", "uninterrupted.pt"
_LR = 1e-2


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    """What the demo runs (the command line's options)."""

    nproc: int = 2
    resume_nproc: int | None = None
    steps: int = 8
    model: str = "auto"
    dim: int = 64
    depth: int = 2
    precision: str = "bf16"
    keep: tuple[str, ...] = ()
    output_dir: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        lows = (("nproc", 1), ("steps", 2), ("dim", 8), ("depth", 1), ("seed", 0))
        for name, low in lows:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"--{name} must be an integer >= {low}, got {value!r}")
        if self.resume_nproc is not None and self.resume_nproc < 1:
            raise ValueError(f"--resume-nproc must be an integer >= 1, got {self.resume_nproc}")
        if self.dim % 4:
            raise ValueError(f"--dim must be a multiple of 4 (4 attention heads), got {self.dim}")
        if self.precision not in ("bf16", "fp16"):
            raise ValueError(f"--precision must be bf16 or fp16, got {self.precision!r}")
        for rule in self.keep:
            _parse_rule(rule)
        demo_model(self.model, dim=self.dim, depth=self.depth)  # validates --model and --dim

    @property
    def resume_world(self) -> int:
        """Ranks of the resumed run: 1 after a multi-rank run, 2 after a one-rank run."""
        if self.resume_nproc is not None:
            return self.resume_nproc
        return 1 if self.nproc > 1 else 2

    @property
    def checkpoint_step(self) -> int:
        """The step after which the sharded checkpoint is saved (halfway)."""
        return self.steps // 2

    @property
    def bitwise_resume_expected(self) -> bool:
        """Whether the gradient sums of both world sizes are computed in the same order."""
        return {self.nproc, self.resume_world} <= {1, 2}


# --------------------------------------------------------------------------- launch


def run(opts: DemoOptions) -> int:
    """Run both phases and print the summary; returns the exit code (0: checks passed).

    Under torchrun the training phase runs in the launched ranks and rank 0 then starts the
    resume phase's processes itself."""
    started = time.perf_counter()
    if under_torchrun() and int(os.environ["WORLD_SIZE"]) != opts.nproc:
        opts = replace(opts, nproc=int(os.environ["WORLD_SIZE"]))
    _preflight(opts)
    out = _output_dir(opts) if opts.output_dir is not None else None
    if under_torchrun():
        train = _train_rank(opts, out)
        if not is_rank0():
            return 0
    else:
        out = out or Path(tempfile.mkdtemp(prefix="fsdp-precision-demo-"))
        train = launch(_train_rank, (opts, out), nproc=opts.nproc, start_method=_start_method())
    assert train is not None
    out = Path(train["output_dir"])
    try:
        # A torchrun rank has run autograd by now: its children must start fresh (no fork).
        method = "spawn" if under_torchrun() else _start_method()
        with _outside_torchrun():
            resume = launch(_resume_rank, (opts, out), nproc=opts.resume_world, start_method=method)
        assert resume is not None
        return _summary(opts, train, resume, time.perf_counter() - started)
    finally:
        if opts.output_dir is None:
            shutil.rmtree(out, ignore_errors=True)


def _preflight(opts: DemoOptions) -> None:
    """Compile the plan on the meta device before any process starts, so that rules that match
    nothing or cannot be honoured fail as one clear line (exit 2), not inside the ranks."""
    spec = demo_model(opts.model, dim=opts.dim, depth=opts.depth)
    with torch.device("meta"):
        model = spec.build()
    plan_model_for_training(model, _config(opts, spec, model), world_size=opts.nproc)


def _config(opts: DemoOptions, spec: DemoModel, model: nn.Module) -> DistributedConfig:
    return DistributedConfig(
        fsdp_mixed_precision=opts.precision,  # type: ignore[arg-type]
        fsdp_auto_wrap_min_params=_block_size(model),
        precision_rules=tuple(_parse_rule(r) for r in opts.keep) + spec.rules,
    )


def _output_dir(opts: DemoOptions) -> Path:
    out = Path(str(opts.output_dir)).absolute()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output-dir {opts.output_dir!r} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _start_method() -> str:
    # Forked ranks inherit torch and transformers already imported (seconds each); CUDA cannot
    # be used in a forked child, so with GPUs the ranks start fresh.
    return "fork" if sys.platform == "linux" and not torch.cuda.is_available() else "spawn"


@contextmanager
def _outside_torchrun() -> Iterator[None]:
    """Hide torchrun's environment while rank 0 starts processes of its own."""
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK"}
    saved = {n: v for n, v in os.environ.items() if n in names or n.startswith("TORCHELASTIC_")}
    for name in saved:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(saved)


@contextmanager
def _rank_group() -> Iterator[None]:
    """This rank's process group: NCCL on its GPU when it has one, else gloo on one thread."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > local_rank
    if use_cuda:
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(1)
    with process_group("nccl" if use_cuda else "gloo"):
        yield


# --------------------------------------------------------------------------- shared


@dataclass
class _Job:
    """What both phases build identically from the options."""

    spec: DemoModel
    config: DistributedConfig
    model: nn.Module
    device: torch.device
    micro: int  # micro-batches per step, over all ranks

    @property
    def mine(self) -> range:
        """This rank's micro-batch indices."""
        per = self.micro // dist.get_world_size()
        return range(dist.get_rank() * per, (dist.get_rank() + 1) * per)

    @property
    def scale(self) -> float:
        """Loss scale: FSDP averages over ranks, the step averages over micro-batches."""
        return dist.get_world_size() / self.micro

    def batch(self, opts: DemoOptions, step: int, index: int) -> torch.Tensor:
        return micro_batch(self.spec, seed=opts.seed, step=step, index=index, device=self.device)


def _job(opts: DemoOptions) -> _Job:
    spec = demo_model(opts.model, dim=opts.dim, depth=opts.depth)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    torch.manual_seed(opts.seed)
    with torch.device(device):
        model = spec.build()
    return _Job(
        spec,
        _config(opts, spec, model),
        model,
        device,
        micro_batches_per_step(opts.nproc, opts.resume_world),
    )


def _block_size(model: nn.Module) -> int:
    """The smallest transformer block: the auto-wrap threshold that makes every block a unit."""
    blocks = _no_split_names(model)
    sizes = [
        sum(p.numel() for p in m.parameters())
        for m in model.modules()
        if type(m).__name__ in blocks
    ]
    return min(sizes, default=1)


def _say(*lines: str) -> None:
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)


def _local(t: Any) -> torch.Tensor:
    out: torch.Tensor = t.to_local() if hasattr(t, "to_local") else t
    return out


def _step_loss(losses: list[torch.Tensor], job: _Job) -> float:
    """The step's loss: the mean of every rank's micro-batch losses, in micro-batch order."""
    everyone = torch.zeros(job.micro, dtype=torch.float64, device=job.device)
    for index, loss in zip(job.mine, losses, strict=True):
        everyone[index] = loss.double()
    dist.all_reduce(everyone)  # one rank holds each entry, the others add exact zeros
    return float(everyone.mean())


def _all_ranks_agree(ok: bool, device: torch.device) -> bool:
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


# --------------------------------------------------------------------------- phase 1: train


@dataclass
class _UnitRow:
    name: str
    gathered: dict[str, int] = field(default_factory=dict)  # compute dtype -> numel
    forward_bytes: int = 0
    wire: str = ""


def _train_rank(opts: DemoOptions, out: Path | None) -> dict[str, Any] | None:
    """Phase 1 on this rank; rank 0 returns the results (``out=None``: rank 0 makes a
    temporary directory for everyone, under torchrun)."""
    with _rank_group():
        shared: list[Any] = [out]
        if out is None:
            if dist.get_rank() == 0:
                shared[0] = Path(tempfile.mkdtemp(prefix="fsdp-precision-demo-"))
            dist.broadcast_object_list(shared, src=0)
        return _train(opts, shared[0])


def _train(opts: DemoOptions, out: Path) -> dict[str, Any] | None:
    start = time.perf_counter()
    job = _job(opts)
    world, backend = dist.get_world_size(), dist.get_backend()
    n_params = sum(p.numel() for p in job.model.parameters())
    plan = plan_model_for_training(job.model, job.config)
    _say(
        f"fsdp-precision demo: train on {world} processes ({backend}, {job.device.type}), "
        f"torch {torch.__version__}",
        f"model: {job.spec.name}, {n_params:,} parameters, fp32 master weights",
        f"precision: {opts.precision} compute, fp32 reduce; "
        + (f"--keep {' '.join(opts.keep)}; " if opts.keep else "")
        + job.spec.rules_note,
        "",
        plan.explain(max_params=6),
        "",
    )
    ours, ref = job.model, copy.deepcopy(job.model)
    names = {id(m): n for n, m in ours.named_modules()}
    units = [(u.name, ours.get_submodule(names[id(u.modules[0])])) for u in plan.units]
    owner = {f: u.name for u in plan.units for p in u.params for f in (p.fqn, *p.aliases)}
    reference_note = _wrap_reference(ref, plan, names)
    wrap_model_for_training(ours, job.config)
    has_reference = reference_note is None
    if not has_reference:
        _say(f"reference: {reference_note}; only the resume check runs", "")

    rows = {name: _UnitRow(name) for name, _ in units}
    order: list[str] = []
    markers = [
        m.register_forward_pre_hook(lambda *_, n=n: order.append(n), prepend=True) for n, m in units
    ]
    fqns = [n for n, _ in ours.named_parameters()]
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=_LR)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=_LR)
    mismatches: list[str] = []
    losses: list[float] = []
    counts: dict[str, tuple[int, int]] = {}
    progress = Progress(opts.steps, label="train ") if dist.get_rank() == 0 else None
    for step in range(1, opts.steps + 1):
        micro_losses = []
        for index in job.mine:
            tokens = job.batch(opts, step, index)
            first = step == 1 and index == job.mine[0]
            probe = GatherProbe(ours) if first else None
            with CollectiveRecorder() as rec_ours:
                loss = (
                    _first_forward(job, ours, tokens, plan)
                    if first
                    else job.spec.loss(ours, tokens)
                )
                if first:
                    _attribute_forward(rec_ours, order, rows)
                (loss * job.scale if job.scale != 1 else loss).backward()  # type: ignore[no-untyped-call]
            if probe is not None:  # observation is for the first micro-batch only
                probe.remove()
                for handle in markers:
                    handle.remove()
                for fqn, seen in probe.seen.items():
                    gathered = rows[owner[fqn]].gathered
                    gathered[dtype_name(seen.dtype)] = (
                        gathered.get(dtype_name(seen.dtype), 0) + seen.numel
                    )
            micro_losses.append(loss.detach())
            if not has_reference:
                continue
            with CollectiveRecorder() as rec_ref:
                loss_ref = job.spec.loss(ref, tokens)
                (loss_ref * job.scale if job.scale != 1 else loss_ref).backward()  # type: ignore[no-untyped-call]
            if first:
                counts = {
                    "mapped": (rec_ours.count("all_gather"), rec_ours.count("reduce_scatter")),
                    "reference": (rec_ref.count("all_gather"), rec_ref.count("reduce_scatter")),
                }
            if not torch.equal(loss, loss_ref):
                mismatches.append(f"step {step}: loss of micro-batch {index}")
        if has_reference:
            for name, po, pr in zip(fqns, ours.parameters(), ref.parameters(), strict=True):
                go, gr = _local(po.grad), _local(pr.grad)
                if go.dtype != gr.dtype or not torch.equal(go, gr):
                    mismatches.append(f"step {step}: grad {name}")
        opt_ours.step()
        opt_ours.zero_grad()
        if has_reference:
            opt_ref.step()
            opt_ref.zero_grad()
            for name, po, pr in zip(fqns, ours.parameters(), ref.parameters(), strict=True):
                if not torch.equal(_local(po), _local(pr)):
                    mismatches.append(f"step {step}: param {name}")
        losses.append(_step_loss(micro_losses, job))
        if step == opts.checkpoint_step:
            save_checkpoint(out / _CHECKPOINT, ours, opt_ours, step=step)
        if progress is not None:
            progress.update(step, loss=losses[-1])
    final = model_state_dict(ours, "full")
    parity = _all_ranks_agree(not mismatches, job.device) if has_reference else None
    if mismatches:
        print(f"rank {dist.get_rank()}: parity FAILED: " + "; ".join(mismatches[:8]), flush=True)
    if has_reference:
        _say("", *_unit_table(rows, counts))
    if dist.get_rank() != 0:
        return None
    torch.save({"losses": losses, "state": final}, out / _UNINTERRUPTED)
    result = {
        "output_dir": str(out),
        "model": job.spec.name,
        "parameters": n_params,
        "kept": sorted(
            f"{p.fqn} {dtype_name(p.compute)}"
            for u in plan.units
            for p in u.params
            if p.rule != "default"
        ),
        "world_size": world,
        "backend": backend,
        "device": job.device.type,
        "losses": losses,
        "parity": parity,
        "reference_note": reference_note,
        "gradients": len(fqns),
        "counts": counts,
        "seconds": time.perf_counter() - start,
    }
    _write(out / _TRAIN, result)
    return result


def _first_forward(
    job: _Job, model: nn.Module, tokens: torch.Tensor, plan: PrecisionPlan
) -> torch.Tensor:
    try:
        return job.spec.loss(model, tokens)
    except RuntimeError as exc:
        if "dtype" not in str(exc):
            raise
        kept = sorted(p.fqn for u in plan.units for p in u.params if p.rule != "default")
        first = str(exc).splitlines()[0]
        raise RuntimeError(
            f"the forward failed with {len(kept)} kept parameters ({', '.join(kept[:3])}"
            f"{', ...' if len(kept) > 3 else ''}): {first}. A kept parameter's module receives "
            "activations in the unit's dtype and must cast them itself (the activation boundary "
            "is not moved, see docs/rules.md): keep only modules whose forward does"
        ) from exc


def _wrap_reference(ref: nn.Module, plan: PrecisionPlan, names: dict[int, str]) -> str | None:
    """Wrap ``ref`` the public-API way: every module holding kept parameters its own unit with
    ``param_dtype`` = their compute dtype (``None`` for their storage dtype) and no input cast,
    then the planned units with plain policies. Returns why it cannot, or ``None``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kept: dict[str, torch.dtype] = {}
    storage: dict[str, torch.dtype] = {}
    for unit in plan.units:
        for p in unit.params:
            for fqn in (p.fqn, *p.aliases):
                storage[fqn] = p.storage
                if p.rule != "default":
                    kept[fqn] = p.compute
    owners: dict[str, torch.dtype] = {}
    for fqn, dtype in kept.items():
        module = fqn.rpartition(".")[0]
        inside = [f for f in storage if f.startswith(module + ".") or not module]
        if any(kept.get(f) != dtype for f in inside):
            return (
                f"separate units cannot express this map ({module or 'the root'} also holds "
                "parameters in another dtype)"
            )
        owners[module] = dtype
    unit_modules = {names[id(m)] for u in plan.units for m in u.modules}
    for module, dtype in owners.items():
        if module in unit_modules:
            continue  # an all-kept unit: its planned policy below keeps it
        same = all(storage[f] == dtype for f in kept if f.startswith(module + "."))
        policy = MixedPrecisionPolicy(
            param_dtype=None if same else dtype,
            reduce_dtype=torch.float32,
            cast_forward_inputs=False,
        )
        fully_shard(ref.get_submodule(module), mp_policy=policy)
    for unit in plan.units:
        modules = [ref.get_submodule(names[id(m)]) for m in unit.modules]
        name = names[id(unit.modules[0])]
        param_dtype = owners.get(name, unit.policy.param_dtype)
        if name in owners and all(storage[f] == param_dtype for f in kept if f.startswith(name)):
            param_dtype = None
        policy = MixedPrecisionPolicy(
            param_dtype=param_dtype,
            reduce_dtype=unit.policy.reduce_dtype,
            output_dtype=unit.policy.output_dtype,
            cast_forward_inputs=unit.policy.cast_forward_inputs,
        )
        fully_shard(modules if len(modules) > 1 else modules[0], mp_policy=policy)
    return None


def _attribute_forward(
    rec: CollectiveRecorder, order: list[str], rows: dict[str, _UnitRow]
) -> None:
    # Forward all-gathers happen in order, one per unit, right after its pre-forward marker.
    for name, gather in zip(order, rec.of("all_gather"), strict=False):
        rows[name].forward_bytes += gather.output_bytes
        rows[name].wire = dtype_name(gather.dtype)


def _unit_table(rows: dict[str, _UnitRow], counts: dict[str, tuple[int, int]]) -> list[str]:
    width = max(10, *(len(n) for n in rows))
    header = (
        f"{'FSDP unit':<{width}} {'all-gathered params by dtype (numel)':<40} "
        f"{'bytes/all-gather':>16}  wire"
    )
    lines = ["observed in the first forward (rank 0):", header, "-" * len(header)]
    for row in rows.values():
        dtypes = ", ".join(f"{k} {v:,}" for k, v in sorted(row.gathered.items()))
        lines.append(f"{row.name:<{width}} {dtypes:<40} {row.forward_bytes:>16,}  {row.wire}")
    (ag, rs), (ag_ref, rs_ref) = counts["mapped"], counts["reference"]
    return [
        *lines,
        "",
        f"collectives per forward+backward: {ag} all-gathers, {rs} reduce-scatters "
        "(one all-gather per unit per unshard, one reduce-scatter per unit)",
        f"  separate fp32 child units instead: {ag_ref} all-gathers, {rs_ref} reduce-scatters "
        f"(+{ag_ref - ag} and +{rs_ref - rs})",
        "",
    ]


# --------------------------------------------------------------------------- phase 2: resume


def _resume_rank(opts: DemoOptions, out: Path) -> dict[str, Any] | None:
    """Phase 2 on this rank; rank 0 returns the results."""
    with _rank_group():
        return _resume(opts, out)


def _resume(opts: DemoOptions, out: Path) -> dict[str, Any] | None:
    start = time.perf_counter()
    job = _job(opts)
    world, k = dist.get_world_size(), opts.checkpoint_step
    _say(
        "",
        f"resume on {_processes(world)}: load the sharded checkpoint "
        f"of step {k} (saved by {opts.nproc} ranks), train steps {k + 1}..{opts.steps}",
    )
    model = wrap_model_for_training(job.model, job.config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=_LR)
    meta = load_checkpoint(out / _CHECKPOINT, model, optimizer)
    losses: list[float] = []
    progress = Progress(opts.steps - k, label="resume") if dist.get_rank() == 0 else None
    for step in range(meta["step"] + 1, opts.steps + 1):
        micro_losses = []
        for index in job.mine:
            loss = job.spec.loss(model, job.batch(opts, step, index))
            (loss * job.scale if job.scale != 1 else loss).backward()  # type: ignore[no-untyped-call]
            micro_losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_step_loss(micro_losses, job))
        if progress is not None:
            progress.update(step - k, loss=losses[-1])
    final = model_state_dict(model, "full")
    if dist.get_rank() != 0:
        return None
    uninterrupted = torch.load(out / _UNINTERRUPTED, weights_only=True)
    expected = uninterrupted["state"]
    differ = sorted(
        key
        for key, value in final.items()
        if value.dtype != expected[key].dtype or not torch.equal(value, expected[key])
    )
    max_diff = max(
        ((final[key].double() - expected[key].double()).abs().max().item() for key in differ),
        default=0.0,
    )
    files = [p for p in (out / _CHECKPOINT).rglob("*") if p.is_file()]
    result = {
        "world_size": world,
        "checkpoint_step": k,
        "checkpoint_world_size": meta["world_size"],
        "checkpoint_files": len(files),
        "checkpoint_bytes": sum(p.stat().st_size for p in files),
        "losses": losses,
        "expected_losses": uninterrupted["losses"][k:],
        "parameters": len(final),
        "differ": differ,
        "max_abs_diff": max_diff,
        "seconds": time.perf_counter() - start,
    }
    _write(out / _RESUME, result)
    return result


# --------------------------------------------------------------------------- summary


def _processes(n: int) -> str:
    return f"{n} process{'es' if n != 1 else ''}"


def _summary(opts: DemoOptions, train: dict[str, Any], resume: dict[str, Any], wall: float) -> int:
    """Print the summary of both phases; return the exit code."""
    k = opts.checkpoint_step
    bitwise = not resume["differ"] and resume["losses"] == resume["expected_losses"]
    if bitwise:
        resume_line = (
            f"bitwise identical to the uninterrupted run (losses of steps {k + 1}..{opts.steps}, "
            f"all {resume['parameters']} parameters)"
        )
        resume_ok = True
    else:
        resume_line = (
            f"{len(resume['differ'])} of {resume['parameters']} parameters differ from the "
            f"uninterrupted run, max |diff| {resume['max_abs_diff']:.3g}"
        )
        loss_diff = max(
            abs(a - b) / abs(b)
            for a, b in zip(resume["losses"], resume["expected_losses"], strict=True)
        )
        resume_line += f", losses within {loss_diff:.1e} (relative)"
        resume_ok = not opts.bitwise_resume_expected and loss_diff <= 1e-3
        resume_line += (
            " (FAILED: between 1 and 2 ranks the gradient sums are computed in the same order)"
            if opts.bitwise_resume_expected
            else f" (expected: {opts.nproc} and {opts.resume_world} ranks sum gradients in a "
            "different order; bitwise identity holds between 1 and 2 ranks)"
        )
    if train["parity"] is None:
        parity_line = f"skipped: {train['reference_note']}"
    elif train["parity"]:
        parity_line = (
            f"bitwise identical (losses, {train['gradients']} sharded gradients and parameters "
            f"after every step, on {_processes(train['world_size'])})"
        )
    else:
        parity_line = "FAILED (see the rank messages above)"
    losses = train["losses"]
    where = (
        f"kept in {train['output_dir']}"
        if opts.output_dir is not None
        else "removed (keep it with --output-dir DIR)"
    )
    lines = [
        "",
        "summary",
        f"  model       {train['model']}",
        f"  kept        {len(train['kept'])} parameters: {', '.join(train['kept'][:4])}"
        + (", ..." if len(train["kept"]) > 4 else ""),
        f"  trained     {opts.steps} steps on {_processes(train['world_size'])} "
        f"({train['backend']}, {train['device']}), loss {losses[0]:.4f} -> {losses[-1]:.4f}",
        f"  parity      vs separate fp32 units: {parity_line}",
    ]
    if train["counts"]:
        (ag, rs), (ag_ref, rs_ref) = train["counts"]["mapped"], train["counts"]["reference"]
        lines.append(
            f"  collectives {ag} all-gathers + {rs} reduce-scatters per forward+backward "
            f"(separate fp32 units: {ag_ref} + {rs_ref})"
        )
    lines += [
        f"  checkpoint  sharded, step {k}, {resume['checkpoint_files']} files, "
        f"{resume['checkpoint_bytes'] / 1024:,.0f} KiB, written by "
        f"{_processes(resume['checkpoint_world_size'])}; {where}",
        f"  resumed     on {_processes(resume['world_size'])}: {resume_line}",
        f"  time        {wall:.1f} s for both phases, process start-up included (in the "
        f"ranks: train {train['seconds']:.1f} s, resume {resume['seconds']:.1f} s)",
    ]
    print("\n".join(lines), flush=True)
    ok = train["parity"] is not False and resume_ok
    if not ok:
        print("demo FAILED", file=sys.stderr, flush=True)
    return 0 if ok else 1
