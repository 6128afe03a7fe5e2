"""The dtype ``from_pretrained(dtype)`` gives the tensors it never loads.

Non-persistent buffers are not in a checkpoint: they keep the dtype the model's ``__init__``
made them in, and ``from_pretrained`` runs ``__init__`` with the load dtype as torch's default
dtype. A buffer made with ``.float()`` (rotary ``inv_freq``) is fp32 either way; one made with
``torch.tensor(x)`` or ``torch.ones(n)`` (Gemma's ``embed_scale``) is in the load dtype. Which
is which is read from the model's own class, built again on the meta device under that default
dtype: no memory, no weights, the installed library's code.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator

import torch
import torch.nn as nn

from fsdp_precision._hf.declarations import LibraryModel, library_models

__all__ = ["built_buffer_dtypes"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _rebuilt(found: LibraryModel, dtype: torch.dtype) -> nn.Module | None:
    """``found``'s class built from its config on meta under default ``dtype``; ``None`` (and
    a debug line) where the class cannot be built that way."""
    config = getattr(found.module, "config", None)
    if config is None:
        return None
    try:
        with torch.device("meta"), _default_dtype(dtype):
            if found.library == "diffusers":
                return type(found.module).from_config(config)  # type: ignore[attr-defined,no-any-return]
            return type(found.module)(copy.deepcopy(config))
    except Exception as exc:  # noqa: BLE001  # any failure means: not knowable this way
        logger.debug(
            "cannot rebuild %s on meta to read its buffers' load dtypes (%s: %s); its "
            "non-persistent buffers keep their dtype",
            type(found.module).__name__,
            type(exc).__name__,
            exc,
        )
        return None


def built_buffer_dtypes(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """FQN -> dtype of every floating non-persistent buffer of the transformers or Diffusers
    models in ``model``'s tree, as their class makes it with ``dtype`` the default dtype (what
    ``from_pretrained(dtype=dtype)`` leaves it in). Buffers of a model whose class cannot be
    rebuilt from its config are left out."""
    out: dict[str, torch.dtype] = {}
    for found in library_models(model):
        twin = _rebuilt(found, dtype)
        if twin is None:
            continue
        prefix = f"{found.prefix}." if found.prefix else ""
        for module_name, module in twin.named_modules(remove_duplicate=False):
            inner = f"{module_name}." if module_name else ""
            for name in module._non_persistent_buffers_set:
                buffer = module._buffers.get(name)
                if buffer is not None and buffer.is_floating_point():
                    out[prefix + inner + name] = buffer.dtype
    return out
