"""The routing-replay screen: every transformers MoE family replays, or is refused by name.

Each family whose modeling file defines a router (a class named like ``...Router``,
``...Gating``, ``...Gate``) is built tiny in fp32 (``screen_hf_keep``'s sizes; a multimodal
family by its text config) and screened with :class:`~fsdp_precision.replay.RoutingReplay`:

- ``replays``: replay attaches; replaying the model's own live routes (recorded from the
  routers' top-k in a live forward) gives logits bitwise equal to the live forward; replaying
  other routes (live ids + 1 mod experts) makes every router hand its experts exactly those
  ids, changes the logits, keeps them finite, and gives every router's gate weight a finite,
  non-zero gradient;
- ``refused``: ``RoutingReplay(model)`` raises ``RoutingReplayError`` naming the router;
- ``fails``: anything else (exit status 1; fix ``REFUSED``/``ATTRIBUTES`` in
  ``src/fsdp_precision/_replay/routers.py``).

    python scripts/screen_replay.py                  # every family, writes the JSON
    python scripts/screen_replay.py qwen3_moe llama  # some, printed
    python scripts/screen_replay.py --markdown       # docs/replay-families.md, from the JSON

``tests/replay/test_families.py`` checks the JSON still holds.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import screen_hf_keep as keep
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[1]
JSON = ROOT / "tests" / "replay" / "replay_screen.json"
COMMAND = "python scripts/screen_replay.py"

#: Classes named like routers that are not MoE routers (nothing picks experts), and what they do.
NOT_ROUTERS: dict[str, str] = {
    "BailingHybridForgetGate": "the linear attention's forget gate",
    "DFineGate": "the detection decoder's gated residual",
    "Deimv2Gate": "the detection decoder's gated residual",
    "Glm5NextTextForgetGate": "the linear attention's forget gate",
    "GraniteDoclingDensityRouter": "scores image tokens' density, no experts",
    "Inkling2LoopMessageGate": "mixes a loop's message into the hidden states",
    "KimiLinearForgetGate": "the linear attention's forget gate",
    "MuseSparkResidualGate": "scales the residual and the hidden states",
}
#: MoE families whose experts are picked without a router class: the module that picks, and how.
WITHOUT_ROUTER_CLASS = {
    "doge": ("DogeCDMoE", "product keys: a top-k over sqrt(experts) keys twice, then over pairs"),
}
SPARSE = ["sparse", "sparse"]  # both decoder layers MoE
#: Config fields some families need beyond the shared tiny sizes.
OVERRIDES: dict[str, dict[str, Any]] = {
    "axk1": {"head_dim": 8, "num_key_value_heads": 4},  # multi-head latent attention
    "axk2": {"head_dim": 8, "num_key_value_heads": 4},
    "mistral_large4_text": {"head_dim": 8, "num_key_value_heads": 4},
    "beam": {"mlp_layer_types": SPARSE},
    "dbrx": dict(  # its own names for the sizes
        d_model=64,
        n_heads=4,
        n_layers=2,
        max_seq_len=64,
        attn_config={"kv_n_heads": 2, "rope_theta": 1e4},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
    ),
    "dots1": {"n_shared_experts": 1},
    "dots3_note_text": {"num_key_value_heads": 4},
    "ernie4_5_vl_moe_text": {
        "moe_intermediate_size": [32, 32],
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [3, 3, 2]},
    },
    "deepseek_ocr2_text": {"mlp_layer_types": SPARSE},
    "diffusion_gemma_text": {"enable_moe_block": True, "top_k_experts": 2},
    "step3p7": {"mlp_layer_types": SPARSE, "sliding_window": 16},
    "qwen3_omni_moe_talker_text": {"shared_expert_intermediate_size": 32},
    "gemma4_text": {"enable_moe_block": True, "top_k_experts": 2},
    "glm4v_moe_text": {"rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1]}},
    "glm5_next_text": dict(
        num_key_value_heads=4, index_kpool=2, qk_rope_head_dim=0, mlp_layer_types=SPARSE
    ),
    "hy_v4_vl_text": {"rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1]}},
    "zaya": {"num_experts_per_tok": 1},  # its only top-k
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 0},
}

#: Types whose own weight init leaves the router and the experts empty (zeros): the screen
#: fills them (normal, std 0.02) so that the experts' outputs differ.
UNINITIALIZED = {"qwen3_omni_moe_talker_text"}

_TOPK = (torch.topk, torch.Tensor.topk)


@cache
def router_classes() -> dict[str, str]:
    """Every class transformers' modeling files name like a router: class -> family folder."""
    import transformers

    from fsdp_precision._replay.routers import _ROUTER_NAME

    found = {}
    for path in sorted((Path(transformers.__file__).parent / "models").glob("*/modeling_*.py")):
        for name in re.findall(r"^class (\w+)\(", path.read_text(), flags=re.M):
            if _ROUTER_NAME.search(name):
                found[name] = path.parent.name
    return found


