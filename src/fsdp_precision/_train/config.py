"""``DistributedConfig``: the training setup, validated before anything is built."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, get_args

import torch

from fsdp_precision._plan.compile import LAYOUTS, UNKNOWN_TORCH, Layout, UnknownTorch
from fsdp_precision._rules.rules import Glob, ModuleClass, PrecisionRules, Rule

__all__ = ["PRESETS", "DistributedConfig", "Preset"]

PRESETS: Mapping[str, tuple[torch.dtype | None, torch.dtype | None]] = MappingProxyType(
    {
        "fp32": (None, None),
        "bf16": (torch.bfloat16, torch.float32),
        "fp16": (torch.float16, torch.float32),  # needs loss scaling: see make_grad_scaler
    }
)
"""Named mixed-precision presets of ``DistributedConfig.fsdp_mixed_precision``, read-only:
name -> ``(param_dtype, reduce_dtype)``; ``None`` keeps the storage dtype."""

Preset = Literal["fp32", "bf16", "fp16"]
Strategy = Literal["none", "ddp", "fsdp", "hsdp"]
CompileBackend = Literal["off", "inductor", "aot_eager"]

#: Fields kept for one release: (name, what to write instead).
_DEPRECATED = {
    "precision_rules": "fsdp_mixed_precision=PrecisionRules(rules=(...))",
    "hf_keep_in_fp32": "fsdp_mixed_precision=PrecisionRules(hf_keep_in_fp32=...)",
    "precision_strategy": "fsdp_layout='in_unit' or 'separate_units'",
}


@dataclass(kw_only=True, slots=True)
class DistributedConfig:
    """How to parallelise and which precision to train in.

    Attributes:
        parallel_strategy: ``"none"`` (one process, no wrapper), ``"ddp"``, ``"fsdp"`` (1-D mesh
            over every rank) or ``"hsdp"`` (2-D mesh: replicate x shard). (Default: ``"fsdp"``)
        fsdp_mixed_precision: The precision: a preset name, expanded by :meth:`precision` to
            :class:`PrecisionRules` (``"bf16"``: bf16 compute, fp32 reduce; ``"fp16"``: fp16
            compute, fp32 reduce, loss scaling; ``"fp32"``), or the rules themselves, for
            rules of your own (``PrecisionRules(rules=(Glob("*.mlp.gate.weight"),))``: bf16
            with the routers in fp32). (Default: ``"bf16"``)
        fsdp_layout: Where parameters kept in another dtype go: ``"in_unit"`` (inside their
            units, one all-gather and one reduce-scatter per unit) or ``"separate_units"``
            (each module holding them its own unit; public API only, more collectives).
            (Default: ``"in_unit"``)
        fsdp_auto_wrap_min_params: A module becomes an FSDP unit, bottom-up, when the parameters
            not already in a child unit reach this count; the root is always a unit; declared
            ``_no_split_modules`` blocks are never split. Used by ``"size"``.
            (Default: ``10_000_000``)
        fsdp_auto_wrap_policy: ``"size"`` (``fsdp_auto_wrap_min_params``) or
            ``"transformer_block"`` (every block class a unit, as accelerate's
            ``TRANSFORMER_BASED_WRAP``). Either way a module becomes a unit only where torch can
            run it (see ``docs/guides/distributed.md``). (Default: ``"size"``)
        fsdp_transformer_block_classes: Class names of the blocks for ``"transformer_block"``.
            (Default: ``()``, the model's ``_no_split_modules``)
        fsdp_cpu_offload: Keep sharded parameters, gradients and optimizer state on the CPU
            (FSDP2's ``CPUOffloadPolicy``). (Default: ``False``)
        fsdp_reshard_after_forward: Free gathered parameters after forward (re-gathered in
            backward), except the root's, which backward needs first (torch's default).
            (Default: ``True``)
        hsdp_replicate_size: Replicas for ``"hsdp"``; must divide the world size. (Default:
            ``None``, required for ``"hsdp"``)
        fsdp_unknown_torch: On a torch the patch cannot run on (a release it does not know, or
            changed upstream sources): ``"refuse"`` (the wrap raises, naming what differs) or
            ``"public_api"`` (plan separate units instead: the same numerics, more collectives,
            with a warning). (Default: ``"refuse"``)
        compile_units: ``torch.compile`` each unit but the root after wrapping it (its
            ``module.compile(backend=...)``, as torchtitan compiles its blocks): ``"inductor"``,
            ``"aot_eager"`` or ``"off"``. Kept parameters inside a unit add no graph break; a
            separate unit inside a compiled one adds one per call (FSDP's hooks are not
            traced). (Default: ``"off"``)
        compile_fullgraph: Compile each unit as one graph (``fullgraph=True``): a graph break
            is an error. (Default: ``False``)
        precision_rules: Deprecated: ``fsdp_mixed_precision=PrecisionRules(rules=...)``.
            (Default: ``None``)
        hf_keep_in_fp32: Deprecated: ``PrecisionRules(hf_keep_in_fp32=...)``.
            (Default: ``None``)
        precision_strategy: Deprecated: ``fsdp_layout``. (Default: ``None``)
    """

    parallel_strategy: Strategy = "fsdp"
    fsdp_mixed_precision: Preset | PrecisionRules = "bf16"
    fsdp_layout: Layout = "in_unit"
    fsdp_auto_wrap_min_params: int = 10_000_000
    fsdp_auto_wrap_policy: Literal["size", "transformer_block"] = "size"
    fsdp_transformer_block_classes: tuple[str, ...] = field(default_factory=tuple)
    fsdp_cpu_offload: bool = False
    fsdp_reshard_after_forward: bool = True
    hsdp_replicate_size: int | None = None
    fsdp_unknown_torch: UnknownTorch = "refuse"
    compile_units: CompileBackend = "off"
    compile_fullgraph: bool = False
    precision_rules: tuple[Rule, ...] | None = None
    hf_keep_in_fp32: bool | None = None
    precision_strategy: Literal["patch", "split"] | None = None

    def __post_init__(self) -> None:
        if self.parallel_strategy not in get_args(Strategy):
            raise _bad(
                "parallel_strategy", self.parallel_strategy, "use 'none', 'ddp', 'fsdp' or 'hsdp'"
            )
        precision = self.fsdp_mixed_precision
        if not isinstance(precision, PrecisionRules) and precision not in PRESETS:
            raise _bad(
                "fsdp_mixed_precision",
                precision,
                "use 'fp32', 'bf16', 'fp16' or a PrecisionRules(...)",
            )
        if self.fsdp_layout not in LAYOUTS:
            raise _bad("fsdp_layout", self.fsdp_layout, "use 'in_unit' or 'separate_units'")
        size = self.fsdp_auto_wrap_min_params
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise _bad(
                "fsdp_auto_wrap_min_params",
                size,
                "use a non-negative integer (0 wraps every module)",
            )
        for name in ("fsdp_cpu_offload", "fsdp_reshard_after_forward", "compile_fullgraph"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "use True or False")
        self._check_compile()
        if self.fsdp_unknown_torch not in UNKNOWN_TORCH:
            raise _bad(
                "fsdp_unknown_torch", self.fsdp_unknown_torch, "use 'refuse' or 'public_api'"
            )
        self._check_hsdp()
        self._check_blocks()
        self._take_deprecated()

    def _check_compile(self) -> None:
        if self.compile_units not in get_args(CompileBackend):
            raise _bad("compile_units", self.compile_units, "use 'off', 'inductor' or 'aot_eager'")
        if self.compile_units != "off" and self.parallel_strategy not in ("fsdp", "hsdp"):
            raise _bad(
                "compile_units",
                self.compile_units,
                f"it compiles FSDP units, and parallel_strategy={self.parallel_strategy!r} "
                "makes none; compile the model yourself (model.compile())",
            )
        if self.compile_fullgraph and self.compile_units == "off":
            raise _bad(
                "compile_fullgraph", True, "it applies with compile_units='inductor' or 'aot_eager'"
            )

    def _check_hsdp(self) -> None:
        replicas = self.hsdp_replicate_size
        if self.parallel_strategy == "hsdp":
            if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
                raise _bad(
                    "hsdp_replicate_size",
                    replicas,
                    "'hsdp' needs a positive replica count "
                    "that divides the world size, e.g. hsdp_replicate_size=2",
                )
        elif replicas is not None:
            raise _bad(
                "hsdp_replicate_size",
                replicas,
                f"it applies to parallel_strategy='hsdp' only (got {self.parallel_strategy!r})",
            )

    def _check_blocks(self) -> None:
        if self.fsdp_auto_wrap_policy not in ("size", "transformer_block"):
            raise _bad(
                "fsdp_auto_wrap_policy",
                self.fsdp_auto_wrap_policy,
                "use 'size' or 'transformer_block'",
            )
        blocks = self.fsdp_transformer_block_classes
        names_ok = isinstance(blocks, (tuple, list)) and all(
            isinstance(b, str) and b for b in blocks
        )
        if not names_ok:
            raise _bad(
                "fsdp_transformer_block_classes",
                blocks,
                "use a tuple of class names, e.g. ('LlamaDecoderLayer',)",
            )
        self.fsdp_transformer_block_classes = tuple(blocks)
        if blocks and self.fsdp_auto_wrap_policy != "transformer_block":
            raise _bad(
                "fsdp_transformer_block_classes",
                blocks,
                "it applies to fsdp_auto_wrap_policy='transformer_block' only",
            )

    def _take_deprecated(self) -> None:
        """The deprecated fields still work for one release: folded into the precision rules
        (and the layout), with a ``DeprecationWarning`` naming the new spelling."""
        given = [name for name in _DEPRECATED if getattr(self, name) is not None]
        if not given:
            return
        warnings.warn(
            f"DistributedConfig({'=..., '.join(given)}=...) is deprecated: use "
            + "; ".join(_DEPRECATED[name] for name in given),
            DeprecationWarning,
            stacklevel=4,
        )
        if isinstance(self.fsdp_mixed_precision, PrecisionRules):
            raise _bad(
                given[0],
                getattr(self, given[0]),
                "it cannot be combined with fsdp_mixed_precision=PrecisionRules(...): put the "
                "rules there",
            )
        rules = tuple(self.precision_rules or ())
        for i, rule in enumerate(rules):
            if not isinstance(rule, (Glob, ModuleClass)):
                raise _bad(f"precision_rules[{i}]", rule, "use Glob(...) or ModuleClass(...)")
        if self.hf_keep_in_fp32 is not None and not isinstance(self.hf_keep_in_fp32, bool):
            raise _bad("hf_keep_in_fp32", self.hf_keep_in_fp32, "use True or False")
        if self.precision_strategy is not None:
            if self.precision_strategy not in ("patch", "split"):
                raise _bad("precision_strategy", self.precision_strategy, "use fsdp_layout")
            self.fsdp_layout = "separate_units" if self.precision_strategy == "split" else "in_unit"
        param_dtype, reduce_dtype = PRESETS[self.fsdp_mixed_precision]
        self.fsdp_mixed_precision = PrecisionRules(
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            rules=rules,
            hf_keep_in_fp32=True if self.hf_keep_in_fp32 is None else self.hf_keep_in_fp32,
        )

    def precision(self) -> PrecisionRules:
        """The precision as explicit, printable :class:`PrecisionRules` (a preset expanded)."""
        if isinstance(self.fsdp_mixed_precision, PrecisionRules):
            return self.fsdp_mixed_precision
        param_dtype, reduce_dtype = PRESETS[self.fsdp_mixed_precision]
        return PrecisionRules(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def _bad(name: str, value: object, fix: str) -> ValueError:
    return ValueError(f"DistributedConfig.{name} is {value!r}; {fix}")
