"""What ``advise --measure`` and ``plan --measure`` measure on: the calibration batches
(``--data``: a text file, a token-id tensor file, or random inputs like ``verify``'s). The model
with its weights, in float32, is :meth:`~fsdp_precision._cli.spec.ModelSpec.with_weights`.

Nothing a file holds runs: weights load from safetensors only, a tensor file through
``torch.load(weights_only=True)`` or safetensors, a tokenizer from the directory's own files
(``trust_remote_code=False``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fsdp_precision._cli.spec import ModelSpec

__all__ = ["Calibration", "calibration_batches"]


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """How many batches of what size ``--data`` is cut into."""

    batches: int = 4
    batch_size: int = 4
    seq_len: int = 128

    def __post_init__(self) -> None:
        for name in ("batches", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")


def calibration_batches(
    spec: ModelSpec, model: nn.Module, data: str | None, sizes: Calibration
) -> tuple[list[dict[str, Any]], str]:
    """The batches and what they are: ``data`` tokenized (a ``.txt`` with the directory's
    tokenizer) or read (``.safetensors``/``.pt`` token ids, ``[rows, tokens]``), else random
    inputs as ``verify`` makes them."""
    if data is None:
        made = [
            spec.inputs(model, torch.Generator().manual_seed(seed)) for seed in range(sizes.batches)
        ]
        return made, f"{sizes.batches} batches of random inputs (pass --data for your own)"
    path = Path(data)
    if not path.is_file():
        raise ValueError(f"--data {data!r} is not a file; pass a .txt, .safetensors or .pt")
    if path.suffix == ".txt":
        ids = _tokenized(spec.text, path)
    elif path.suffix in (".safetensors", ".pt"):
        ids = _token_ids(path)
    else:
        raise ValueError(
            f"--data {data!r}: use a .txt (tokenized with the model directory's tokenizer), "
            "a .safetensors or a .pt holding token ids (input_ids, [rows, tokens])"
        )
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and ids.numel() and int(ids.max()) >= int(vocab):
        raise ValueError(
            f"--data {data!r} holds token id {int(ids.max())}, outside the model's vocabulary "
            f"({vocab}): tokenize with the model's own tokenizer"
        )
    rows = ids.reshape(-1)[: (ids.numel() // sizes.seq_len) * sizes.seq_len]
    rows = rows.reshape(-1, sizes.seq_len) if rows.numel() else rows.reshape(0, sizes.seq_len)
    if rows.shape[0] < sizes.batch_size:
        raise ValueError(
            f"--data {data!r} has {ids.numel()} tokens, fewer than one batch "
            f"(--batch-size {sizes.batch_size} x --seq-len {sizes.seq_len}); lower them"
        )
    count = min(sizes.batches, rows.shape[0] // sizes.batch_size)
    batches = []
    for i in range(count):
        chunk = rows[i * sizes.batch_size : (i + 1) * sizes.batch_size].long()
        batches.append({"input_ids": chunk, "labels": chunk})
    shape = f"{sizes.batch_size} x {sizes.seq_len} tokens"
    return batches, f"{count} batches of {shape} from {path.name}"


def _tokenized(spec: str, path: Path) -> torch.Tensor:
    if not Path(spec).is_dir():
        raise ValueError(
            f"--data {str(path)!r} is text, and MODEL {spec!r} is not a directory with a "
            "tokenizer: pass token ids (.safetensors or .pt) instead"
        )
    try:
        from transformers import AutoTokenizer  # lazy: an optional dependency

        tokenizer = AutoTokenizer.from_pretrained(spec, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"--data {str(path)!r} is text, and {spec!r} has no tokenizer transformers can "
            f"load ({type(exc).__name__}); save the tokenizer there, or pass token ids "
            "(.safetensors or .pt)"
        ) from None
    text = path.read_text(encoding="utf-8", errors="replace")
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def _token_ids(path: Path) -> torch.Tensor:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file  # lazy: only this format needs it

        held: Any = load_file(str(path))
    else:
        held = torch.load(path, weights_only=True, map_location="cpu")
    if isinstance(held, dict):
        held = held.get("input_ids", next(iter(held.values())) if len(held) == 1 else None)
    if not isinstance(held, torch.Tensor) or held.is_floating_point() or held.dim() not in (1, 2):
        raise ValueError(
            f"--data {str(path)!r} holds no token ids: store one integer tensor [rows, tokens] "
            "(under 'input_ids')"
        )
    return held