def model_types() -> dict[str, str]:
    """The model types screened, each with its family folder: a family's text types where it
    has them (the decoder with the routers), else its causal LM, else its own type."""
    from transformers.models.auto.configuration_auto import (
        CONFIG_MAPPING_NAMES,
        model_type_to_module_name,
    )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    folders = {f for c, f in router_classes().items() if c not in NOT_ROUTERS}
    folders |= set(WITHOUT_ROUTER_CLASS)
    chosen = {}
    for folder in sorted(folders):
        types = [t for t in CONFIG_MAPPING_NAMES if model_type_to_module_name(t) == folder]
        text = [t for t in types if t.endswith("_text")]
        causal = [t for t in types if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
        for t in text or causal[:1] or [t for t in types if t.replace("-", "_") == folder]:
            chosen[t] = folder
    return chosen


def build(model_type: str) -> nn.Module:
    """The tiny fp32 model, seeded, in eval mode (no router jitter): ``screen_hf_keep.build``
    where the type has a causal LM, else the model class of its config (a multimodal config's
    text config) from the same sizes."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in OVERRIDES:
        return keep.build(model_type).eval()
    small = {**keep.SMALL, **OVERRIDES.get(model_type, {})}
    if model_type in keep.MLA:
        small.update(head_dim=small["qk_rope_head_dim"], num_key_value_heads=4)
    torch.manual_seed(0)
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        config = AutoConfig.for_model(model_type, **small)
        return AutoModelForCausalLM.from_config(config).float().eval()
    text = getattr(AutoConfig.for_model(model_type), "text_config", None)
    config = type(text)(**small) if text is not None else AutoConfig.for_model(model_type, **small)
    model = _model_class(config)(config).float().eval()
    if model_type in UNINITIALIZED:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".mlp.gate." in name or ".mlp.experts." in name:
                    p.normal_(std=0.02)
    return model


def _model_class(config: Any) -> Any:
    """The family's model for ``config``: its causal LM, else its (text) model."""
    import importlib

    package = type(config).__module__.rsplit(".", 1)[0]
    module = importlib.import_module(f"{package}.modeling_{package.rsplit('.', 1)[1]}")
    classes = [
        c
        for c in vars(module).values()
        if isinstance(c, type) and getattr(c, "config_class", None) is type(config)
    ]
    for suffix in ("ForCausalLM", "Model"):
        for c in classes:
            if c.__name__.endswith(suffix) and not c.__name__.endswith("PreTrainedModel"):
                return c
    raise TypeError(f"no model class of {package} takes {type(config).__name__}")


class _Record(TorchFunctionMode):
    """Records the ``topk`` over the experts a router calls (replay answers exactly that one)."""

    def __init__(self, top_k: int, num_experts: int) -> None:
        super().__init__()
        self.top_k, self.num_experts = top_k, num_experts
        self.ids: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func in _TOPK:
            scores = args[0] if args else kwargs["input"]
            k = args[1] if len(args) > 1 else kwargs["k"]
            dim = (args[2] if len(args) > 2 else (kwargs or {}).get("dim", -1)) % scores.dim()
            if k == self.top_k and scores.shape[dim] == self.num_experts:
                self.ids.append(out[1].movedim(dim, -1).reshape(-1, k))
        return out


def _experts_see(router: nn.Module, output: Any, tokens: int, top_k: int) -> torch.Tensor:
    """The expert ids a router hands its experts, ``[tokens, top_k]`` sorted per token: its
    returned indices, or where it returns a dense mask or sorted groups, read from those."""
    name = type(router).__name__
    if name == "Llama4Router":  # sigmoid of scattered top-k values, -inf (so 0) elsewhere
        chosen = output[0].reshape(tokens, -1).ne(0)
    elif name == "JetMoeTopKGating":  # tokens grouped by expert: batch_index, expert_size
        _, batch_index, _, expert_size, _ = output
        experts = torch.repeat_interleave(torch.arange(len(expert_size)), torch.tensor(expert_size))
        chosen = torch.zeros(tokens, len(expert_size), dtype=torch.bool)
        chosen[batch_index, experts] = True
    elif name == "ZayaRouter":  # its skip class (id num_experts) goes on as expert 0, weight 0
        ids = output[2].masked_fill(output[1].eq(0), router.num_experts)
        return ids.reshape(tokens, top_k).sort(-1).values
    else:  # the last integer tensor it returns
        ids = [o for o in output if isinstance(o, torch.Tensor) and not o.is_floating_point()][-1]
        return ids.reshape(tokens, top_k).sort(-1).values
    counts = chosen.sum(-1)
    if not bool((counts == top_k).all()):
        raise AssertionError(f"{name} hands tokens {counts.tolist()} experts, not {top_k}")
    return chosen.nonzero()[:, 1].reshape(tokens, top_k)


def _outputs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    try:
        out = model(input_ids=ids)
    except AttributeError as exc:  # Qwen3-Omni's talker embeds outside (no embed_tokens)
        if "embed_tokens" not in str(exc):
            raise
        out = model(inputs_embeds=model.get_input_embeddings()(ids))
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _forward(model: nn.Module, replay: Any, ids: torch.Tensor, record: bool) -> tuple[Any, ...]:
    """One forward: the logits, per router its recorded top-k ids (``record``) and the ids it
    handed its experts."""
    shape, tokens = replay.shape, ids.numel()
    recorded: dict[str, list[torch.Tensor]] = {}
    seen: dict[str, torch.Tensor] = {}
    modes: list[_Record] = []  # entered in the router's pre-hook, left in its hook

    def pre(module: nn.Module, args: Any) -> None:
        if record:
            modes.append(_Record(shape.top_k, shape.num_experts).__enter__())

    def post(module: nn.Module, args: Any, output: Any) -> None:
        fqn = fqns[id(module)]
        if record:
            mode = modes.pop()
            mode.__exit__(None, None, None)
            recorded[fqn] = mode.ids
        output = output if isinstance(output, tuple) else (output,)
        seen[fqn] = _experts_see(module, output, tokens, shape.top_k)

    fqns = {id(r.module): r.fqn for r in replay.routers}
    handles = [
        h
        for r in replay.routers
        for h in (r.module.register_forward_pre_hook(pre), r.module.register_forward_hook(post))
    ]
    try:
        logits = _outputs(model, ids)
    finally:
        for h in handles:
            h.remove()
        while modes:  # a router that raised: leave its mode
            modes.pop().__exit__(None, None, None)
    return logits, recorded, seen


def check(model: nn.Module) -> str:
    """Screen a built model: the ``replays`` summary, or raise (``RoutingReplayError`` where
    replay refuses it, ``AssertionError`` where a check fails)."""
    from fsdp_precision.replay import RoutingReplay

    replay = RoutingReplay(model)
    shape = replay.shape
    seeded = torch.Generator().manual_seed(1)
    ids = torch.randint(1, keep.SMALL["vocab_size"], (2, 8), generator=seeded)
    with replay.live(), torch.no_grad():
        live, recorded, live_seen = _forward(model, replay, ids, record=True)
    routes = torch.full((ids.numel(), shape.layers, shape.top_k), -1, dtype=torch.long)
    for r in replay.routers:
        calls = recorded.get(r.fqn, [])
        assert len(calls) == 1, f"{r.fqn} called top-{shape.top_k} {len(calls)} times"
        assert torch.equal(calls[0].sort(-1).values, live_seen[r.fqn]), f"{r.fqn}: live ids"
        row = routes[:, r.layer]
        assert bool((row < 0).all() | row.eq(calls[0]).all()), f"{r.fqn}: a layer's 2nd router"
        row.copy_(calls[0])
    routes.clamp_(min=0)  # dense layers' rows: unused
    with replay.routes(routes), torch.no_grad():
        same, _, _ = _forward(model, replay, ids, record=False)
    assert torch.equal(same, live), "replaying the live routes changed the logits"
    other = (routes + 1) % shape.num_experts
    with replay.routes(other):
        moved, _, seen = _forward(model, replay, ids, record=False)
        moved.float().square().mean().backward()
    for r in replay.routers:
        want = other[:, r.layer].sort(-1).values
        assert torch.equal(seen[r.fqn], want), f"{r.fqn} handed its experts other ids"
        params = r.module.named_parameters()  # its weight matrices: the gate's, a router MLP's
        weights = [(n, p) for n, p in params if n.endswith("weight") and p.dim() > 1]
        assert weights, f"{r.fqn} has no weight"
        for n, p in weights:
            assert p.grad is not None and bool(p.grad.isfinite().all()), f"{r.fqn}.{n}: grad"
            assert bool(p.grad.ne(0).any()), f"{r.fqn}.{n}: zero gradient"
    assert bool(moved.isfinite().all()), "replaying other routes gave non-finite logits"
    assert not torch.equal(moved, live), "replaying other routes left the logits unchanged"
    return (
        f"{len(replay.routers)} routers, top-{shape.top_k} of {shape.num_experts}: live routes "
        "replay bitwise; other routes reach the experts, gate grads finite and non-zero"
    )


def screen(model_type: str, family: str = "") -> dict[str, str]:
    """One model type's row: ``status``, ``router`` (the class that decided), ``why``."""
    from fsdp_precision._replay.routers import REFUSED, router_class
    from fsdp_precision.replay import RoutingReplayError

    row = {"status": "fails", "router": "", "why": "", "family": family or model_type}
    try:
        model = build(model_type)
    except Exception as exc:
        row["why"] = f"not built: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return row
    names = [router_class(m).__name__ for m in model.modules()]
    routers = [n for n in names if n in REFUSED] or [
        n for n in names if n in router_classes() and n not in NOT_ROUTERS
    ]
    picker, how = WITHOUT_ROUTER_CLASS.get(family, ("", ""))
    row["router"] = routers[0] if routers else picker
    try:
        row["why"] = check(model)
        row["status"] = "replays"
    except RoutingReplayError as exc:
        row["why"] = str(exc)
        named = "routing replay cannot drive" in row["why"] or "has no router" in row["why"]
        row["status"] = "refused" if named else "fails"
        row["why"] += f" ({picker} picks by {how})" if how else ""
    except Exception as exc:
        row["why"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return row


def screen_all(types: dict[str, str], echo: Callable[[str], None] | None = None) -> dict[str, Any]:
    import transformers
    import transformers.utils.logging as hf_logging

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    rows = {}
    for model_type, family in types.items():
        rows[model_type] = screen(model_type, family)
        if echo:
            echo(_line(model_type, rows[model_type]))
    classes = {c: f for c, f in router_classes().items() if c not in NOT_ROUTERS}
    return {
        "command": COMMAND,
        "transformers": transformers.__version__,
        "classes": classes,
        "types": rows,
    }


def _line(model_type: str, row: dict[str, str]) -> str:
    why = row["why"].replace("|", "\\|")
    return f"| {model_type} | {row['family']} | {row['router']} | {row['status']} | {why} |"


def markdown(screened: dict[str, Any]) -> str:
    """The docs page: every screened model type, its router, its status and why."""
    rows = screened["types"]
    counts = {s: sum(r["status"] == s for r in rows.values()) for s in ("replays", "refused")}
    return "\n".join(
        [
            "# Routing replay: the transformers MoE families",
            "",
            f"Screened with transformers {screened['transformers']} by `{screened['command']}`"
            f" (the table: `python scripts/screen_replay.py --markdown`): {len(rows)} model "
            f"types, {counts['replays']} replay, {counts['refused']} are refused by name.",
            "",
            "**replays**: each model, built tiny, replays its own live routes bitwise; other "
            "routes reach every router's experts exactly, change the logits, and give every "
            "gate weight a finite, non-zero gradient. **refused**: `RoutingReplay(model)` "
            "raises `RoutingReplayError` with the reason. `tests/replay/test_families.py` "
            "keeps this table true.",
            "",
            "| model type | family | router | status | why |",
            "|---|---|---|---|---|",
            *(_line(t, rows[t]) for t in sorted(rows)),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*")
    parser.add_argument("--markdown", action="store_true", help="the docs page, from the JSON")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(JSON.read_text())), end="")
        return 0
    types = model_types()
    chosen = {t: types.get(t, t) for t in args.model_types} if args.model_types else types
    screened = screen_all(chosen, echo=lambda line: print(line, file=sys.stderr, flush=True))
    if not args.model_types:
        JSON.write_text(json.dumps(screened, indent=1, sort_keys=True) + "\n")
    else:
        print(json.dumps(screened, indent=1))
    return 1 if any(r["status"] == "fails" for r in screened["types"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
