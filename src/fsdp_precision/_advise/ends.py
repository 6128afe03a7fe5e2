"""At the model's end: one configuration's output against the stored-precision reference's,
summed over batches (:mod:`._advise.measure`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fsdp_precision._advise.sites import floating

__all__ = ["EndFigures", "EndSums"]


@dataclass(frozen=True)
class EndFigures:
    """The model's output under one configuration against the stored-precision reference.

    Attributes:
        kl: Mean per-token KL(reference || this) of the logits (``None``: the output has none).
        argmax_flips: Share of tokens whose argmax changes (``None`` likewise).
        output_error: Relative error (L2) of the output.
        loss_delta: Loss change, where the output has a ``loss`` (else ``None``).
    """

    kl: float | None
    argmax_flips: float | None
    output_error: float
    loss_delta: float | None

    @property
    def error(self) -> float:
        """The figure effects are shares of: the KL where there are logits, else the error."""
        return self.kl if self.kl is not None else self.output_error


class EndSums:
    """One configuration's output against the reference's, summed over batches."""

    def __init__(self) -> None:
        self.kl = self.flips = self.rows = 0.0
        self.diff = self.ref = 0.0
        self.logits = True
        self.losses: list[float] = []

    def add(self, reference: Any, output: Any) -> None:
        ref_main, ref_logits, ref_loss = _end(reference)
        main, logits, loss = _end(output)
        for ref, out in _chunks(ref_main, main):
            self.diff += float((out.float() - ref.float()).pow(2).sum())
            self.ref += float(ref.float().pow(2).sum())
        if ref_logits is None or logits is None:
            self.logits = False
        else:
            for ref, out in _chunks(ref_logits, logits):
                p = F.log_softmax(ref.float(), dim=-1)
                q = F.log_softmax(out.float(), dim=-1)
                self.kl += float(F.kl_div(q, p, log_target=True, reduction="sum"))
                self.flips += float((p.argmax(-1) != q.argmax(-1)).sum())
                self.rows += p.shape[0]
        if ref_loss is not None and loss is not None:
            self.losses.append(float(loss) - float(ref_loss))

    def figures(self) -> EndFigures:
        rows = max(self.rows, 1.0)
        return EndFigures(
            kl=self.kl / rows if self.logits else None,
            argmax_flips=self.flips / rows if self.logits else None,
            output_error=(self.diff / self.ref) ** 0.5 if self.ref else 0.0,
            loss_delta=sum(self.losses) / len(self.losses) if self.losses else None,
        )


#: Elements per compared chunk: a full-vocabulary output's fp32 copies (log-softmax, KL terms)
#: take 64 MiB each at a time, not the whole output's size.
CHUNK_ELEMENTS = 1 << 24


def _chunks(ref: torch.Tensor, out: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``ref`` and ``out`` as rows of their last dimension, a bounded number at a time."""
    if ref.shape != out.shape:
        raise ValueError(
            f"the model's output changed shape between configurations: {tuple(ref.shape)} "
            f"against {tuple(out.shape)}"
        )
    width = ref.shape[-1] if ref.dim() else 1
    ref, out = ref.reshape(-1, width), out.reshape(-1, width)
    step = max(1, CHUNK_ELEMENTS // max(width, 1))
    for start in range(0, ref.shape[0], step):
        yield ref[start : start + step], out[start : start + step]


def _end(output: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The output's main tensor, its logits (if it has them) and its loss (likewise)."""
    logits = getattr(output, "logits", None)
    loss = getattr(output, "loss", None)
    main = logits if isinstance(logits, torch.Tensor) else getattr(output, "sample", None)
    if not isinstance(main, torch.Tensor):
        found = floating(output)
        if not found:
            raise ValueError(
                f"the model returned no floating tensor ({type(output).__name__}): nothing to "
                "compare at its end"
            )
        main = found[0]
    return main, logits if isinstance(logits, torch.Tensor) else None, loss
