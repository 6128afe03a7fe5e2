"""Beside FSDP: tensor, expert and pipeline parallelism, and what they change per rank.

The layouts come from the model's own declared plans (a transformers model's ``tp_plan``,
``ep_plan`` and ``pp_plan``, root-relative keys with ``*`` for a layer index), laid out as
torchtitan's decoder recipe and transformers' native distributed training lay them out:

- **TP** (``tp`` ranks). A parameter under a column-wise entry (``colwise``, ``packed_colwise``,
  ``embedding_rowwise``, ...) is sharded on its output dim (dim -2 of a weight, dim 0 of a
  bias), under a row-wise one on its input dim (dim -1; a bias stays whole); FSDP then shards
  and all-gathers that TP shard. Under ``replicated_with_grad_allreduce`` or
  ``sequence_parallel`` it is whole on every TP rank with a partial gradient: one all-reduce of
  the whole gradient over the TP ranks per step, which torch 2.11-2.14 run in the compute dtype
  and the patch in the reduce dtype (pytorch #190626). A parameter in no entry is whole on
  every TP rank and needs no TP collective.
- **EP** (``ep`` ranks). A parameter under an ``ep_plan`` entry is an expert weight: each rank
  holds ``1/ep`` of the experts (dim 0), FSDP-sharded on the ``efsdp`` ranks
  (``dp * tp / ep``, as torchtitan and transformers borrow EP from the data and tensor ranks),
  not TP-sharded. A unit holding experts and other parameters is two parameter groups
  (torchtitan's ``ShardPlacementResult`` layout): an all-gather and a reduce-scatter each.
- **PP** (``pp`` stages). The layers of the ``pp_plan``'s module list split evenly in order,
  what comes before them on the first stage, what comes after on the last; each stage makes
  its own units of its share of a unit's parameters. Counts are per rank, per stage.

``world_size`` stays the FSDP shard degree (``dp``); the job has ``dp * tp * pp`` ranks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.nn as nn

from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._plan.data import PlanData
from fsdp_precision._plan.quantized import wire_itemsize

if TYPE_CHECKING:
    from fsdp_precision._plan.records import PlannedParam

__all__ = ["Meshes", "mesh_lines", "mesh_totals"]

#: TP styles (transformers' ``ALL_PARALLEL_STYLES``) by what they do to a parameter.
_OUTPUT_DIM = ("colwise", "packed_colwise", "colwise_rep", "colwise_gather_output",
               "embedding_rowwise", "local_colwise")  # fmt: skip
_INPUT_DIM = ("rowwise", "packed_rowwise", "rowwise_rep", "rowwise_split_input",
              "embedding_colwise", "local_rowwise")  # fmt: skip
_PARTIAL = ("replicated_with_grad_allreduce", "sequence_parallel")


@dataclass(frozen=True, kw_only=True)
class Meshes:
    """Parallel degrees beside FSDP (whose degree is the plan's ``world_size``).

    Attributes:
        tp: Tensor-parallel ranks. (Default: ``1``)
        ep: Expert-parallel ranks, borrowed from ``world_size * tp``. (Default: ``1``)
        pp: Pipeline stages. (Default: ``1``)
    """

    tp: int = 1
    ep: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Meshes({name}=...) must be an int >= 1, got {value!r}")

    @property
    def trivial(self) -> bool:
        """Whether FSDP runs alone (every degree 1)."""
        return (self.tp, self.ep, self.pp) == (1, 1, 1)


@dataclass(frozen=True)
class _Layout:
    shard_dim: int | None  # the TP shard dim, None when whole on every TP rank
    partial: bool  # whole with a partial gradient: a TP all-reduce per step
    expert: bool
    stage: int


def mesh_totals(plan: PlanData, meshes: Meshes) -> dict[str, Any]:
    """Per stage, per rank and step: units, all-gathers, reduce-scatters, bytes all-gathered,
    TP gradient all-reduces and their bytes in the reduce dtype and in the compute dtype.
    Raises ``ValueError`` naming the fix when a degree cannot be laid out on this model."""
    dp = plan.world_size
    efsdp = _efsdp(dp, meshes)
    layouts = _layouts(plan, meshes)
    stages = []
    for stage in range(meshes.pp):
        units = all_gathers = reduce_scatters = gathered = 0
        tp_reduces = tp_bytes = tp_bytes_compute = 0
        for unit in plan.units:
            params = [p for p in unit.params if layouts[p.fqn].stage == stage]
            if not params:
                continue
            units += 1
            counts = plan.collectives(unit)
            for group in (_group(params, layouts, True), _group(params, layouts, False)):
                if not group:
                    continue
                degree = efsdp if layouts[group[0].fqn].expert else dp
                local = sum(_gather_bytes(p, layouts[p.fqn], meshes, degree) for p in group)
                all_gathers += counts.all_gathers
                gathered += local * counts.all_gathers
                reduce_scatters += int(any(p.reduce is not None for p in group))
            for p in params:
                if layouts[p.fqn].partial and p.reduce is not None and meshes.tp > 1:
                    tp_reduces += 1
                    tp_bytes += _numel(p) * p.reduce.itemsize
                    tp_bytes_compute += _numel(p) * p.compute.itemsize
        stages.append({
            "stage": stage, "units": units, "all_gathers_per_step": all_gathers,
            "reduce_scatters_per_step": reduce_scatters, "all_gather_bytes_per_step": gathered,
            "tp_all_reduces_per_step": tp_reduces, "tp_all_reduce_bytes_per_step": tp_bytes,
            "tp_all_reduce_bytes_in_compute_dtype": tp_bytes_compute,
        })  # fmt: skip
    return {
        "tp": meshes.tp, "ep": meshes.ep, "pp": meshes.pp, "dp": dp, "efsdp": efsdp,
        "ranks": dp * meshes.tp * meshes.pp,
        "tp_sharded": sum(lay.shard_dim is not None for lay in layouts.values()),
        "tp_partial": sorted(f for f, lay in layouts.items() if lay.partial and meshes.tp > 1),
        "experts": sum(lay.expert for lay in layouts.values()),
        "stages": stages,
    }  # fmt: skip


def mesh_lines(plan: PlanData, meshes: Meshes) -> list[str]:
    """``explain()``'s lines for ``meshes``."""
    t = mesh_totals(plan, meshes)
    reduce = plan.rules.reduce_dtype or plan.rules.param_dtype
    compute = plan.rules.param_dtype
    lines = [
        f"beside FSDP {t['dp']}: TP {t['tp']} x EP {t['ep']} x PP {t['pp']} ({t['ranks']} ranks), "
        f"from the model's own tp/ep/pp plans: {t['tp_sharded']} parameters TP-sharded, "
        f"{len(t['tp_partial'])} with a partial TP gradient, {t['experts']} expert weights"
        + (f" on efsdp {t['efsdp']}" if meshes.ep > 1 else ""),
    ]
    for s in t["stages"]:
        tp = ""
        if s["tp_all_reduces_per_step"]:
            tp = (
                f"; TP: {s['tp_all_reduces_per_step']} gradient all-reduces, "
                f"{s['tp_all_reduce_bytes_per_step']:,} bytes in "
                f"{dtype_name(reduce) if reduce else 'the reduce dtype'} under the patch "
                f"({s['tp_all_reduce_bytes_in_compute_dtype']:,} in "
                f"{dtype_name(compute) if compute else 'the compute dtype'} by torch 2.11-2.14 "
                "alone, pytorch #190626)"
            )
        lines.append(
            f"  stage {s['stage']}: {s['units']} units; per rank per step "
            f"{s['all_gathers_per_step']} all-gathers, {s['reduce_scatters_per_step']} "
            f"reduce-scatters, {s['all_gather_bytes_per_step']:,} bytes all-gathered{tp}"
        )
    return lines


def _efsdp(dp: int, meshes: Meshes) -> int:
    if meshes.ep == 1:
        return dp
    if (dp * meshes.tp) % meshes.ep:
        raise ValueError(
            f"expert parallelism of {meshes.ep} borrows from the data and tensor ranks "
            f"(world_size {dp} x tp {meshes.tp}), which it must divide; choose an ep that does"
        )
    return dp * meshes.tp // meshes.ep


def _group(
    params: list[PlannedParam], layouts: dict[str, _Layout], expert: bool
) -> list[PlannedParam]:
    return [p for p in params if layouts[p.fqn].expert == expert]


def _numel(p: PlannedParam) -> int:
    n = 1
    for size in p.shape:
        n *= size
    return n


def _gather_bytes(p: PlannedParam, layout: _Layout, meshes: Meshes, degree: int) -> int:
    """Bytes of one all-gather of ``p`` on a rank: its TP or EP shard, FSDP's dim-0 padding."""
    shape = list(p.shape) or [1]
    if layout.expert and meshes.ep > 1:
        shape[0] = -(-shape[0] // meshes.ep)
    elif layout.shard_dim is not None and meshes.tp > 1:
        dim = layout.shard_dim % len(shape)
        shape[dim] = -(-shape[dim] // meshes.tp)
    shape[0] = -(-shape[0] // degree) * degree
    n = 1
    for size in shape:
        n *= size
    wire = wire_itemsize(p.gathered_as) if p.gathered_as else None
    return n * (wire or p.compute.itemsize)


def _layouts(plan: PlanData, meshes: Meshes) -> dict[str, _Layout]:
    model = plan.model
    tp_plan = _declared(model, "tp_plan") if meshes.tp > 1 else {}
    ep_plan = _declared(model, "ep_plan") if meshes.ep > 1 else {}
    stage_of = _stages(plan, meshes)
    out = {}
    for unit in plan.units:
        for p in unit.params:
            style = _style(p.fqn, tp_plan)
            expert = _style(p.fqn, ep_plan) is not None
            dim = None
            if style in _OUTPUT_DIM:
                dim = -2 if len(p.shape) >= 2 else 0
            elif style in _INPUT_DIM and len(p.shape) >= 2:
                dim = -1
            partial = style in _PARTIAL
            out[p.fqn] = _Layout(None if expert else dim, partial and not expert, expert,
                                 stage_of(p.fqn))  # fmt: skip
    return out


def _declared(model: Any, name: str) -> dict[str, Any]:
    declared = getattr(model, name, None)
    if not isinstance(declared, dict) or not declared:
        what = {"tp_plan": "--tp / Meshes(tp=...)", "ep_plan": "--ep / Meshes(ep=...)",
                "pp_plan": "--pp / Meshes(pp=...)"}[name]  # fmt: skip
        raise ValueError(
            f"{type(model).__name__} declares no {name} (a transformers model's "
            f"base_model_{name}): the mesh costs follow the model's own plan; drop {what}"
        )
    return declared


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile(re.escape(key).replace(r"\*", r"\d+") + r"(\.[^.]+)?")


def _style(fqn: str, declared: dict[str, Any]) -> Any:
    """The most specific entry matching the parameter or its module."""
    best: tuple[int, Any] | None = None
    for key, style in declared.items():
        if _pattern(key).fullmatch(fqn) and (best is None or len(key) > best[0]):
            best = (len(key), style)
    return best[1] if best else None


def _stages(plan: PlanData, meshes: Meshes) -> Any:
    """A parameter's pipeline stage (0 without PP)."""
    if meshes.pp == 1:
        return lambda fqn: 0
    pp_plan = _declared(plan.model, "pp_plan")
    lists = [k for k in pp_plan if "*" not in k and _is_list(plan.model, k)]
    if len(lists) != 1:
        raise ValueError(
            f"{type(plan.model).__name__}'s pp_plan names {len(lists)} module lists, not one: "
            "the stages cannot be laid out; drop --pp / Meshes(pp=...)"
        )
    layers = lists[0]
    count = len(list(plan.model.get_submodule(layers).children()))
    if count < meshes.pp:
        raise ValueError(f"pp={meshes.pp} stages for {count} layers: choose pp <= {count}")
    order = [n for n, _ in plan.model.named_modules()]
    before = set(order[: order.index(layers)])
    inside = re.compile(re.escape(layers) + r"\.(\d+)\.")

    def stage(fqn: str) -> int:
        found = inside.match(fqn)
        if found:
            return int(found.group(1)) * meshes.pp // count
        module = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        return 0 if module in before and module else meshes.pp - 1

    return stage


def _is_list(model: Any, key: str) -> bool:
    try:
        return isinstance(model.get_submodule(key), nn.ModuleList)
    except AttributeError:
        return False
