"""``DistributedConfig``'s defaults are the framework ticket's, and the guide's knob table is the
config's fields: every field a row, every row's default the field's (T2, T4 in
``docs/seeds.md``). Bad values: ``tests/train/test_wrap.py::test_config_rejects_bad_values``."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

import fsdp_precision as fp

GUIDE = Path(__file__).parents[2] / "docs" / "guides" / "distributed.md"


def test_the_defaults_train_in_bf16_on_the_device() -> None:
    config = fp.DistributedConfig()
    assert config.fsdp_mixed_precision == "bf16"
    assert config.fsdp_cpu_offload is False
    rules = config.precision()
    assert (rules.param_dtype, rules.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert rules.hf_keep_in_fp32  # the model's own declarations kept by default
    assert (config.parallel_strategy, config.fsdp_layout) == ("fsdp", "in_unit")


def knob_table() -> dict[str, str]:
    """The guide's "Every knob" table: field name -> the default as written."""
    section = GUIDE.read_text().split("## Every knob", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        for name in re.findall(r"`([a-z_0-9]+)`", cells[0]):
            rows[name] = cells[1].strip("`")
    return rows


def written(field: dataclasses.Field[object]) -> str:
    """A field's default as the guide writes it (``10_000_000``, ``"bf16"``, ``()``)."""
    if field.default_factory is not dataclasses.MISSING:
        return repr(field.default_factory())
    value = field.default
    return (
        f"{value:_}"
        if isinstance(value, int) and not isinstance(value, bool)
        else (f'"{value}"' if isinstance(value, str) else repr(value))
    )


def test_the_guides_knob_table_is_the_configs_fields() -> None:
    rows = knob_table()
    fields = {f.name: f for f in dataclasses.fields(fp.DistributedConfig)}
    assert set(rows) == set(fields), (
        f"missing from the guide: {sorted(set(fields) - set(rows))}; "
        f"no such field: {sorted(set(rows) - set(fields))}"
    )
    for name, default in rows.items():
        assert default == written(fields[name]), (name, default, written(fields[name]))
