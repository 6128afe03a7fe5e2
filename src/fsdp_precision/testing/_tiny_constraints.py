"""What a shrunk transformers config must keep consistent, so that the architecture's own
validators accept it and its forward runs: the constraints between attributes, as data.

:func:`fsdp_precision.testing.tiny_config` shrinks sizes one by one; the architectures check
relations between them (Mamba2: ``hidden_size * expand == num_heads * head_dim``; Qwen2-VL:
the ``mrope_section`` sums to half the rotary dimension; Gemma 4: per-layer overrides name
layers that exist; a vision tower's ``out_hidden_size`` equals the text model's width). Each
relation here is stated once, by the attributes it involves, and applies to every config that
has them; the architectures that motivated it are named beside it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import operator
import re
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DERIVED",
    "HIDDEN",
    "WIDTH_SUFFIXES",
    "Derived",
    "apply_derived",
    "code_defaults",
    "depth_parts",
    "hidden_widths",
    "positive_int",
    "reindex_layers",
    "shrink_named",
    "remap_feature_layers",
    "repeat_patterns",
    "rescale_mrope",
    "select_layers",
]

#: The model widths. An attribute named like a width (:data:`WIDTH_SUFFIXES`) anywhere in the
#: config tree whose value was one of these widths becomes the tiny width with them: a vision
#: tower's ``out_hidden_size`` (Granite Docling), ``text_hidden_size`` (Inkling 2), an audio
#: encoder's ``out_hidden_size`` (Muse Spark), a head's ``audio_hidden_size`` (NeMo SpeechLM),
#: ``codebook_dim`` (WavTokenizer), ``hidden_size_global`` (BLT), ``embedding_dim`` (xLSTM),
#: ``adapter_in_dim`` and ``adapter_input_size`` (Dots 3); and any ``*hidden_size*``. Other
#: width-named attributes become :data:`OTHER_WIDTH` at most: equal widths stay equal either way.
HIDDEN = ("hidden_size", "d_model", "n_embd", "embed_dim")
WIDTH_SUFFIXES = (
    "hidden_size", "hidden_dim", "embed_dim", "embedding_dim", "codebook_dim", "projection_dim",
    "_in_dim", "_out_dim", "_input_dim", "_output_dim", "_input_size", "_output_size",
    "intermediate_size",
)  # fmt: skip
OTHER_WIDTH = 64
#: Head sizes not named in ``TINY_SIZES`` (``index_head_dim``, ``swa_head_dim``) become at most
#: this.
HEAD_DIM = 8
#: Vocabulary sizes not named in ``TINY_SIZES`` (``encoder_hash_byte_group_vocab``,
#: ``shape_vocab_size``) become at most this.
VOCAB = 96


def shrink_named(data: dict[str, Any], explicit: dict[str, int], widths: set[int]) -> None:
    """The sizes ``explicit`` does not name, by their names: widths (equal ones stay equal),
    head sizes, vocabularies; lists of sizes ``explicit`` names, and lists of widths, shrink
    entry by entry (Florence-2's per-stage ``embed_dim`` and ``num_heads``, VibeVoice's
    ``depths``, Muse Spark's audio ``hidden_sizes``)."""
    for key, value in data.items():
        if not isinstance(key, str):
            continue
        if isinstance(value, list) and value and all(positive_int(v) for v in value):
            if key in explicit:
                data[key] = [min(v, explicit[key]) for v in value]
            elif key.endswith(("hidden_sizes", "embed_dims", "hidden_dims")):
                data[key] = [min(v, explicit["hidden_size"]) for v in value]
            continue
        if key in explicit or not positive_int(value):
            continue
        if key.endswith(WIDTH_SUFFIXES) or "hidden_size" in key:
            data[key] = explicit["hidden_size"] if value in widths else min(value, OTHER_WIDTH)
        elif key.endswith("head_dim"):
            data[key] = min(value, HEAD_DIM)
        elif key.endswith(("vocab", "vocab_size")):
            data[key] = min(value, VOCAB)


#: Layer-index lists filtered and renumbered with the kept layers.
INDEX_LISTS = ("mlp_only_layers", "moe_layers", "full_attn_idxs", "global_attn_layers")
#: At most this many layers, whatever the number of distinct layer kinds.
MAX_LAYERS = 4
#: Layer kinds whose layers share one block's weights (Zamba ties every hybrid layer's shared
#: transformer to the first one's): a tiny copy keeps two of them.
SHARED_KINDS = (("layers_block_type", "hybrid"),)


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def hidden_widths(data: dict[str, Any]) -> set[int]:
    """Every :data:`HIDDEN` width in ``data`` and its nested configs."""
    found = {data[k] for k in HIDDEN if positive_int(data.get(k))}
    for value in data.values():
        if isinstance(value, dict):
            found |= hidden_widths(value)
    return found


# --------------------------------------------------------------------------- layers


def _signature(data: dict[str, Any], i: int, lists: list[str]) -> tuple[Hashable, ...]:
    overrides = _per_layer(data).get(i)
    return (*(data[k][i] for k in lists), repr(sorted(overrides.items())) if overrides else None)


def _per_layer(data: dict[str, Any]) -> dict[int, dict[str, Any]]:
    per_layer = data.get("per_layer_config")
    if not isinstance(per_layer, dict):
        return {}
    return {int(k): v for k, v in per_layer.items() if str(k).isdigit() and isinstance(v, dict)}


def select_layers(data: dict[str, Any], old_depth: int, count: int) -> list[int]:
    """The layers a tiny copy keeps: the first of each distinct kind (a per-layer list's value,
    such as ``layer_types``, and the layer's ``per_layer_config`` overrides), then the first
    layers, ``count`` in all (more where there are more kinds, at most :data:`MAX_LAYERS`).
    Olmo-Hybrid keeps an attention layer, Gemma 3 a full-attention one."""
    lists = [
        k
        for k, v in data.items()
        if isinstance(v, list)
        and len(v) == old_depth
        and all(isinstance(x, (str, int, float, bool, type(None))) for x in v)
    ]
    kinds: dict[tuple[Hashable, ...], int] = {}
    for i in range(old_depth):
        kinds.setdefault(_signature(data, i, lists), i)
    kept = list(kinds.values())[:MAX_LAYERS]
    for key, kind in SHARED_KINDS:
        same = [i for i, v in enumerate(data.get(key) or ()) if v == kind]
        kept += [i for i in same[:2] if i not in kept] if key in lists else []
    wanted = min(max(count, len(kept)), old_depth)
    kept += [i for i in range(old_depth) if i not in kept][: wanted - len(kept)]
    return sorted(kept)


def reindex_layers(data: dict[str, Any], kept: list[int], old_depth: int) -> None:
    """Per-layer lists keep the kept layers' entries, layer-index lists and ``per_layer_config``
    are renumbered (Gemma 4's, Dots 3's per-layer head sizes)."""
    new = {old: i for i, old in enumerate(kept)}
    for key, value in list(data.items()):
        if isinstance(value, list) and len(value) == old_depth:
            data[key] = [value[i] for i in kept]
    for key in INDEX_LISTS:
        value = data.get(key)
        if isinstance(value, list) and all(isinstance(i, int) for i in value):
            data[key] = [new[i] for i in value if i in new]
    per_layer = data.get("per_layer_config")
    if isinstance(per_layer, dict):
        width = max((len(str(k)) for k in per_layer), default=1)
        data["per_layer_config"] = {
            str(new[i]).zfill(width): v for i, v in sorted(_per_layer(data).items()) if i in new
        }


#: Attributes that split the depth: their sum is the number of layers (Dory, whose ``to_dict``
#: doubles every count: an attention and an MLP block per layer).
DEPTH_PARTS = (("n_input_layers", "n_recurrent_layers", "n_output_layers"),)


def depth_parts(data: dict[str, Any]) -> int | None:
    """Where the config splits its depth into parts: each non-empty part shrunk to at most 2
    layers, and the new depth (their sum); ``None`` where it does not."""
    for parts in DEPTH_PARTS:
        if all(isinstance(data.get(k), int) for k in parts):
            for k in parts:
                data[k] = min(data[k], 2)
            return int(sum(data[k] for k in parts))
    return None


def repeat_patterns(data: dict[str, Any], depth: int) -> None:
    """Layer patterns given as ``[[pattern, repeats], ...]`` (GPT-Neo's ``attention_types``,
    which must expand to exactly one entry per layer) cut to ``depth`` layers."""
    value = data.get("attention_types")
    if not (isinstance(value, list) and all(isinstance(v, list) and len(v) == 2 for v in value)):
        return
    expanded = [kind for pattern, repeats in value for _ in range(repeats) for kind in pattern]
    if len(expanded) >= depth:
        data["attention_types"] = [[expanded[:depth], 1]]


def remap_feature_layers(data: dict[str, Any], depth: int) -> None:
    """Non-negative vision-layer indices (``vision_feature_layer``: Molmo 2's adapter) moved into
    a tower of ``depth`` layers, keeping their order (the deepest stays the deepest)."""
    for key, value in list(data.items()):
        if isinstance(value, dict):
            remap_feature_layers(value, depth)
        elif isinstance(key, str) and "feature_layer" in key:
            indices = value if isinstance(value, list) else [value]
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
                continue
            ranked = sorted({i for i in indices if i >= 0}, reverse=True)
            moved = {old: max(0, depth - 1 - rank) for rank, old in enumerate(ranked)}
            out = [moved.get(i, i if i >= -depth else -1) for i in indices]
            data[key] = out if isinstance(value, list) else out[0]


# --------------------------------------------------------------------------- derived sizes


@dataclass(frozen=True)
class Derived:
    """``target = formula(*needs)``, set wherever a config has the target and every input.

    Attributes:
        target: The attribute derived.
        needs: The attributes it is derived from, in the formula's order.
        formula: Their relation, as the validator checks it.
        where: The architectures whose validators check it.
    """

    target: str
    needs: tuple[str, ...]
    formula: Callable[..., int]
    where: str


def _divide(a: int, b: int) -> int:
    return max(1, a // b)


DERIVED: tuple[Derived, ...] = (
    Derived(
        "num_heads",
        ("hidden_size", "expand", "head_dim"),
        lambda h, e, d: max(1, h * e // d),
        "Mamba2: hidden_size * expand == num_heads * head_dim",
    ),
    Derived(
        "qk_head_dim",
        ("qk_nope_head_dim", "qk_rope_head_dim"),
        operator.add,
        "LongCat-Flash (multi-head latent attention): qk_head_dim == nope + rope",
    ),
    Derived("d_head", ("d_model", "n_head"), _divide, "XLNet: d_head == d_model // n_head"),
)
#: Attributes that stay equal where the full-size config has them equal: (target, source).
#: LongCat-Flash's ``head_dim`` is its rotary part's.
EQUAL = (("head_dim", "qk_rope_head_dim"),)


#: Lists of sizes that sum to a size: (list, total) (Reformer's axial position embeddings).
SUMS = (("axial_pos_embds_dim", "hidden_size"),)
#: How a model's code defaults its rotary sections where the config has none:
#: ``config.rope_parameters.get("mrope_section", [16, 24, 24])`` (Qwen2-VL, GLM-4V, ERNIE-4.5-VL).
_MROPE_DEFAULT = re.compile(r'get\("mrope_section", (\[[0-9, ]+\])\)')


def code_defaults(data: dict[str, Any], config: Any) -> None:
    """The rotary sections the model's code assumes where its config has none (the checkpoints'
    configs name them; the default config does not), read from the modeling module next to the
    config's class, so that they are rescaled with the head."""
    rope = data.get("rope_parameters")
    if not isinstance(rope, dict) or "mrope_section" in rope:
        return
    module = type(config).__module__.replace(".configuration_", ".modeling_")
    try:
        source = inspect.getsource(importlib.import_module(module))
    except (ImportError, OSError, TypeError):
        return
    found = set(_MROPE_DEFAULT.findall(source))
    if len(found) == 1:
        rope["mrope_section"] = ast.literal_eval(found.pop())


def apply_derived(data: dict[str, Any], old: dict[str, Any]) -> None:
    """:data:`DERIVED`, :data:`EQUAL` and :data:`SUMS`, then the rotary dimensions that keep
    their share of the head (GPT-J, CodeGen: ``rotary_dim``)."""
    for rule in DERIVED:
        if rule.target in data and all(positive_int(data.get(k)) for k in rule.needs):
            data[rule.target] = rule.formula(*(data[k] for k in rule.needs))
    for target, source in EQUAL:
        if positive_int(old.get(target)) and old.get(target) == old.get(source):
            data[target] = data[source]
    for parts, total in SUMS:
        value = data.get(parts)
        if isinstance(value, list) and all(positive_int(v) for v in value):
            if positive_int(data.get(total)) and sum(value) != data[total]:
                data[parts] = _split(value, data[total])
    old_head, new_head = _head(old), _head(data)
    rotary = data.get("rotary_dim")
    if isinstance(rotary, int) and positive_int(rotary) and old_head and new_head:
        data["rotary_dim"] = max(2, rotary * new_head // old_head // 2 * 2)


def _head(data: dict[str, Any]) -> int | None:
    """The attention head size: ``head_dim``, else width / heads."""
    if positive_int(data.get("head_dim")):
        return int(data["head_dim"])
    width = next((data[k] for k in HIDDEN if positive_int(data.get(k))), None)
    heads = next(
        (
            data[k]
            for k in ("num_attention_heads", "n_head", "num_heads")
            if positive_int(data.get(k))
        ),
        None,
    )
    return width // heads if width and heads else None


def rescale_mrope(data: dict[str, Any], old: dict[str, Any]) -> None:
    """Multimodal rotary sections (``mrope_section``: Qwen2-VL, GLM-4V, Cosmos 3, HY-V4-VL)
    sum to half the rotary dimension: rescaled with the head size they split (``head_dim``,
    ``qk_rope_head_dim``, or width / heads, times ``partial_rotary_factor``)."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = data.get(key)
        if not isinstance(rope, dict):
            continue
        for sub in [rope, *(v for v in rope.values() if isinstance(v, dict))]:
            sections = sub.get("mrope_section")
            if isinstance(sections, list) and sections and all(positive_int(s) for s in sections):
                target = _rotary_half(data, old, sub, sum(sections))
                if target is not None:
                    sub["mrope_section"] = _split(sections, target)


def _rotary_half(
    data: dict[str, Any], old: dict[str, Any], rope: dict[str, Any], old_sum: int
) -> int | None:
    factor = rope.get("partial_rotary_factor", data.get("partial_rotary_factor")) or 1.0
    candidates = [(old.get(k), data.get(k)) for k in ("qk_rope_head_dim", "head_dim")]
    candidates.append((_head(old), _head(data)))
    for before, after in candidates:
        if not (isinstance(before, int) and isinstance(after, int)):
            continue
        if not (positive_int(before) and positive_int(after)):
            continue
        for share in (factor, 1.0):
            if int(before * share) // 2 == old_sum:
                return max(1, int(after * share) // 2)
    return None


def _split(sections: list[int], target: int) -> list[int]:
    """``sections`` scaled to sum to ``target`` (largest remainders; each at least 1 where the
    target allows; sections that were equal stay equal where the target allows: ERNIE-4.5-VL
    stacks its two spatial sections)."""
    total = sum(sections)
    floor = 1 if target >= len(sections) else 0
    spare = target - floor * len(sections)
    shares = [s * spare / total for s in sections]
    out = [floor + int(share) for share in shares]
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(sections):
        groups.setdefault(s, []).append(i)
    order = sorted(groups.values(), key=lambda g: shares[g[0]] - int(shares[g[0]]), reverse=True)
    left = target - sum(out)
    bumped: set[int] = set()
    for group in order:  # whole groups first, then one by one
        if len(group) <= left:
            bumped.update(group)
            left -= len(group)
    bumped.update([i for group in order for i in group if i not in bumped][:left])
    return [n + (i in bumped) for i, n in enumerate(out)]
