"""The advisor's calibration: what does ``fsdp_precision.advise`` find, against ground truth?

Each architecture is built from its config class at a tiny size in fp32 and traced once (its
``dummy_inputs``, or inputs given here). The advisor never reads the model's keep declarations
(nor names: the trace decides), so the declarations are the ground truth it is measured on:

- **declared**: the parameters transformers or Diffusers keeps in fp32 at fp16 or bf16
  (``_keep_in_fp32_modules(_strict)``; buffers are not parameters and are left out);
- **routers**: every MoE router weight: a ``gate``/``router`` matrix with one row per expert;
- **found**: declared parameters and routers the advisor flags (any kind);
- **missed**: declared parameters or routers it does not flag, each with why (:data:`WHY`);
- **extra**: parameters it flags as a router, log-space parameter or gain that are neither
  declared nor routers (norms, the weaker class, are counted apart);
- **dense flags**: projection or MLP weights (2-D and larger) flagged in a dense decoder.

    python scripts/screen_advice.py                  # every architecture, Markdown
    python scripts/screen_advice.py qwen3_moe t5     # some
    python scripts/screen_advice.py --json

Exit status 1 when a declared parameter or a router is missed without a stated reason, or a
dense decoder's projection or MLP weight is flagged. ``tests/hf/test_advice_screen.py`` runs it;
docs/advice.md holds the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn

#: MoE architectures, built as the MoE screen builds them (scripts/screen_hf_keep.py).
MOE = (
    "deepseek_v3 qwen3_moe qwen2_moe mixtral olmoe gpt_oss ernie4_5_moe glm4_moe deepseek_v32"
).split()
#: Other transformers model types, shrunk by ``fsdp_precision.testing.tiny_config``.
TINY = ("jamba", "nemotron_h", "rwkv", "t5", "mamba2")
#: Dense decoders: the controls.
DENSE = ("llama", "qwen3")
#: Built here, with their inputs.
CUSTOM = ("clip", "wan")
ARCHITECTURES = (*MOE, *TINY, *CUSTOM, *DENSE)

#: Declared parameters the trace cannot see a reason for: (architecture, glob) -> why.
WHY: dict[tuple[str, str], str] = {
    ("t5", "*.wo.weight"): "fp16 overflow: T5 keeps wo for the magnitude of its output, which "
    "a trace of ops does not see; wo is an ordinary projection",
}


@dataclass
class Row:
    """One architecture's calibration."""

    name: str
    traced: str = ""
    declared: list[str] = field(default_factory=list)
    routers: list[str] = field(default_factory=list)
    found: list[str] = field(default_factory=list)
    missed: dict[str, str] = field(default_factory=dict)  # FQN -> why ("" when unexplained)
    extra: list[str] = field(default_factory=list)
    norms: int = 0
    dense_flags: list[str] = field(default_factory=list)
    advice: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        unexplained = [f for f, why in self.missed.items() if not why]
        return not self.error and not unexplained and not self.dense_flags


# ---------------------------------------------------------------------------------- models


def _tiny(model_type: str) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from fsdp_precision.testing import tiny_config

    config = tiny_config(AutoConfig.for_model(model_type))
    auto = AutoModelForSeq2SeqLM if model_type == "t5" else AutoModelForCausalLM
    return auto.from_config(config).float()


def _moe(model_type: str) -> nn.Module:
    import screen_hf_keep  # scripts/ is on sys.path when this script or its test runs

    return screen_hf_keep.build(model_type)


def _clip() -> tuple[nn.Module, Any]:
    from transformers import CLIPConfig, CLIPModel

    tower = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 4}  # fmt: skip
    config = CLIPConfig(
        text_config={**tower, "vocab_size": 96, "max_position_embeddings": 16, "eos_token_id": 2},
        vision_config={**tower, "image_size": 16, "patch_size": 8},
        projection_dim=16,
    )
    g = torch.Generator().manual_seed(0)
    inputs = {
        "input_ids": torch.randint(3, 96, (2, 8), generator=g),
        "pixel_values": torch.randn(2, 3, 16, 16, generator=g),
    }
    return CLIPModel(config), inputs


def _wan() -> tuple[nn.Module, Any]:
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(2, 4, 2, 4, 4, generator=g),
        "timestep": torch.tensor([10, 500]),
        "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
    }
    return model, inputs


_CUSTOM: dict[str, Callable[[], tuple[nn.Module, Any]]] = {
    "clip": _clip,
    "wan": _wan,
}


def build(name: str) -> tuple[nn.Module, Any]:
    """The tiny fp32 model and its inputs (``None``: its ``dummy_inputs``), seeded."""
    torch.manual_seed(0)
    if name in _CUSTOM:
        return _CUSTOM[name]()
    return (_moe(name) if name in MOE else _tiny(name)), None


