"""The cost model: collectives and bytes of one forward+backward, as FSDP2 issues them.

What FSDP2 does (``torch/distributed/fsdp/_fully_shard``), per unit that manages parameters:

- one all-gather before its forward;
- one more before its backward when it resharded after forward. ``reshard_after_forward=None``
  (torch's default) reshards every unit but the root, whose parameters backward needs first
  (``FSDPState._lazy_init`` clears the root's post-forward mesh); ``True`` reshards every unit,
  the root included; ``False`` (or the integer ``1``) none; another integer reshards to a smaller
  group, which still all-gathers again in backward (within that group);
- one reduce-scatter of its gradients in backward when it has trainable parameters, plus, on a
  2-D (HSDP) mesh, one all-reduce of the result across replicas.

CPU offload moves shards between host and device; it does not change these counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fsdp_precision._plan.records import PlannedUnit, gather_bytes

__all__ = ["Collectives", "Knobs", "gather_bytes", "totals", "unit_collectives"]


@dataclass(frozen=True, kw_only=True)
class Knobs:
    """The ``fully_shard`` arguments that change collectives.

    Attributes:
        reshard_after_forward: As passed to ``fully_shard``. (Default: ``None``)
        hsdp: A 2-D (replicate, shard) mesh. (Default: ``False``)
    """

    reshard_after_forward: bool | int | None = None
    hsdp: bool = False

    def checked_kwargs(self, fully_shard_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """``fully_shard_kwargs`` with these knobs' ``reshard_after_forward``, checked against
        the knobs (``ValueError`` naming the fix): counts compiled for other knobs are wrong."""
        kwargs = dict(fully_shard_kwargs)
        given = kwargs.setdefault("reshard_after_forward", self.reshard_after_forward)
        planned = self.reshard_after_forward
        if (type(given), given) != (type(planned), planned):
            raise ValueError(
                f"fully_shard_kwargs reshard_after_forward={given!r} contradicts the plan's "
                f"reshard_after_forward={planned!r}, which its collective counts assume; compile "
                f"the plan with reshard_after_forward={given!r} instead"
            )
        mesh = kwargs.get("mesh")
        two_d = mesh is not None and mesh.ndim == 2
        if two_d != self.hsdp:
            raise ValueError(
                f"the plan was compiled with hsdp={self.hsdp} but the mesh is "
                f"{'2-D' if two_d else '1-D'}; compile it with hsdp={two_d}"
            )
        return kwargs

    def regathers(self, is_root: bool) -> bool:
        """Whether a unit all-gathers again in backward."""
        rsf = self.reshard_after_forward
        if rsf is None:
            return not is_root
        if isinstance(rsf, bool):
            return rsf
        return rsf != 1  # an integer: 1 is False, any other group size reshards


@dataclass(frozen=True)
class Collectives:
    """Collectives of one forward+backward.

    Attributes:
        all_gathers: Parameter all-gathers.
        reduce_scatters: Gradient reduce-scatters.
        all_reduces: Gradient all-reduces across replicas (HSDP).
    """

    all_gathers: int = 0
    reduce_scatters: int = 0
    all_reduces: int = 0

    def __add__(self, other: Collectives) -> Collectives:
        return Collectives(
            self.all_gathers + other.all_gathers,
            self.reduce_scatters + other.reduce_scatters,
            self.all_reduces + other.all_reduces,
        )


def unit_collectives(unit: PlannedUnit, knobs: Knobs) -> Collectives:
    """Collectives of one unit in one forward+backward."""
    if not unit.params:
        return Collectives()
    trainable = int(unit.trainable)
    return Collectives(
        all_gathers=2 if knobs.regathers(unit.is_root) else 1,
        reduce_scatters=trainable,
        all_reduces=trainable if knobs.hsdp else 0,
    )


def totals(units: Sequence[PlannedUnit], world_size: int, knobs: Knobs) -> dict[str, Any]:
    """Units, collectives per step and bytes all-gathered per step."""
    total = Collectives()
    step_bytes = 0
    for unit in units:
        counts = unit_collectives(unit, knobs)
        total += counts
        step_bytes += sum(gather_bytes(unit.params, world_size).values()) * counts.all_gathers
    return {
        "units": len([u for u in units if u.params]),
        "all_gathers_per_step": total.all_gathers,
        "reduce_scatters_per_step": total.reduce_scatters,
        "all_reduces_per_step": total.all_reduces,
        "all_gather_bytes_per_step": step_bytes,
    }


def compiled_graph_breaks(units: Sequence[PlannedUnit]) -> int:
    """Graph breaks per forward when every unit but the root is ``torch.compile``d (as
    torchtitan and ``DistributedConfig(compile_units=...)`` compile their blocks): one per
    separate unit called inside a compiled unit, whose FSDP hooks dynamo does not trace.
    Parameters kept inside a unit add none."""
    compiled = [u for u in units if not u.is_root and not u.separate_unit]
    inside = {id(m) for u in compiled for member in u.modules for m in member.modules()}
    return sum(1 for u in units if u.separate_unit and any(id(m) in inside for m in u.modules))
