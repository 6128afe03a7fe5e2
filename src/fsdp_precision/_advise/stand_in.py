"""The advisor's findings on a smaller build of the same architecture, carried to the full-size
model's parameter names.

The advisor traces the full-size model on the meta device, where no value exists: a forward
that reads one (``Tensor.item()``, an MoE dispatch through ``nonzero``, a copy to the CPU) stops
there, and what it did not reach gets no advice. A smaller build of the same config (the same
module classes and names, fewer blocks, narrower) runs on real values; what its forward finds
holds for every block of the same name. :func:`carry` moves its findings over: a full-size
parameter takes the finding of the stand-in parameter whose name is the same with the block
indices globbed (``model.layers.*.mlp.gate.weight``), or, where the stand-in has fewer
numbered siblings (``experts.expert_7``), the name with their numbers globbed too; one with no
counterpart either way is not reached, and the advice says so. Where one globbed name carries
two verdicts in the stand-in (a block kind whose ``gate`` is a router beside one whose ``gate``
is a projection), the stronger is kept: an fp32 weight too many costs memory, a router left in
bf16 costs precision.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch.nn as nn

from fsdp_precision._advise.flow import KINDS, Finding

__all__ = ["block_free", "carry", "check_stand_in"]

_DIGITS = re.compile(r"^\d+$")
_NUMBERED = re.compile(r"\d+$")


def block_free(fqn: str) -> str:
    """``fqn`` with every block index globbed: ``model.layers.3.mlp`` -> ``model.layers.*.mlp``."""
    return ".".join("*" if _DIGITS.match(s) else s for s in fqn.split("."))


def _siblings_free(fqn: str) -> str:
    """``fqn`` with trailing numbers globbed too: ``experts.expert_7`` -> ``experts.expert_*``."""
    return ".".join(_NUMBERED.sub("*", s) for s in fqn.split("."))


def check_stand_in(model: nn.Module, stand_in: nn.Module) -> None:
    """Refuse a stand-in of another class than ``model``'s. (A parameter only the stand-in has,
    a projection that exists at its widths alone, carries nothing.)"""
    if type(stand_in) is not type(model):
        raise ValueError(
            f"stand_in is a {type(stand_in).__name__}, the model a {type(model).__name__}: the "
            "stand-in must be a smaller build of the same class (e.g. its config with fewer "
            "layers, fsdp_precision.testing.tiny_config)"
        )


def carry(
    findings: list[Finding], touched: set[str], stand_in: nn.Module, model: nn.Module
) -> tuple[list[Finding], set[str]]:
    """The ``findings`` and ``touched`` parameters of ``stand_in``'s forward, under ``model``'s
    names."""
    built = {block_free(n) for n, _ in stand_in.named_parameters()}
    strongest: dict[str, Finding] = {}
    for finding in findings:
        for key in (block_free(finding.param), _siblings_free(finding.param)):
            known = strongest.get(key)
            if known is None or KINDS.index(finding.kind) < KINDS.index(known.kind):
                strongest[key] = finding
    read = {block_free(n) for n in touched} | {_siblings_free(n) for n in touched}
    carried: list[Finding] = []
    reached: set[str] = set()
    for name, _ in model.named_parameters():
        key = block_free(name)
        if key not in built:  # fewer numbered siblings in the stand-in
            key = _siblings_free(name)
        if key in read:
            reached.add(name)
        found = strongest.get(key)
        if found is not None:
            carried.append(replace(found, param=name))
    return carried, reached
