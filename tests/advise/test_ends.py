"""The model's end figures (:mod:`fsdp_precision._advise.ends`): summed a bounded number of rows
at a time, equal to the whole output computed at once, whatever the chunk."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fsdp_precision._advise import ends
from fsdp_precision._advise.ends import EndSums

pytestmark = pytest.mark.fast

VOCAB = 32


def _outputs(seed: int) -> tuple[SimpleNamespace, SimpleNamespace]:
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(3, 7, VOCAB, generator=g)
    low = (ref + 0.3 * torch.randn(ref.shape, generator=g)).bfloat16()
    loss = torch.tensor(2.0)
    return SimpleNamespace(logits=ref, loss=loss), SimpleNamespace(logits=low, loss=loss + 0.25)


def _by_hand(pairs: list[tuple[SimpleNamespace, SimpleNamespace]]) -> dict[str, float]:
    kl = flips = rows = diff = norm = 0.0
    for ref, out in pairs:
        p = F.log_softmax(ref.logits.reshape(-1, VOCAB), -1)
        q = F.log_softmax(out.logits.float().reshape(-1, VOCAB), -1)
        kl += float((p.exp() * (p - q)).sum())
        flips += float((p.argmax(-1) != q.argmax(-1)).sum())
        rows += p.shape[0]
        diff += float((out.logits.float() - ref.logits).pow(2).sum())
        norm += float(ref.logits.pow(2).sum())
    return {"kl": kl / rows, "flips": flips / rows, "error": (diff / norm) ** 0.5}


@pytest.mark.parametrize("rows_per_chunk", [1, 2, 5, 21, 1000])
def test_chunked_sums_are_the_whole_outputs(
    rows_per_chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of 1, 2, 5 (not dividing 21 rows), 21 and more rows than there are: the KL,
    argmax flips, output error and loss change of the whole outputs, and no log-softmax ever
    sees more than one chunk."""
    monkeypatch.setattr(ends, "CHUNK_ELEMENTS", rows_per_chunk * VOCAB)
    seen: list[int] = []
    log_softmax = F.log_softmax

    def counted(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append(x.shape[0])
        return log_softmax(x, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ends.F, "log_softmax", counted)
    pairs = [_outputs(0), _outputs(1)]
    sums = EndSums()
    for ref, out in pairs:
        sums.add(ref, out)
    chunks = list(seen)
    got, want = sums.figures(), _by_hand(pairs)
    assert got.kl == pytest.approx(want["kl"], rel=1e-5)
    assert got.argmax_flips == pytest.approx(want["flips"], abs=0)
    assert got.output_error == pytest.approx(want["error"], rel=1e-5)
    assert got.loss_delta == pytest.approx(0.25)
    assert max(chunks) == min(rows_per_chunk, 21) and sum(chunks) == 2 * 2 * 21


def test_an_output_that_changes_shape_is_named() -> None:
    ref, out = _outputs(0)
    out.logits = out.logits[:, :5]
    with pytest.raises(ValueError, match=r"changed shape between configurations: \(3, 7, 32\)"):
        EndSums().add(ref, out)