# ---------------------------------------------------------------------------------- ground truth


def declared(model: nn.Module) -> set[str]:
    """The parameters the model's own declarations keep in fp32 at fp16 or bf16."""
    from fsdp_precision._hf.declarations import declarations

    kept: set[str] = set()
    for dtype in (torch.float16, torch.bfloat16):
        for declaration in declarations(model, dtype):
            kept |= set(declaration.params)
    return kept


def routers(model: nn.Module) -> set[str]:
    """Every router weight: a ``gate``/``router`` module's matrix with one row per expert (the
    ground truth may read names; the advisor does not)."""
    config = getattr(model, "config", None)
    experts = {
        getattr(config, a, None) for a in ("num_experts", "n_routed_experts", "num_local_experts")
    } - {None}
    found = set()
    for name, param in model.named_parameters():
        owner = name.rpartition(".")[0].rpartition(".")[2]
        if owner in ("gate", "router") and param.dim() == 2 and param.shape[0] in experts:
            found.add(name)
    return found


def _why(name: str, fqn: str) -> str:
    from fnmatch import fnmatchcase

    return next(
        (why for (arch, glob), why in WHY.items() if arch == name and fnmatchcase(fqn, glob)), ""
    )


# ---------------------------------------------------------------------------------- screen


def screen(name: str) -> Row:
    """One architecture."""
    from fsdp_precision import advise

    row = Row(name)
    try:
        model, inputs = build(name)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        row.error = f"build: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        return row
    advice = advise(model, inputs)
    row.traced = advice.traced
    row.advice = advice.to_dict()["advice"]
    flagged = advice.params()
    strong = advice.params(("router", "log_space", "gain"))
    row.norms = len(advice.params(("norm",)))
    truth_declared, truth_routers = declared(model), routers(model)
    truth = truth_declared | truth_routers
    row.declared, row.routers = sorted(truth_declared), sorted(truth_routers)
    row.found = sorted(truth & flagged)
    row.missed = {fqn: _why(name, fqn) for fqn in sorted(truth - flagged)}
    row.extra = sorted(strong - truth)
    if name in DENSE:
        row.dense_flags = sorted(
            n for n, p in model.named_parameters() if n in flagged and p.dim() >= 2
        )
    if not advice.covered:
        row.error = advice.traced
    return row


def markdown(rows: list[Row]) -> str:
    """The table for the docs, with the reasons of what was missed below it."""
    lines = [
        "| architecture | declared | routers | found | missed | extra (router, log-space, gain) "
        "| norms |",
        "|---|---|---|---|---|---|---|",
    ]
    reasons: dict[str, int] = {}
    for r in rows:
        if r.error:
            lines.append(f"| {r.name} | {r.error} | | | | | |")
            continue
        missed = []
        for glob, why in _first_per_glob(r.missed):
            mark = f"[{reasons.setdefault(why, len(reasons) + 1)}]" if why else "(UNEXPLAINED)"
            missed.append(f"`{glob}` {mark}")
        extra = ", ".join(f"`{f}`" for f in _dedup(r.extra)) or "0"
        truth = len(set(r.declared) | set(r.routers))
        lines.append(
            f"| {r.name} | {len(r.declared)} | {len(r.routers)} | {len(r.found)} of {truth} | "
            f"{', '.join(missed) or '0'} | {extra} | {r.norms} |"
        )
    lines.append("")
    lines.extend(f"[{n}] {why}" + "  " for why, n in reasons.items())
    return "\n".join(lines).rstrip()


def _short(fqn: str) -> str:
    """The FQN with block indices globbed and its leading modules cut: ``*.mlp.gate.weight``."""
    parts = ["*" if s.isdigit() else s for s in fqn.split(".")]
    stars = [i for i, part in enumerate(parts) if part == "*"]
    return "*." + ".".join(parts[stars[-1] + 1 :]) if stars else ".".join(parts)


def _dedup(fqns: list[str]) -> list[str]:
    return list(dict.fromkeys(_short(f) for f in fqns))


def _first_per_glob(missed: dict[str, str]) -> list[tuple[str, str]]:
    seen: dict[str, str] = {}
    for fqn, why in missed.items():
        seen.setdefault(_short(fqn), why)
    return list(seen.items())


def run(names: list[str]) -> list[Row]:
    """Every architecture named, in this process."""
    import transformers.utils.logging as hf_logging

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    return [screen(name) for name in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(ARCHITECTURES))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = run(args.names)
    if args.json:
        print(json.dumps([{**asdict(r), "ok": r.ok} for r in rows], indent=2))
    else:
        import transformers

        print(f"transformers {transformers.__version__}, torch {torch.__version__}\n")
        print(markdown(rows))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
