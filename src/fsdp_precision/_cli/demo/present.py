"""What the demo prints: lines on rank 0, progress, the per-unit table, the summary."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from fsdp_precision._cli.demo.results import PARITY_RTOL, ResumeResult, TrainResult, UnitGathers
from fsdp_precision._cli.progress import Progress

__all__ = ["progress", "say", "summary", "unit_table"]


def say(*lines: str) -> None:
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)


def progress(total: int, label: str, offset: int = 0) -> Callable[[int, float], None] | None:
    """``on_step`` for the job: a progress bar on rank 0, nothing elsewhere."""
    if dist.get_rank() != 0:
        return None
    bar = Progress(total, label=label)

    def on_step(step: int, loss: float) -> None:
        bar.update(step - offset, loss=loss)

    return on_step


def unit_table(units: tuple[UnitGathers, ...], counts: dict[str, tuple[int, int]]) -> list[str]:
    width = max(10, *(len(u.name) for u in units))
    header = (
        f"{'FSDP unit':<{width}} {'all-gathered params by dtype (numel)':<40} "
        f"{'bytes/all-gather':>16}  wire"
    )
    lines = ["observed in the first forward (rank 0):", header, "-" * len(header)]
    for unit in units:
        dtypes = ", ".join(f"{k} {v:,}" for k, v in sorted(unit.gathered.items()))
        lines.append(f"{unit.name:<{width}} {dtypes:<40} {unit.forward_bytes:>16,}  {unit.wire}")
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


def processes(n: int) -> str:
    return f"{n} process{'es' if n != 1 else ''}"


def summary(opts: Any, train: TrainResult, resume: ResumeResult, wall: float) -> int:
    """Print the summary of both phases; return the exit code."""
    k = opts.checkpoint_step
    if resume.bitwise:
        resume_line = (
            f"bitwise identical to the uninterrupted run (losses of steps {k + 1}..{opts.steps}, "
            f"all {resume.parameters} parameters)"
        )
    else:
        resume_line = (
            f"{len(resume.differ)} of {resume.parameters} parameters differ from the "
            f"uninterrupted run, max |diff| {resume.max_abs_diff:.3g}"
            f", losses within {resume.loss_rel_diff:.1e} (relative)"
        )
        resume_line += (
            " (FAILED: between 1 and 2 ranks the gradient sums are computed in the same order)"
            if resume.bitwise_expected
            else f" (expected: {opts.nproc} and {opts.resume_world} ranks sum gradients in a "
            "different order; bitwise identity holds between 1 and 2 ranks)"
        )
    if train.parity is None:
        parity_line = f"skipped: {train.reference_note}"
    elif train.parity and train.parity_bitwise:
        parity_line = (
            f"bitwise identical (losses, {train.gradients} sharded gradients and parameters "
            f"after every step, on {processes(train.world_size)})"
        )
    elif train.parity:
        parity_line = (
            f"identical within rtol {PARITY_RTOL:g} (losses, {train.gradients} sharded "
            f"gradients and parameters after every step, on {processes(train.world_size)}: "
            "NCCL sums 3+ ranks in an order that depends on a gradient's offset, which differs "
            "between the layouts)"
        )
    else:
        parity_line = "FAILED (see the rank messages above)"
    where = (
        f"kept in {train.output_dir}"
        if opts.output_dir is not None
        else "removed (keep it with --output-dir DIR)"
    )
    lines = [
        "",
        "summary",
        f"  model       {train.model}",
        f"  kept        {len(train.kept)} parameters: {', '.join(train.kept[:4])}"
        + (", ..." if len(train.kept) > 4 else ""),
        f"  trained     {opts.steps} steps on {processes(train.world_size)} "
        f"({train.backend}, {train.device}), loss {train.losses[0]:.4f} -> {train.losses[-1]:.4f}",
        f"  parity      vs separate fp32 units: {parity_line}",
    ]
    if train.counts:
        (ag, rs), (ag_ref, rs_ref) = train.counts["mapped"], train.counts["reference"]
        lines.append(
            f"  collectives {ag} all-gathers + {rs} reduce-scatters per forward+backward "
            f"(separate fp32 units: {ag_ref} + {rs_ref})"
        )
    lines += [
        f"  checkpoint  sharded, step {k}, {resume.checkpoint_files} files, "
        f"{resume.checkpoint_bytes / 1024:,.0f} KiB, written by "
        f"{processes(resume.checkpoint_world_size)}; {where}",
        f"  resumed     on {processes(resume.world_size)}: {resume_line}",
        f"  time        {wall:.1f} s for both phases, process start-up included (in the "
        f"ranks: train {train.seconds:.1f} s, resume {resume.seconds:.1f} s)",
    ]
    print("\n".join(lines), flush=True)
    ok = train.parity is not False and resume.ok
    if not ok:
        print("demo FAILED", file=sys.stderr, flush=True)
    return 0 if ok else 1
