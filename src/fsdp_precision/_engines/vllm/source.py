"""A model's weights as vLLM's RL API takes them from a trainer: a ``WeightSource`` over
:func:`~fsdp_precision.full_weights`.

vLLM's trainer engines ask a ``WeightSource`` for ``metadata()`` (every tensor's name, dtype and
shape, without transferring) and iterate it once per update, on every trainer rank in lockstep
(materialising is collective). :class:`FSDPWeightSource` answers both from one
:class:`~fsdp_precision.WeightStream`: Hugging Face checkpoint names, each tensor in the dtype
training computed it in (an fp32 router stays fp32 beside a bf16 bulk), metadata equal to
iteration element for element, each ``__iter__`` a fresh pass that gathers the model's current
values one FSDP unit at a time.

Imports vLLM (it subclasses vLLM's ``WeightSource``): reached lazily through
``fsdp_precision.integrations.vllm``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from fsdp_precision._edges.entries import Dtype
from fsdp_precision._edges.layouts import LayoutName
from fsdp_precision._edges.stream import WeightStream, full_weights

__all__ = ["FSDPWeightSource"]


class FSDPWeightSource(WeightSource):  # type: ignore[misc]  # vLLM's base is untyped here
    """vLLM's ``WeightSource`` for a model wrapped with FSDP2 (or not): its full weights, unit
    by unit, in the dtypes the plan keeps.

    Every rank iterates and receives every tensor (``full_weights(model, ranks="all")``: the
    gather is an all-gather, so no rank holds more than one unit's full tensors at a time);
    vLLM's trainer engines send from rank 0 and drop the rest.

    Args:
        model: The trainer's model.
        dtype: As :func:`~fsdp_precision.full_weights`: ``"compute"`` (each tensor as training
            computed it), a torch dtype for the bulk, or ``"stored"``. (Default: "compute")
        cast_kept: Send kept tensors in ``dtype`` too; an engine started from an export with
            the record refuses them by name. (Default: False)
        device: Where yielded tensors live. (Default: None, where the gather ran)
        layout: Which names (``"auto"``: Hugging Face checkpoint names for a transformers
            model). (Default: "auto")
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        dtype: Dtype = "compute",
        cast_kept: bool = False,
        device: torch.device | str | None = None,
        layout: LayoutName = "auto",
    ) -> None:
        self.stream: WeightStream = full_weights(
            model, dtype=dtype, cast_kept=cast_kept, ranks="all", device=device, layout=layout
        )

    def metadata(self) -> list[ParamMeta]:
        """Every tensor iteration yields, in order: name, dtype, full shape (gathers nothing)."""
        return [ParamMeta(m.name, m.dtype, tuple(m.shape)) for m in self.stream.metadata]

    @property
    def kept(self) -> dict[str, torch.dtype]:
        """The tensors sent in a dtype other than the bulk's: name -> dtype."""
        return {name: meta.dtype for name, meta in self.stream.kept.items()}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """A fresh pass: the model's current values, gathered one unit at a time (collective:
        every rank of the model's group iterates, in the same order)."""
        return iter(self.stream)
