"""``fsdp-precision plan MODEL``: the precision plan of a model, before any GPU hour is spent."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fsdp_precision._config import DistributedConfig
from fsdp_precision._plan import PrecisionPlan
from fsdp_precision._rules import Glob
from fsdp_precision._wrap import plan_model_for_training

__all__ = ["PlanOptions", "load_model", "memory_per_rank", "run_plan"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    model: str
    world_size: int = 8
    precision: str = "bf16"
    min_params: int = 10_000_000
    rules: tuple[str, ...] = ()
    as_json: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"--world-size must be >= 1, got {self.world_size}")
        if self.min_params < 0:
            raise ValueError(f"--min-params must be >= 0, got {self.min_params}")


def _parse_rule(text: str) -> Glob:
    pattern, _, dtype = text.partition("=")
    dtype = dtype or "fp32"
    if dtype not in _DTYPES:
        raise ValueError(f"--keep {text!r}: dtype {dtype!r} is not one of fp32, bf16, fp16")
    return Glob(pattern, _DTYPES[dtype])


def _require_transformers(spec: str) -> None:
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            f"MODEL {spec!r} needs Hugging Face transformers, which is not installed; "
            "pip install 'fsdp-precision[hf]'"
        ) from exc


def load_model(spec: str) -> nn.Module:
    """``hf:<model_type>`` | a local Hugging Face directory | ``module:callable``, on meta."""
    if spec.startswith("hf:"):
        _require_transformers(spec)
        from transformers import AutoConfig

        model_type = spec[3:]
        try:
            config = AutoConfig.for_model(model_type)
        except ValueError as exc:
            raise ValueError(
                f"MODEL {spec!r}: transformers knows no model_type {model_type!r} "
                "(examples: hf:llama, hf:deepseek_v3, hf:t5, hf:gpt_oss)"
            ) from exc
        return _from_config(config)
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"MODEL {spec!r} is a directory without config.json")
        _require_transformers(spec)
        from transformers import AutoConfig

        return _from_config(AutoConfig.from_pretrained(str(path)))
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"MODEL {spec!r} is not hf:<model_type>, a directory with config.json, or "
            "module:callable"
        )
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"MODEL {spec!r}: cannot import {attr} from {module_name} ({exc})"
        ) from exc
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"MODEL {spec!r} returned {type(model).__name__}, not an nn.Module")
    return model


def _from_config(config: Any) -> nn.Module:
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    with torch.device("meta"):
        for auto in (AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModel):
            try:
                return auto.from_config(config)  # type: ignore[no-any-return,no-untyped-call]
            except ValueError:
                continue
    raise ValueError(f"no transformers model class for {type(config).__name__}")


def memory_per_rank(plan: PrecisionPlan) -> dict[str, int]:
    """Bytes per rank: sharded params, grads, AdamW state, and the peak of gathered units."""
    ws = plan.world_size
    params = sum(p.padded_numel(ws) * p.storage.itemsize for u in plan.units for p in u.params)
    trainable = sum(
        p.padded_numel(ws) for u in plan.units for p in u.params if p.reduce is not None
    )
    gathered = sorted((sum(u.gather_bytes(ws).values()) for u in plan.units), reverse=True)
    return {
        "params": params // ws,
        "grads": params // ws,
        "adamw_state": 2 * 4 * trainable // ws,
        "gathered_peak": sum(gathered[:2]),  # the unit computing and the one prefetched
    }


def run_plan(opts: PlanOptions) -> int:
    model = load_model(opts.model)
    config = DistributedConfig(
        fsdp_mixed_precision=opts.precision,  # type: ignore[arg-type]
        fsdp_auto_wrap_min_params=opts.min_params,
        precision_rules=tuple(_parse_rule(r) for r in opts.rules),
    )
    plan = plan_model_for_training(model, config, world_size=opts.world_size)
    memory = memory_per_rank(plan)
    if opts.as_json:
        data = plan.to_dict()
        data["memory_per_rank_bytes"] = memory
        print(json.dumps(data, indent=2))
        return 0
    print(plan.explain())
    gib = 1024**3
    total = sum(memory.values())
    print(
        f"\nmemory per rank at world size {opts.world_size} (AdamW, before activations): "
        + ", ".join(f"{k} {v / gib:,.2f} GiB" for k, v in memory.items())
        + f"; total {total / gib:,.2f} GiB"
    )
    return 0
