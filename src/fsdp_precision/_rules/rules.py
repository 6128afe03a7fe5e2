"""Precision rules: root-relative globs, module classes, and model-declared keep lists.

Rules state intent ("norms in fp32"); :func:`compile_param_dtype_maps` turns them into one exact
``{fqn: dtype}`` map per planned ``fully_shard`` call. Precedence, stated once:

1. the rules in ``PrecisionRules.rules``, in the order given: the first rule that matches any
   name (alias) of a parameter claims it;
2. then the model's own keep-in-fp32 declarations (Hugging Face transformers or Diffusers), when
   ``PrecisionRules.hf_keep_in_fp32`` is true, matched with the installed library's semantics;
3. every other parameter computes in ``PrecisionRules.param_dtype``.

A user rule that matches nothing is an error, and so is one whose every match earlier user rules
took (fully shadowed); a declaration shadowed by user rules is ordinary precedence.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn as nn

from fsdp_precision._base.dtypes import check_mappable_dtype, dtype_name
from fsdp_precision._policy.casts import BOUNDARIES, Boundary
from fsdp_precision._policy.inputs import check_uncast_inputs

__all__ = [
    "ADVICE_MODES",
    "MEASURED_THRESHOLD",
    "AdviceMode",
    "AdvisedRule",
    "AnyRule",
    "DeclaredRule",
    "Glob",
    "ModuleClass",
    "PrecisionRules",
    "Rule",
    "rule_label",
]


@dataclass(frozen=True)
class Glob:
    """Parameters whose root-relative FQN matches ``pattern`` compute in ``dtype``.

    The pattern is matched against the whole FQN (anchored at both ends) with ``fnmatch``
    semantics; ``*`` crosses dots. ``"scale_shift_table"`` is the root's table only;
    ``"*scale_shift_table"`` is every table in the model, blocks included.

    Attributes:
        pattern (str): Glob over root-relative parameter FQNs. (Default: required)
        dtype (torch.dtype): Compute (all-gather) dtype of the matched parameters.
            (Default: ``torch.float32``)
        boundary (Boundary): How a module kept whole meets the activations around it:
            ``"auto"`` (inputs cast to ``dtype``; outputs cast back for modules of per-channel
            gains, norms and scales), ``"inputs"``, ``"inputs_outputs"`` or ``"none"`` (the
            module casts for itself). (Default: ``"auto"``)
    """

    pattern: str
    dtype: torch.dtype = torch.float32
    boundary: Boundary = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"Glob.pattern must be a non-empty string, got {self.pattern!r}")
        check_mappable_dtype(self.dtype, where=f"Glob({self.pattern!r}).dtype")
        _check_boundary(self.boundary, f"Glob({self.pattern!r})")

    def matches(self, fqn: str, owner: nn.Module) -> bool:
        """Whether the rule claims the parameter named ``fqn`` (owned by ``owner``)."""
        return fnmatch.fnmatchcase(fqn, self.pattern)

    def __str__(self) -> str:
        return f"glob {self.pattern!r}{_boundary_suffix(self.boundary)}"


@dataclass(frozen=True)
class ModuleClass:
    """Parameters owned directly by modules of class ``cls`` compute in ``dtype``.

    Attributes:
        cls (type[nn.Module] | tuple[type[nn.Module], ...]): Module class(es), matched with
            ``isinstance``. (Default: required)
        dtype (torch.dtype): Compute dtype of the matched parameters. (Default: ``torch.float32``)
        params (tuple[str, ...] | None): Restrict to these attribute names (``("weight",)``);
            ``None`` takes every parameter the module owns directly. (Default: ``None``)
        boundary (Boundary): As for :class:`Glob`. (Default: ``"auto"``)
    """

    cls: type[nn.Module] | tuple[type[nn.Module], ...]
    dtype: torch.dtype = torch.float32
    params: tuple[str, ...] | None = None
    boundary: Boundary = "auto"

    def __post_init__(self) -> None:
        classes = self.cls if isinstance(self.cls, tuple) else (self.cls,)
        if not classes or not all(
            isinstance(c, type) and issubclass(c, nn.Module) for c in classes
        ):
            raise ValueError(
                "ModuleClass.cls must be an nn.Module subclass or a tuple of them, "
                f"got {self.cls!r}"
            )
        check_mappable_dtype(self.dtype, where=f"ModuleClass({self._names()}).dtype")
        _check_boundary(self.boundary, f"ModuleClass({self._names()})")

    def _names(self) -> str:
        classes = self.cls if isinstance(self.cls, tuple) else (self.cls,)
        return ", ".join(c.__name__ for c in classes)

    def matches(self, fqn: str, owner: nn.Module) -> bool:
        """Whether the rule claims the parameter named ``fqn`` (owned by ``owner``)."""
        if not isinstance(owner, self.cls):
            return False
        return self.params is None or fqn.rsplit(".", 1)[-1] in self.params

    def __str__(self) -> str:
        suffix = f" {list(self.params)}" if self.params is not None else ""
        return f"class {self._names()}{suffix}{_boundary_suffix(self.boundary)}"


Rule = Glob | ModuleClass


@dataclass(frozen=True)
class DeclaredRule:
    """A model's own keep-in-fp32 declaration, resolved to exact FQNs by its library, or the
    storage of packed quantized parameters.

    ``boundary`` is ``"none"``: the model casts there for itself, as it does when its library
    loads it with the declaration honoured; a user rule claiming parameters of the same module
    sets the module's boundary.
    """

    source: str  # e.g. "transformers _keep_in_fp32_modules_strict"
    pattern: str
    fqns: frozenset[str]
    dtype: torch.dtype = torch.float32
    boundary: Boundary = "none"

    def matches(self, fqn: str, owner: nn.Module) -> bool:
        return fqn in self.fqns

    def __str__(self) -> str:
        return f"{self.source} {self.pattern!r}"


#: What the precision advisor does for a plan (:mod:`fsdp_precision._advise.advice`):
#: ``"report"`` lists it under the plan (``explain()``, ``to_dict()``, ``fsdp-precision plan``);
#: ``"apply"`` also keeps what it found (routers, log-space parameters, gains) in fp32, as
#: rules after the user's rules and the model's declarations; ``"measured"`` keeps, likewise, the
#: candidates (norms included) whose effect measured on the example inputs
#: (:mod:`fsdp_precision._advise.measure`) is at least ``PrecisionRules.advice_threshold``;
#: ``"off"`` traces nothing.
AdviceMode = Literal["report", "apply", "measured", "off"]
ADVICE_MODES: tuple[AdviceMode, ...] = ("report", "apply", "measured", "off")

#: The default ``advice_threshold``: a candidate is kept when keeping it alone removes at least
#: this share of the uniform policy's logits KL (else of its output error).
MEASURED_THRESHOLD = 0.05


@dataclass(frozen=True)
class AdvisedRule:
    """A rule the precision advisor made (``PrecisionRules(advice="apply")``): it claims like a
    :class:`Glob`, after the user's rules and the model's declarations, with a boundary cast.

    Attributes:
        kind: What the advisor found: ``"router"``, ``"log_space"`` or ``"gain"``.
        pattern: Glob over root-relative parameter FQNs.
        dtype: The kept dtype. (Default: ``torch.float32``)
        boundary: As for :class:`Glob`. (Default: ``"auto"``)
    """

    kind: str
    pattern: str
    dtype: torch.dtype = torch.float32
    boundary: Boundary = "auto"

    def matches(self, fqn: str, owner: nn.Module) -> bool:
        """Whether the rule claims the parameter named ``fqn``."""
        return fnmatch.fnmatchcase(fqn, self.pattern)

    def __str__(self) -> str:
        return f"advice ({self.kind}) {self.pattern!r}"


#: Anything that can claim a parameter: a user rule, a model declaration or the advice.
AnyRule = Glob | ModuleClass | DeclaredRule | AdvisedRule


def _boundary_suffix(boundary: Boundary) -> str:
    return "" if boundary == "auto" else f" (boundary {boundary!r})"


def _check_boundary(boundary: object, where: str) -> None:
    if boundary not in BOUNDARIES:
        raise ValueError(
            f"{where}.boundary is {boundary!r}; use one of {', '.join(map(repr, BOUNDARIES))}"
        )


def rule_label(rule: AnyRule | None) -> str:
    """Display label of a rule (``"default"`` for ``None``: no rule claimed the parameter)."""
    return "default" if rule is None else str(rule)


@dataclass(frozen=True, kw_only=True)
class PrecisionRules:
    """What should compute in which dtype, before any unit exists.

    Attributes:
        param_dtype (Optional[torch.dtype]): Compute dtype of parameters no rule claims; ``None``
            keeps storage dtypes. (Default: ``torch.bfloat16``)
        reduce_dtype (Optional[torch.dtype]): Gradient reduce dtype of every unit.
            (Default: ``torch.float32``)
        output_dtype (Optional[torch.dtype]): Passed to every unit's policy. (Default: ``None``)
        cast_forward_inputs (bool): Passed to every unit's policy. (Default: ``True``)
        uncast_inputs (tuple[str, ...]): Forward argument names the units' input cast leaves in
            the dtype they arrive in (a timestep embedding or a rotary table computed in fp32,
            which the unit upcasts itself: Wan's ``temb``, ``rotary_emb``). Each unit whose
            forward takes one of them gets it in its policy's ``uncast_inputs``; the plan's
            trace lists the inputs a unit's cast rounds. (Default: ``()``)
        rules (tuple[Glob | ModuleClass, ...]): Ordered; the first matching rule claims a
            parameter. (Default: ``()``)
        hf_keep_in_fp32 (bool): Honour the model's ``_keep_in_fp32_modules`` (and ``_strict``)
            declarations, with the installed library's semantics, after ``rules``.
            (Default: ``True``)
        advice (Literal["report", "apply", "off"]): The precision advisor, from a traced
            forward of the model (its ``dummy_inputs``): ``"report"`` lists the parameters that
            need more than the compute dtype under the plan (``explain()``, ``to_dict()``);
            ``"apply"`` also keeps routers, log-space parameters and gains in fp32, after the
            rules and the declarations; ``"measured"`` keeps the candidates (norms included)
            whose measured effect is at least ``advice_threshold`` (it needs the model's weights
            in their stored precision and ``param_dtype``); ``"off"`` traces nothing.
            (Default: ``"report"``)
        advice_threshold (float): For ``advice="measured"``: the share of the uniform
            policy's logits KL (else output error) a candidate kept alone must remove, in
            ``[0, 1]``. (Default: ``0.05``)
        strategy (Literal["patch", "split"] | None): Deprecated: where kept parameters go is a
            unit layout, chosen by the planning verb (``compile_param_dtype_maps(...,
            layout="separate_units")``, ``DistributedConfig(fsdp_layout=...)``); ``"split"``
            still plans separate units for one release, with a ``DeprecationWarning``.
            (Default: ``None``)
    """

    param_dtype: torch.dtype | None = torch.bfloat16
    reduce_dtype: torch.dtype | None = torch.float32
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    uncast_inputs: tuple[str, ...] = ()
    rules: tuple[Rule, ...] = field(default_factory=tuple)
    hf_keep_in_fp32: bool = True
    advice: AdviceMode = "report"
    advice_threshold: float = MEASURED_THRESHOLD
    strategy: Literal["patch", "split"] | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None:
                check_mappable_dtype(value, where=f"PrecisionRules.{name}")
        if not isinstance(self.rules, Sequence) or isinstance(self.rules, str):
            raise ValueError(
                f"PrecisionRules.rules must be a sequence of Glob/ModuleClass, got {self.rules!r}"
            )
        for i, rule in enumerate(self.rules):
            if not isinstance(rule, (Glob, ModuleClass)):
                raise ValueError(
                    f"PrecisionRules.rules[{i}] must be a Glob or ModuleClass, got {rule!r}; "
                    "write Glob('*.norm.weight', torch.float32) or ModuleClass(nn.LayerNorm)"
                )
        object.__setattr__(self, "rules", tuple(self.rules))
        try:
            names = check_uncast_inputs(self.uncast_inputs)
        except ValueError as exc:
            raise ValueError(f"PrecisionRules.{exc}") from None
        in_order = dict.fromkeys(n for n in (self.uncast_inputs or ()) if n in names)
        object.__setattr__(self, "uncast_inputs", tuple(in_order))
        if not isinstance(self.hf_keep_in_fp32, bool):
            raise ValueError(
                "PrecisionRules.hf_keep_in_fp32 must be True or False, got "
                f"{self.hf_keep_in_fp32!r}"
            )
        if self.advice not in ADVICE_MODES:
            raise ValueError(
                f"PrecisionRules.advice is {self.advice!r}; use one of "
                f"{', '.join(map(repr, ADVICE_MODES))}: 'report' lists the advice under the plan, "
                "'apply' also keeps routers, log-space parameters and gains in fp32, 'measured' "
                "keeps what measures above advice_threshold, 'off' traces nothing"
            )
        threshold = self.advice_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise ValueError(
                f"PrecisionRules.advice_threshold must be a number in [0, 1], got {threshold!r}"
            )
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(
                f"PrecisionRules.advice_threshold is {threshold}; use a share in [0, 1] (0.05: "
                "keep what removes at least 5% of the uniform policy's logits KL)"
            )
        if self.advice == "measured" and self.param_dtype is None:
            raise ValueError(
                "PrecisionRules(advice='measured') measures param_dtype against the stored "
                "precision, and param_dtype is None; set param_dtype (torch.bfloat16)"
            )
        if self.strategy is not None:
            if self.strategy not in ("patch", "split"):
                raise ValueError(
                    f"PrecisionRules.strategy must be 'patch' or 'split', got {self.strategy!r}"
                )
            layout = "separate_units" if self.strategy == "split" else "in_unit"
            warnings.warn(
                f"PrecisionRules(strategy={self.strategy!r}) is deprecated: the layout is the "
                f"planning verb's choice; pass compile_param_dtype_maps(..., layout={layout!r}) "
                f"or DistributedConfig(fsdp_layout={layout!r})",
                DeprecationWarning,
                stacklevel=3,
            )

    def describe(self) -> str:
        """One line: the defaults and the rules in precedence order."""
        rules = "; ".join(f"{r} -> {dtype_name(r.dtype)}" for r in self.rules) or "none"
        default = dtype_name(self.param_dtype) if self.param_dtype else "storage dtype"
        # reduce_dtype=None: torch's rule, which 2.15 changed (ReleaseTraits.default_reduce_dtype)
        reduce = dtype_name(self.reduce_dtype) if self.reduce_dtype else "torch's default"
        hf = ", then model keep-in-fp32 declarations" if self.hf_keep_in_fp32 else ""
        advice = {
            "apply": ", then the advice",
            "measured": f", then the measured advice (effect >= {self.advice_threshold:.0%})",
        }.get(self.advice, "")
        uncast = (
            f"; inputs left uncast: {', '.join(self.uncast_inputs)}" if self.uncast_inputs else ""
        )
        return f"default {default}, reduce {reduce}; rules: {rules}{hf}{advice}{uncast}"
