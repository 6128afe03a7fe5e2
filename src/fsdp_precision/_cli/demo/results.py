"""What the demo's two phases found, as typed records (the CLI turns them into text and JSON)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "PARITY_RTOL",
    "ResumeResult",
    "TrainResult",
    "UnitGathers",
    "parity_is_bitwise_expected",
    "resume_is_bitwise_expected",
]

#: The largest relative loss difference accepted where a resumed run cannot be bitwise.
RESUME_LOSS_RTOL = 1e-3


@dataclass(frozen=True)
class UnitGathers:
    """One FSDP unit in the first forward (rank 0's view).

    Attributes:
        name: The unit's name in the plan.
        gathered: Elements all-gathered by compute dtype name (``{"bfloat16": 4096}``).
        forward_bytes: Bytes the unit's forward all-gather delivered.
        wire: Dtype name on the wire (``"uint8"`` when mixed dtypes travel as bytes).
    """

    name: str
    gathered: dict[str, int] = field(default_factory=dict)
    forward_bytes: int = 0
    wire: str = ""


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """Phase 1 on one rank: training next to the separate-units reference.

    ``parity`` is ``None`` when there is no reference (``reference_note`` says why), else whether
    every rank found losses, sharded gradients and parameters bitwise identical after every
    step (``parity_bitwise``; else within :data:`PARITY_RTOL`, see
    :func:`parity_is_bitwise_expected`). ``mismatches`` are this rank's own. ``counts``:
    collectives of the first micro-batch's forward and backward, ``{"mapped": (all_gathers,
    reduce_scatters), "reference": (...)}``.
    """

    output_dir: str
    model: str
    parameters: int
    kept: list[str]
    world_size: int
    backend: str
    device: str
    losses: list[float]
    parity: bool | None
    parity_bitwise: bool = True
    reference_note: str | None
    gradients: int
    counts: dict[str, tuple[int, int]]
    seconds: float
    units: tuple[UnitGathers, ...] = ()
    mismatches: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``train.json``), without the per-unit and per-rank details."""
        out = asdict(self)
        del out["units"], out["mismatches"]
        return out


#: Where the parity with separate units cannot be bitwise: the largest relative difference of a
#: loss, sharded gradient or parameter accepted (an fp32 sum of the same terms in another order).
PARITY_RTOL = 1e-3


def parity_is_bitwise_expected(device_type: str, world_size: int) -> bool:
    """Whether the library and separate units sum every gradient in the same order. On the CPU
    (gloo) they do. On GPUs up to 2 ranks they do (a sum of two is commutative; the demo runs
    with deterministic algorithms, so DeepSeek-V3's ``index_add_`` is too); from 3 ranks on
    NCCL's reduce-scatter sums in an order that depends on a gradient's offset in its buffer,
    and the two layouts place gradients at different offsets."""
    return device_type == "cpu" or world_size <= 2


def resume_is_bitwise_expected(train_world: int, resume_world: int) -> bool:
    """Whether both world sizes compute the averaged gradient sums in the same order: between
    1 and 2 ranks they do (``(g + g) / 2 == g``), so a resumed run is bitwise identical."""
    return {train_world, resume_world} <= {1, 2}


@dataclass(frozen=True, kw_only=True)
class ResumeResult:
    """Phase 2: the sharded checkpoint resumed (at another world size) and trained to the end.

    ``differ`` lists the parameters whose final values differ from the uninterrupted run.
    """

    world_size: int
    checkpoint_step: int
    checkpoint_world_size: int
    checkpoint_files: int
    checkpoint_bytes: int
    losses: list[float]
    expected_losses: list[float]
    parameters: int
    differ: list[str]
    max_abs_diff: float
    seconds: float

    @property
    def bitwise(self) -> bool:
        """Losses and every final parameter bitwise identical to the uninterrupted run."""
        return not self.differ and self.losses == self.expected_losses

    @property
    def bitwise_expected(self) -> bool:
        """Whether the checkpoint's and this world size sum gradients in the same order."""
        return resume_is_bitwise_expected(self.checkpoint_world_size, self.world_size)

    @property
    def loss_rel_diff(self) -> float:
        """The largest relative difference of a loss from the uninterrupted run's."""
        return max(
            (abs(a - b) / abs(b) for a, b in zip(self.losses, self.expected_losses, strict=True)),
            default=0.0,
        )

    @property
    def ok(self) -> bool:
        """Bitwise, or (where bitwise is not expected) losses within :data:`RESUME_LOSS_RTOL`."""
        if self.bitwise:
            return True
        return not self.bitwise_expected and self.loss_rel_diff <= RESUME_LOSS_RTOL

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``resume.json``)."""
        return asdict(self)
