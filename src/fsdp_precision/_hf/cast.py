"""Keep-aware casts and loads: the storage ``from_pretrained(dtype)`` gives, and state dicts
loaded into it without losing a dtype."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from fsdp_precision._hf.built import built_buffer_dtypes
from fsdp_precision._hf.declarations import Declaration, declarations

__all__ = ["cast_keeping_fp32", "keep_in_fp32_declarations", "kept_fqns", "load_state_dict_aligned"]


def keep_in_fp32_declarations(model: nn.Module, dtype: torch.dtype) -> list[Declaration]:
    """The declarations the model's library applies at ``dtype``, each with its exact matches."""
    return declarations(model, dtype)


def kept_fqns(model: nn.Module, dtype: torch.dtype) -> set[str]:
    """FQNs of every parameter and persistent floating buffer kept in fp32 at ``dtype``, aliases
    included."""
    kept: set[str] = set()
    for d in declarations(model, dtype):
        kept |= d.params | d.buffers
    # Every alias of a kept tensor is kept too.
    tensors: dict[int, list[str]] = {}
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        if t is not None:
            tensors.setdefault(id(t), []).append(name)
    for names in tensors.values():
        if kept.intersection(names):
            kept.update(names)
    return kept


@torch.no_grad()
def cast_keeping_fp32(
    model: nn.Module, dtype: torch.dtype, *, keep: Mapping[str, torch.dtype] | None = None
) -> nn.Module:
    """Give ``model`` the storage ``from_pretrained(dtype=dtype)`` produces, tensor by tensor.

    Floating parameters and persistent buffers are cast to ``dtype``, except the declared ones,
    which stay in fp32 with every alias of a tied kept tensor (unlike ``model.to(dtype)``, which
    undoes the declarations). Non-persistent buffers, which ``from_pretrained`` never loads, get
    the dtype the model's class makes them in when ``dtype`` is the default dtype, as under
    ``from_pretrained`` (rotary ``inv_freq``, made with ``.float()``, stays fp32; Gemma's
    ``embed_scale``, made with ``torch.tensor``, goes to ``dtype``), declared modules'
    included; inside modules whose parameters ``keep`` names, and where the class cannot be
    rebuilt from its config on the meta device, they keep their dtype. Declarations follow the
    installed library, through wrappers (a ``PeftModel``) and tie targets (see
    :mod:`fsdp_precision._hf.declarations`). In place; returns ``model``. Tied tensors stay tied
    (each tensor is cast once, through its module attribute). ``keep`` names more parameters
    (exact FQNs, any alias) with the dtype each stays in; it wins over the declarations.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    kept = kept_fqns(model, dtype)
    extra = _aliases(model, dict(keep or {}))
    built = built_buffer_dtypes(model, dtype)
    # Modules whose parameters ``keep`` (the user's rules) keeps: from_pretrained knows nothing
    # of them, so their buffers stay as they are. A declared module's buffers are what
    # from_pretrained builds them as, like any other (issue 48: a ``torch.ones`` buffer of a
    # module in ``_keep_in_fp32_modules`` is in the load dtype).
    kept_modules = {fqn.rpartition(".")[0] for fqn in extra}
    done: dict[int, Any] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for store in (module._parameters, module._buffers):
            for name, tensor in list(store.items()):
                if tensor is None or not tensor.is_floating_point():
                    continue
                fqn = prefix + name
                if store is module._buffers and name in module._non_persistent_buffers_set:
                    # never loaded by from_pretrained: the dtype its class makes it in
                    aside = _inside(module_name, kept_modules)
                    want = tensor.dtype if aside else built.get(fqn, tensor.dtype)
                else:
                    want = extra.get(fqn) or (torch.float32 if fqn in kept else dtype)
                if id(tensor) in done:
                    store[name] = done[id(tensor)]
                    continue
                if tensor.dtype == want:
                    done[id(tensor)] = tensor
                    continue
                if isinstance(tensor, nn.Parameter):
                    new: Any = nn.Parameter(tensor.to(want), requires_grad=tensor.requires_grad)
                else:
                    new = tensor.to(want)
                done[id(tensor)] = new
                store[name] = new
    return model


def _inside(module: str, modules: set[str]) -> bool:
    """Whether ``module`` is one of ``modules`` or inside one (the root contains nothing here:
    a kept parameter on the root puts only the root's own buffers aside)."""
    return any(module == m or (m and module.startswith(f"{m}.")) for m in modules)


def _aliases(model: nn.Module, keep: dict[str, torch.dtype]) -> dict[str, torch.dtype]:
    """``keep`` with every alias of each named parameter; a name that is none is an error."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    by_name = {n: pid for pid, ns in names.items() for n in ns}
    out: dict[str, torch.dtype] = {}
    for fqn, kept in keep.items():
        if fqn not in by_name:
            raise ValueError(f"keep names {fqn!r}, which is no parameter of the model")
        out.update(dict.fromkeys(names[by_name[fqn]], kept))
    return out


def load_state_dict_aligned(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True
) -> Any:
    """``model.load_state_dict`` with each incoming tensor cast to its destination's dtype.

    The cast happens in a copy (the caller's ``state_dict`` is not modified), ``_metadata`` is
    kept, and every alias of a tied destination gets the same cast. Returns what
    ``load_state_dict`` returns.
    """
    destinations = dict(model.state_dict(keep_vars=True))
    aligned: dict[str, Any] = {}
    for key, value in state_dict.items():
        dest = destinations.get(key)
        if isinstance(value, torch.Tensor) and dest is not None and value.dtype != dest.dtype:
            if value.is_floating_point() and dest.is_floating_point():
                value = value.to(dest.dtype, copy=True)
        aligned[key] = value
    metadata = getattr(state_dict, "_metadata", None)
    out: Any = type(state_dict)(aligned) if isinstance(state_dict, dict) else aligned
    if metadata is not None:
        out._metadata = metadata
    return model.load_state_dict(out, strict=strict)
