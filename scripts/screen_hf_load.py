"""Does ``hf.cast_keeping_fp32`` give what ``from_pretrained(dtype)`` gives, tensor by tensor?

For every architecture of the installed transformers (and Diffusers) that declares
``_keep_in_fp32_modules`` or ``_keep_in_fp32_modules_strict`` and builds at a tiny size: build it
in fp32 from its config, ``save_pretrained`` it to a temporary directory, then for fp16 and bf16
compare the dtype of every parameter and buffer of ``from_pretrained(dir, dtype)`` with
``cast_keeping_fp32(copy of the fp32 model, dtype)``. Prints a Markdown table (``--json`` for
JSON); exits 1 if any architecture differs.

    python scripts/screen_hf_load.py                  # every declaring architecture
    python scripts/screen_hf_load.py t5 deepseek_v3   # some transformers model types
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn

LOW = (torch.float16, torch.bfloat16)
#: Preference among a model type's declaring classes: the widest scope first.
_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "ForSeq2SeqLM", "Model")
#: Constructor arguments that shrink the Diffusers video transformers (Wan and its relatives).
_DIFFUSERS_TINY: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 16,
    "freq_dim": 16,
    "ffn_dim": 32,
    "num_layers": 2,
    "num_single_layers": 1,
    "rope_max_seq_len": 32,
}
#: A Diffusers class whose defaults the tiny arguments do not shrink below this is skipped.
_MAX_PARAMS = 5_000_000


@dataclass
class Row:
    """One architecture's outcome.

    Attributes:
        name: transformers model type, or Diffusers class name.
        model: The class built.
        kept: Per dtype, how many tensors ``from_pretrained`` left in fp32.
        differences: ``(dtype, FQN, from_pretrained's dtype, cast_keeping_fp32's dtype)``.
        note: Why it was not screened (empty when it was).
    """

    name: str
    model: str = ""
    kept: dict[str, int] = field(default_factory=dict)
    differences: list[tuple[str, str, str, str]] = field(default_factory=list)
    note: str = ""


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _declares(cls: type) -> bool:
    return bool(
        getattr(cls, "_keep_in_fp32_modules", None)
        or getattr(cls, "_keep_in_fp32_modules_strict", None)
    )


def transformers_architectures(only: list[str]) -> Iterator[tuple[str, type, Callable[[], Any]]]:
    """``(model type, class, builder)`` of every declaring transformers model type."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from fsdp_precision.testing import tiny_config

    tables = [
        getattr(modeling_auto, n)
        for n in dir(modeling_auto)
        if n.startswith("MODEL_") and n.endswith("_MAPPING_NAMES")
    ]
    for model_type in only or list(CONFIG_MAPPING_NAMES):
        names: set[str] = set()
        for table in tables:
            value = table.get(model_type)
            if value is not None:
                names.update(value if isinstance(value, (tuple, list)) else (value,))
        classes = [getattr(transformers, n, None) for n in sorted(names)]
        declaring = [c for c in classes if isinstance(c, type) and _declares(c)]
        if not declaring:
            continue

        def rank(cls: type) -> tuple[int, str]:
            ends = [i for i, s in enumerate(_SUFFIXES) if cls.__name__.endswith(s)]
            return (ends[0] if ends else len(_SUFFIXES), cls.__name__)

        cls = min(declaring, key=rank)

        def build(cls: Any = cls, model_type: str = model_type) -> Any:
            return cls._from_config(tiny_config(AutoConfig.for_model(model_type)))

        yield model_type, cls, build


def diffusers_architectures(only: list[str]) -> Iterator[tuple[str, type, Callable[[], Any]]]:
    """``(class name, class, builder)`` of every declaring Diffusers model class."""
    import diffusers

    for name in sorted(dir(diffusers)):
        if only and name not in only:
            continue
        try:
            cls = getattr(diffusers, name)
        except Exception:  # noqa: BLE001 - a lazily imported class whose backend is missing
            continue
        if not (inspect.isclass(cls) and issubclass(cls, diffusers.ModelMixin)):
            continue
        if not getattr(cls, "_keep_in_fp32_modules", None):
            continue
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in _DIFFUSERS_TINY.items() if k in accepted}

        def build(cls: Any = cls, kwargs: dict[str, Any] = kwargs) -> Any:
            with torch.device("meta"):
                size = sum(p.numel() for p in cls(**kwargs).parameters())
            if size > _MAX_PARAMS:
                raise ValueError(f"{size:,} parameters with the screen's tiny arguments")
            return cls(**kwargs)

        yield name, cls, build


def _dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    out = {n: p.dtype for n, p in model.named_parameters(remove_duplicate=False)}
    out.update({n: b.dtype for n, b in model.named_buffers(remove_duplicate=False)})
    return out


def screen(name: str, cls: type, build: Callable[[], Any]) -> Row:
    """Build, save and reload one architecture; compare with ``cast_keeping_fp32``."""
    from fsdp_precision import hf

    row = Row(name, cls.__name__)
    try:
        torch.manual_seed(0)
        model = build()
    except Exception as exc:  # noqa: BLE001 - a survey: report and go on
        row.note = f"not built at a tiny size: {type(exc).__name__}: {_first_line(exc)}"
        return row
    diffusers = "diffusers" in cls.__module__
    with tempfile.TemporaryDirectory() as directory:
        try:
            model.save_pretrained(directory)
        except Exception as exc:  # noqa: BLE001
            row.note = f"not saved: {type(exc).__name__}: {_first_line(exc)}"
            return row
        for dtype in LOW:
            kwargs = {"torch_dtype" if diffusers else "dtype": dtype}
            loaded = cls.from_pretrained(directory, **kwargs)  # type: ignore[attr-defined]
            cast = hf.cast_keeping_fp32(copy.deepcopy(model), dtype)
            want, got = _dtypes(loaded), _dtypes(cast)
            row.kept[_short(dtype)] = sum(d == torch.float32 for d in want.values())
            for fqn in sorted(set(want) | set(got)):
                if want.get(fqn) != got.get(fqn):
                    pair = [_short(d) if d else "absent" for d in (want.get(fqn), got.get(fqn))]
                    row.differences.append((_short(dtype), fqn, pair[0], pair[1]))
    return row


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return text[:100]


def table(rows: list[Row]) -> str:
    """The Markdown table of the screen."""
    lines = [
        "| architecture | class | fp32 after fp16 load | fp32 after bf16 load | differences |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r.note:
            lines.append(f"| {r.name} | {r.model} | | | {r.note} |")
            continue
        diff = ", ".join(f"{d}: {f} ({a} vs {b})" for d, f, a, b in r.differences[:3]) or "0"
        lines.append(
            f"| {r.name} | {r.model} | {r.kept.get('float16', 0)} | {r.kept.get('bfloat16', 0)} "
            f"| {diff} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="model types or Diffusers classes (default: all)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    parser.add_argument("--no-diffusers", action="store_true", help="transformers only")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    found = list(transformers_architectures(args.names))
    if not args.no_diffusers:
        found += list(diffusers_architectures(args.names))
    rows = [screen(*arch) for arch in found]
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        import diffusers

        screened = [r for r in rows if not r.note]
        print(
            f"transformers {transformers.__version__}, diffusers {diffusers.__version__}, torch "
            f"{torch.__version__}: {len(screened)} of {len(rows)} declaring architectures "
            f"screened, {sum(bool(r.differences) for r in screened)} with differences\n"
        )
        print(table(rows))
    return 1 if any(r.differences for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
