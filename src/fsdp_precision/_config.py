"""``DistributedConfig``: the training setup, validated before anything is built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

import torch

from fsdp_precision._rules import Glob, ModuleClass, PrecisionRules, Rule

__all__ = ["PRESETS", "DistributedConfig"]

PRESETS: Mapping[str, tuple[torch.dtype | None, torch.dtype | None]] = MappingProxyType(
    {
        "fp32": (None, None),
        "bf16": (torch.bfloat16, torch.float32),
        "fp16": (torch.float16, torch.float32),  # needs loss scaling: see make_grad_scaler
    }
)
"""Named mixed-precision presets of ``DistributedConfig.fsdp_mixed_precision``, read-only:
name -> ``(param_dtype, reduce_dtype)``; ``None`` keeps the storage dtype."""

Strategy = Literal["none", "ddp", "fsdp", "hsdp"]


@dataclass(kw_only=True, slots=True)
class DistributedConfig:
    """How to parallelise and which precision to train in.

    Attributes:
        parallel_strategy: ``"none"`` (one process, no wrapper), ``"ddp"``, ``"fsdp"`` (1-D mesh
            over every rank) or ``"hsdp"`` (2-D mesh: replicate x shard). (Default: ``"fsdp"``)
        fsdp_mixed_precision: Preset expanded by :meth:`precision_rules`: ``"bf16"`` (bf16
            compute, fp32 reduce), ``"fp16"`` (fp16 compute, fp32 reduce, loss scaling) or
            ``"fp32"``. (Default: ``"bf16"``)
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
        precision_rules: Rules applied before the model's own keep declarations, e.g.
            ``(ModuleClass(nn.LayerNorm), Glob("*.mlp.gate.weight"))``. (Default: ``()``)
        hf_keep_in_fp32: Honour the model's ``_keep_in_fp32_modules`` declarations.
            (Default: ``True``)
        precision_strategy: ``"patch"`` (kept parameters inside their units) or ``"split"`` (own
            units, public API only). (Default: ``"patch"``)
    """

    parallel_strategy: Strategy = "fsdp"
    fsdp_mixed_precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    fsdp_auto_wrap_min_params: int = 10_000_000
    fsdp_auto_wrap_policy: Literal["size", "transformer_block"] = "size"
    fsdp_transformer_block_classes: tuple[str, ...] = field(default_factory=tuple)
    fsdp_cpu_offload: bool = False
    fsdp_reshard_after_forward: bool = True
    hsdp_replicate_size: int | None = None
    precision_rules: tuple[Rule, ...] = field(default_factory=tuple)
    hf_keep_in_fp32: bool = True
    precision_strategy: Literal["patch", "split"] = "patch"

    def __post_init__(self) -> None:
        def bad(name: str, value: object, fix: str) -> ValueError:
            return ValueError(f"DistributedConfig.{name} is {value!r}; {fix}")

        if self.parallel_strategy not in ("none", "ddp", "fsdp", "hsdp"):
            raise bad(
                "parallel_strategy", self.parallel_strategy, "use 'none', 'ddp', 'fsdp' or 'hsdp'"
            )
        if self.fsdp_mixed_precision not in PRESETS:
            raise bad(
                "fsdp_mixed_precision", self.fsdp_mixed_precision, "use 'fp32', 'bf16' or 'fp16'"
            )
        size = self.fsdp_auto_wrap_min_params
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise bad(
                "fsdp_auto_wrap_min_params",
                size,
                "use a non-negative integer (0 wraps every module)",
            )
        for name in ("fsdp_cpu_offload", "fsdp_reshard_after_forward", "hf_keep_in_fp32"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, getattr(self, name), "use True or False")
        replicas = self.hsdp_replicate_size
        if self.parallel_strategy == "hsdp":
            if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
                raise bad(
                    "hsdp_replicate_size",
                    replicas,
                    "'hsdp' needs a positive replica count "
                    "that divides the world size, e.g. hsdp_replicate_size=2",
                )
        elif replicas is not None:
            raise bad(
                "hsdp_replicate_size",
                replicas,
                f"it applies to parallel_strategy='hsdp' only (got {self.parallel_strategy!r})",
            )
        if self.fsdp_auto_wrap_policy not in ("size", "transformer_block"):
            raise bad(
                "fsdp_auto_wrap_policy",
                self.fsdp_auto_wrap_policy,
                "use 'size' or 'transformer_block'",
            )
        blocks = self.fsdp_transformer_block_classes
        names_ok = isinstance(blocks, (tuple, list)) and all(
            isinstance(b, str) and b for b in blocks
        )
        if not names_ok:
            raise bad(
                "fsdp_transformer_block_classes",
                blocks,
                "use a tuple of class names, e.g. ('LlamaDecoderLayer',)",
            )
        self.fsdp_transformer_block_classes = tuple(blocks)
        if blocks and self.fsdp_auto_wrap_policy != "transformer_block":
            raise bad(
                "fsdp_transformer_block_classes",
                blocks,
                "it applies to fsdp_auto_wrap_policy='transformer_block' only",
            )
        rules = tuple(self.precision_rules)
        for i, rule in enumerate(rules):
            if not isinstance(rule, (Glob, ModuleClass)):
                raise bad(f"precision_rules[{i}]", rule, "use Glob(...) or ModuleClass(...)")
        self.precision_rules = rules
        if self.precision_strategy not in ("patch", "split"):
            raise bad("precision_strategy", self.precision_strategy, "use 'patch' or 'split'")

    def precision(self) -> PrecisionRules:
        """The preset expanded to an explicit, printable :class:`PrecisionRules`."""
        param_dtype, reduce_dtype = PRESETS[self.fsdp_mixed_precision]
        return PrecisionRules(
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            rules=self.precision_rules,
            hf_keep_in_fp32=self.hf_keep_in_fp32,
            strategy=self.precision_strategy,
        )
