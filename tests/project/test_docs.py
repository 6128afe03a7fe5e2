"""Every ```python block of the README and the documentation site runs.

Blocks of one page run in order in one namespace, like a session; before each block ``model`` is
a fresh model the page's prose assumes (a small transformer with LayerNorms, MoE routers and
adapters; a tiny Hugging Face Llama on the checkpoints page), in a one-rank gloo group, inside a
temporary working directory. ``init_process_group`` is a no-op there (the group exists).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = Path(__file__).parents[2]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
PAGES = sorted(
    p.relative_to(ROOT).as_posix()
    for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    if BLOCK.search(p.read_text())
)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.post_attention_layernorm = nn.LayerNorm(dim)
        self.mlp = nn.Module()
        self.mlp.gate = nn.Linear(dim, 2, bias=False)
        self.mlp.up = nn.Linear(dim, dim)
        self.adapter = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        weights = self.mlp.gate(h.to(self.mlp.gate.weight.dtype)).softmax(-1).to(h.dtype)
        return (
            x
            + weights[..., :1] * self.mlp.up(h)
            + self.adapter(h.to(self.adapter.weight.dtype)).to(h.dtype)
        )


class DocModel(nn.Module):
    """What the pages call ``model``: ``layers`` of blocks, a final ``norm``."""

    _no_split_modules = ("Block",)

    def __init__(self, dim: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.norm(x)
        return out


def _tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


#: The packages a page's blocks import, beyond torch (its test skips, naming them, without).
NEEDS = {
    "docs/advice.md": ("transformers",),
    "docs/checkpoints.md": ("transformers", "safetensors"),
    "docs/integrations.md": ("transformers", "peft"),
}


def _namespace(page: str) -> tuple[dict[str, Any], Callable[[], nn.Module]]:
    from torch.distributed.device_mesh import init_device_mesh

    ns: dict[str, Any] = {
        "torch": torch,
        "mesh": init_device_mesh("cpu", (1,)),
        "build_model": DocModel,
        "load_full_state_dict": lambda: DocModel().state_dict(),
    }
    for package in NEEDS.get(page, ()):
        pytest.importorskip(package, reason=f"{page} needs {package} (pip install '.[hf,peft]')")
    if page == "docs/checkpoints.md":
        from fsdp_precision import DistributedConfig, wrap_model_for_training

        model = wrap_model_for_training(_tiny_llama(), DistributedConfig())
        ns.update(model=model, optimizer=torch.optim.AdamW(model.parameters()), step=3)
        return ns, lambda: model
    return ns, DocModel


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run(
    page: str, world1: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = BLOCK.findall((ROOT / page).read_text())
    assert blocks, page
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: None)
    ns, fresh = _namespace(page)
    for i, source in enumerate(blocks, 1):
        ns["model"] = fresh()
        try:
            exec(compile(source, f"{page} block {i}", "exec"), ns)
        except Exception as exc:
            raise AssertionError(f"{page}, python block {i} fails: {exc!r}\n{source}") from exc


def test_pages_are_found() -> None:
    # A regex or path mistake must not turn this file into zero tests.
    assert {"README.md", "docs/rules.md", "docs/checkpoints.md"} <= set(PAGES)


def _pages() -> dict[str, str]:
    return {
        p.relative_to(ROOT).as_posix(): p.read_text()
        for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    }


def test_no_page_announces_a_capability_as_the_next_one() -> None:
    """The docs describe what the code does; a plan belongs in the issues (after-training's
    Limits called exempting unit-boundary inputs "the next capability" after ``uncast_inputs``
    shipped)."""
    coming = [name for name, text in _pages().items() if "next capability" in text.lower()]
    assert coming == []


def test_the_export_limits_name_the_way_to_keep_unit_inputs() -> None:
    text = (ROOT / "docs" / "after-training.md").read_text()
    limits = text.partition("\n## Limits\n")[2].partition("\n## ")[0]
    boundary = [line for line in limits.split("\n- ") if line.startswith("Unit boundaries")]
    assert boundary and "uncast_inputs" in boundary[0], limits
