"""The demo's job: train a plan-wrapped model next to a separate-units reference, checkpoint,
resume at another world size, and return what was found as typed records.

Phase 1 (:class:`Training`): the model is wrapped by :func:`wrap_model_for_training` and, side by
side on the same batches, a copy wrapped the public-API way (every kept module its own FSDP
unit). Losses, every sharded gradient and every parameter after each AdamW step are compared
bitwise. A sharded checkpoint is saved at ``checkpoint_step``, and the final full state of this
uninterrupted run is kept next to it.

Phase 2 (:func:`resume`): a fresh model loads the sharded checkpoint (DCP resharding), trains the
remaining steps on the same batches, and its losses and final parameters are compared with the
uninterrupted run.

The global batch is a fixed list of micro-batches, split across however many ranks there are,
with the loss scaled so that the averaged gradient is the same sum at every world size. Nothing
here prints: progress goes to ``on_step(step, loss)``, everything else into the results.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_precision._base.dist import gather_across_ranks
from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._base.errors import ParamDtypeMapError
from fsdp_precision._cli.demo.results import (
    PARITY_RTOL,
    ResumeResult,
    TrainResult,
    UnitGathers,
    parity_is_bitwise_expected,
)
from fsdp_precision._edges.checkpoint.save_load import load_checkpoint, save_checkpoint
from fsdp_precision._edges.checkpoint.state import model_state_dict
from fsdp_precision._observe.collectives import CollectiveRecorder
from fsdp_precision._observe.gathers import GatherProbe
from fsdp_precision._plan.plan import PrecisionPlan
from fsdp_precision._plan.separate import wrap_separate_units
from fsdp_precision._plan.units import block_class_names
from fsdp_precision._train.config import DistributedConfig
from fsdp_precision._train.wrap import wrap_model_for_training
from fsdp_precision._verify.compare import same_bits

__all__ = ["DemoJob", "Training", "kept_params", "resume", "smallest_block"]

CHECKPOINT, UNINTERRUPTED = "checkpoint", "uninterrupted.pt"

OnStep = Callable[[int, float], None]


@dataclass(frozen=True, kw_only=True)
class DemoJob:
    """What both phases build identically on every rank.

    Attributes:
        name: The model's name in the results.
        model: The model (fp32 master weights, on ``device``), not wrapped yet.
        config: How to wrap it (:func:`wrap_model_for_training`).
        loss: ``loss(model, batch)``: the mean loss of one micro-batch.
        batch: ``batch(step, index)``: micro-batch ``index`` of ``step`` on ``device``, the same
            whichever rank draws it.
        micro: Micro-batches per step over all ranks (divisible by every world size used).
        device: Where the model and the batches live.
        lr: AdamW's learning rate. (Default: 1e-2)
        started: When this phase started (``time.perf_counter()``). (Default: now)
    """

    name: str
    model: nn.Module
    config: DistributedConfig
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    batch: Callable[[int, int], torch.Tensor]
    micro: int
    device: torch.device
    lr: float = 1e-2
    started: float = field(default_factory=time.perf_counter)

    @property
    def mine(self) -> range:
        """This rank's micro-batch indices."""
        per = self.micro // dist.get_world_size()
        return range(dist.get_rank() * per, (dist.get_rank() + 1) * per)

    @property
    def scale(self) -> float:
        """Loss scale: FSDP averages over ranks, the step averages over micro-batches."""
        return dist.get_world_size() / self.micro

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` scaled by :attr:`scale`."""
        (loss * self.scale if self.scale != 1 else loss).backward()  # type: ignore[no-untyped-call]


def smallest_block(model: nn.Module) -> int:
    """The smallest transformer block: the auto-wrap threshold that makes every block a unit."""
    blocks = block_class_names(model)
    sizes = [
        sum(p.numel() for p in m.parameters())
        for m in model.modules()
        if type(m).__name__ in blocks
    ]
    return min(sizes, default=1)


def kept_params(plan: PrecisionPlan) -> list[str]:
    """``"fqn dtype"`` of every parameter a rule kept in another compute dtype, sorted."""
    kept = (p for u in plan.units for p in u.params if p.mapped)
    return sorted(f"{p.fqn} {dtype_name(p.compute)}" for p in kept)


@dataclass(frozen=True)
class _MicroLosses:
    """One rank's micro-batch losses of a step, by global micro-batch index."""

    indices: tuple[int, ...]
    losses: tuple[float, ...]


def _step_loss(losses: list[torch.Tensor], job: DemoJob) -> float:
    """The step's loss: the mean of every rank's micro-batch losses, in micro-batch order."""
    mine = _MicroLosses(tuple(job.mine), tuple(float(loss) for loss in losses))
    by_index: dict[int, float] = {}
    for rank in gather_across_ranks(mine):
        by_index.update(zip(rank.indices, rank.losses, strict=True))
    everyone = torch.tensor([by_index[i] for i in range(job.micro)], dtype=torch.float64)
    return float(everyone.mean())


def _local(t: Any) -> torch.Tensor:
    out: torch.Tensor = t.to_local() if hasattr(t, "to_local") else t
    return out


# --------------------------------------------------------------------------- phase 1: train


class Training:
    """Phase 1: wraps ``job.model`` by its plan and a deep copy as the separate-units reference.

    :attr:`reference_note` says why there is no reference (``None``: there is one); then
    :meth:`run` trains both. Every rank builds one and calls :meth:`run` (collectives).
    """

    def __init__(self, job: DemoJob, plan: PrecisionPlan) -> None:
        self.job, self.plan = job, plan
        self.ours, self.ref = job.model, copy.deepcopy(job.model)
        self._parameters = sum(p.numel() for p in self.ours.parameters())
        names = {id(m): n for n, m in self.ours.named_modules()}
        self._units = [
            (u.name, self.ours.get_submodule(names[id(u.modules[0])])) for u in plan.units
        ]
        self.reference_note: str | None = None
        try:
            wrap_separate_units(self.ref, plan)
        except ParamDtypeMapError as err:  # refused before anything of ref was wrapped
            self.reference_note = str(err)
        wrap_model_for_training(self.ours, job.config)

    def run(
        self, *, steps: int, checkpoint_step: int, out: Path, on_step: OnStep | None = None
    ) -> TrainResult:
        """Train ``steps`` steps, save the sharded checkpoint after ``checkpoint_step`` under
        ``out`` and the uninterrupted run's final state next to it (rank 0)."""
        job, ours, ref = self.job, self.ours, self.ref
        has_reference = self.reference_note is None
        bitwise = parity_is_bitwise_expected(job.device.type, dist.get_world_size())
        same = same_bits if bitwise else _close
        rows: dict[str, dict[str, Any]] = {
            n: {"gathered": {}, "bytes": 0, "wire": ""} for n, _ in self._units
        }
        order: list[str] = []
        markers = [
            m.register_forward_pre_hook(lambda *_, n=n: order.append(n), prepend=True)
            for n, m in self._units
        ]
        fqns = [n for n, _ in ours.named_parameters()]
        opt_ours = torch.optim.AdamW(ours.parameters(), lr=job.lr)
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=job.lr)
        mismatches: list[str] = []
        losses: list[float] = []
        counts: dict[str, tuple[int, int]] = {}
        for step in range(1, steps + 1):
            micro_losses = []
            for index in job.mine:
                tokens = job.batch(step, index)
                first = step == 1 and index == job.mine[0]
                probe = GatherProbe(ours) if first else None
                with CollectiveRecorder() as rec_ours:
                    loss = job.loss(ours, tokens)
                    if first:
                        # Forward all-gathers happen in order, one per unit, after its marker.
                        for name, gather in zip(order, rec_ours.of("all_gather"), strict=False):
                            rows[name]["bytes"] += gather.output_bytes
                            rows[name]["wire"] = dtype_name(gather.dtype)
                    job.backward(loss)
                if probe is not None:  # observation is for the first micro-batch only
                    probe.remove()
                    for handle in markers:
                        handle.remove()
                    for fqn, seen in probe.seen.items():
                        gathered = rows[self.plan.unit_names[fqn]]["gathered"]
                        key = dtype_name(seen.dtype)
                        gathered[key] = gathered.get(key, 0) + seen.numel
                micro_losses.append(loss.detach())
                if not has_reference:
                    continue
                with CollectiveRecorder() as rec_ref:
                    loss_ref = job.loss(ref, tokens)
                    job.backward(loss_ref)
                if first:
                    counts = {
                        "mapped": (rec_ours.count("all_gather"), rec_ours.count("reduce_scatter")),
                        "reference": (rec_ref.count("all_gather"), rec_ref.count("reduce_scatter")),
                    }
                if not same(loss, loss_ref):
                    mismatches.append(f"step {step}: loss of micro-batch {index}")
            if has_reference:
                for name, po, pr in zip(fqns, ours.parameters(), ref.parameters(), strict=True):
                    go, gr = _local(po.grad), _local(pr.grad)
                    if not same(go, gr):
                        mismatches.append(f"step {step}: grad {name}")
            opt_ours.step()
            opt_ours.zero_grad()
            if has_reference:
                opt_ref.step()
                opt_ref.zero_grad()
                for name, po, pr in zip(fqns, ours.parameters(), ref.parameters(), strict=True):
                    if not same(_local(po), _local(pr)):
                        mismatches.append(f"step {step}: param {name}")
            losses.append(_step_loss(micro_losses, job))
            if step == checkpoint_step:
                save_checkpoint(out / CHECKPOINT, ours, opt_ours, step=step)
            if on_step is not None:
                on_step(step, losses[-1])
        final = model_state_dict(ours, "full")
        parity = all(gather_across_ranks(not mismatches)) if has_reference else None
        if dist.get_rank() == 0:
            torch.save({"losses": losses, "state": final}, out / UNINTERRUPTED)
        return TrainResult(
            output_dir=str(out),
            model=job.name,
            parameters=self._parameters,
            kept=kept_params(self.plan),
            world_size=dist.get_world_size(),
            backend=dist.get_backend(),
            device=job.device.type,
            losses=losses,
            parity=parity,
            parity_bitwise=bitwise,
            reference_note=self.reference_note,
            gradients=len(fqns),
            counts=counts,
            seconds=time.perf_counter() - job.started,
            units=tuple(
                UnitGathers(name, row["gathered"], row["bytes"], row["wire"])
                for name, row in rows.items()
            ),
            mismatches=tuple(mismatches),
        )


def _close(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and torch.allclose(a.float(), b.float(), rtol=PARITY_RTOL, atol=0)


# --------------------------------------------------------------------------- phase 2: resume


def resume(
    job: DemoJob, out: Path, *, steps: int, on_step: OnStep | None = None
) -> ResumeResult | None:
    """Phase 2 on every rank: load ``out``'s sharded checkpoint into ``job.model`` (wrapped
    here), train to ``steps`` and compare with the uninterrupted run; rank 0 returns the
    result, the other ranks ``None``."""
    model = wrap_model_for_training(job.model, job.config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.lr)
    meta = load_checkpoint(out / CHECKPOINT, model, optimizer)
    k = int(meta["step"])
    losses: list[float] = []
    for step in range(k + 1, steps + 1):
        micro_losses = []
        for index in job.mine:
            loss = job.loss(model, job.batch(step, index))
            job.backward(loss)
            micro_losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_step_loss(micro_losses, job))
        if on_step is not None:
            on_step(step, losses[-1])
    final = model_state_dict(model, "full")
    if dist.get_rank() != 0:
        return None
    uninterrupted = torch.load(out / UNINTERRUPTED, weights_only=True)
    expected = uninterrupted["state"]
    differ = sorted(key for key, value in final.items() if not same_bits(value, expected[key]))
    max_diff = max(
        ((final[key].double() - expected[key].double()).abs().max().item() for key in differ),
        default=0.0,
    )
    files = [p for p in (out / CHECKPOINT).rglob("*") if p.is_file()]
    return ResumeResult(
        world_size=dist.get_world_size(),
        checkpoint_step=k,
        checkpoint_world_size=int(meta["world_size"]),
        checkpoint_files=len(files),
        checkpoint_bytes=sum(p.stat().st_size for p in files),
        losses=losses,
        expected_losses=uninterrupted["losses"][k:],
        parameters=len(final),
        differ=differ,
        max_abs_diff=max_diff,
        seconds=time.perf_counter() - job.started,
    )
