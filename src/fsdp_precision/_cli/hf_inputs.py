"""The inputs ``verify`` and ``plan`` give a transformers model: token ids, labels, and the
other arguments its forward needs, built from its config.

Token ids are drawn from the text vocabulary without the config's special tokens (an image
token drawn at random would ask for image features that are not there). Encoder-decoder models
get their decoder inputs as the labels shifted right behind the decoder start token (FSMT would
otherwise take them from ``input_ids``, of another length). Other arguments are built by name
(:data:`BUILDERS`) where the forward requires them, or where a model's code requires what its
signature leaves optional (:data:`NEEDS`): per-architecture differences are data.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

__all__ = [
    "BATCH",
    "BUILDERS",
    "DECODER_SEQ",
    "NEEDS",
    "SEQ",
    "adds_to",
    "transformers_inputs",
]

#: ``input_ids`` of shape ``(BATCH, SEQ)``; decoder labels of ``(BATCH, DECODER_SEQ)``.
BATCH, SEQ, DECODER_SEQ = 2, 8, 6


def _config_with(config: Any, attribute: str) -> Any:
    """``config``'s text config, else the first config of its tree, that has ``attribute``."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for candidate in (text, config, *_sub_configs(config)):
        if isinstance(getattr(candidate, attribute, None), int):
            return candidate
    return None


def _sub_configs(config: Any) -> list[Any]:
    found = []
    for key, value in vars(config).items():  # vars(): per-layer attributes are not read
        if hasattr(value, "to_dict") and not key.startswith("_"):
            found += [value, *_sub_configs(value)]
    return found


def _special_ids(config: Any) -> set[int]:
    """Every token id the config tree names (``image_token_id``, ``pad_token_id``, ...)."""
    found: set[int] = set()
    for c in (config, *_sub_configs(config)):
        for key, value in vars(c).items():
            if not key.endswith(("token_id", "token_index", "token_ids")):
                continue
            for v in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(v, int) and not isinstance(v, bool):
                    found.add(v)
    return found


def _ids(config: Any, vocab: int, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    keep = torch.ones(vocab, dtype=torch.bool)
    keep[[i for i in _special_ids(config) if 0 <= i < vocab]] = False
    allowed = keep.nonzero().flatten() if keep.any() else torch.zeros(1, dtype=torch.long)
    return allowed[torch.randint(0, len(allowed), shape, generator=g)]


#: Model types whose pixel values hold a list of images (or video frames) per sample: one.
PER_SAMPLE_IMAGES = frozenset({"idefics", "pi0", "instructblipvideo"})


def _pixel_values(config: Any, g: torch.Generator) -> torch.Tensor:
    vision = getattr(config, "vision_config", None) or config
    size = getattr(vision, "image_size", 224)
    height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
    channels = getattr(vision, "num_channels", 3)
    images = (1,) if getattr(config, "model_type", "") in PER_SAMPLE_IMAGES else ()
    return torch.randn(BATCH, *images, channels, height, width, generator=g)


def _flattened_patches(config: Any, g: torch.Generator) -> torch.Tensor:
    """Pix2Struct's patches: row and column index, then the flattened pixels, per patch."""
    vision = config.vision_config
    patches = 16
    rows = torch.randint(0, min(int(vision.seq_len), patches), (BATCH, patches, 2), generator=g)
    pixels = torch.randn(BATCH, patches, int(vision.patch_embed_hidden_size), generator=g)
    return torch.cat([rows.float(), pixels], dim=-1)


def _ones_mask(config: Any, g: torch.Generator) -> torch.Tensor:
    """IDEFICS's image attention mask: every token sees the sample's one image."""
    return torch.ones(BATCH, SEQ, 1, dtype=torch.long)


def _camera_mask(config: Any, g: torch.Generator) -> torch.Tensor:
    return torch.ones(BATCH, 1, dtype=torch.bool)  # PI0: one camera, present


def _robot_state(config: Any, g: torch.Generator) -> torch.Tensor:
    return torch.randn(BATCH, int(config.max_state_dim), generator=g)


def _actions(config: Any, g: torch.Generator) -> torch.Tensor:
    """PI0's action chunk: the flow-matching target (its labels)."""
    shape = (BATCH, int(config.chunk_size), int(config.max_action_dim))
    return torch.randn(*shape, generator=g)


def _audio_features(config: Any, g: torch.Generator) -> torch.Tensor:
    """Log-mel features ``(batch, mel bins, frames)``."""
    mels = int(config.audio_config.num_mel_bins)
    return torch.randn(BATCH, mels, 8 * SEQ, generator=g)


def _image_positions(config: Any, g: torch.Generator) -> torch.Tensor:
    """Kosmos-2: where the image's latent queries replace tokens (after the first token)."""
    queries = int(config.latent_query_num)
    if queries > SEQ - 1:
        raise ValueError(f"{queries} latent queries do not fit in {SEQ} tokens")
    mask = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    mask[:, 1 : 1 + queries] = True
    return mask


def _qformer_ids(config: Any, g: torch.Generator) -> torch.Tensor:
    qformer = getattr(config, "qformer_config", config)
    return torch.randint(0, int(qformer.vocab_size), (BATCH, SEQ), generator=g)


def _bbox(config: Any, g: torch.Generator) -> torch.Tensor:
    """Normalised boxes ``(x0, y0, x1, y1)`` in 0..1 with ``x0 <= x1``, ``y0 <= y1`` (UDOP)."""
    corners = torch.rand(BATCH, SEQ, 2, 2, generator=g).sort(dim=2).values  # (min, max) x (x, y)
    return corners.reshape(BATCH, SEQ, 4)


def _lang_ids(config: Any, g: torch.Generator) -> torch.Tensor:
    return torch.zeros(BATCH, dtype=torch.long)  # X-MOD: the first language's adapters


def _token_types(config: Any, g: torch.Generator) -> torch.Tensor:
    return torch.zeros(BATCH, SEQ, dtype=torch.long)  # Molmo 2: every token is text


#: Forward arguments built from the config, by name.
BUILDERS: dict[str, Callable[[Any, torch.Generator], torch.Tensor]] = {
    "pixel_values": _pixel_values,
    "flattened_patches": _flattened_patches,
    "image_attention_mask": _ones_mask,
    "pixel_attention_mask": _camera_mask,
    "state": _robot_state,
    "actions": _actions,
    "input_features": _audio_features,
    "image_embeds_position_mask": _image_positions,
    "qformer_input_ids": _qformer_ids,
    "bbox": _bbox,
    "lang_ids": _lang_ids,
    "mm_token_type_ids": _token_types,
}
#: Arguments a model's code requires though its forward's signature leaves them optional:
#: model type -> names.
NEEDS: dict[str, tuple[str, ...]] = {
    "blip": ("pixel_values",),  # "You have to specify pixel_values"
    "kosmos-2": ("pixel_values", "image_embeds_position_mask"),  # "... or `image_embeds`"
    "idefics": ("pixel_values", "image_attention_mask"),  # "Exactly 1 of pixel_values, ..."
    "pi0": ("pixel_values", "pixel_attention_mask", "actions"),  # the images, the loss target
    "voxtral_realtime": ("input_features",),  # "exactly one of input_features or ..."
    "pix2struct": ("flattened_patches",),  # "You have to specify flattened_patches"
    "vision-encoder-decoder": ("pixel_values",),  # "You have to specify pixel_values"
    "git": ("pixel_values",),  # its loss skips the image tokens: without them, no logits
    "udop": ("bbox",),  # "Bbox is required for horizontal relative position bias"
    "xmod": ("lang_ids",),  # "Input language unknown"
    "molmo2": ("mm_token_type_ids",),  # "required as a model input when training"
    "pp_formulanet": ("pixel_values",),  # "exactly one of encoder_outputs or pixel_values"
}


def transformers_inputs(spec: str, model: nn.Module, generator: torch.Generator) -> dict[str, Any]:
    """Forward keyword arguments for a transformers ``model`` (the same on every rank for one
    generator seed). ``ValueError`` where its config names no vocabulary."""
    config: Any = model.config
    text = _config_with(config, "vocab_size")
    if text is None:
        raise ValueError(
            f"MODEL {spec!r}: verify cannot make inputs for {type(model).__name__}: its config "
            "names no vocab_size; wrap it in a module:callable factory whose model has "
            "example_inputs(generator) -> dict"
        )
    vocab = int(text.vocab_size)
    params = inspect.signature(model.forward).parameters
    ids = _ids(config, vocab, (BATCH, SEQ), generator)
    out: dict[str, Any] = {"input_ids": ids} if "input_ids" in params else {}
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    if "labels" in params:
        labels = _ids(config, vocab, (BATCH, DECODER_SEQ), generator) if encoder_decoder else ids
        out["labels"] = labels
        if encoder_decoder and "decoder_input_ids" in params:
            start = _decoder_start(config)
            out["decoder_input_ids"] = torch.cat(
                [torch.full((BATCH, 1), start, dtype=labels.dtype), labels[:, :-1]], dim=1
            )
    required = [n for n, p in params.items() if p.default is inspect.Parameter.empty]
    for name in [*required, *NEEDS.get(str(getattr(config, "model_type", "")), ())]:
        if name in BUILDERS and name not in out:
            try:
                out[name] = BUILDERS[name](config, generator)
            except (AttributeError, TypeError, ValueError) as exc:  # a config of another shape
                raise ValueError(
                    f"MODEL {spec!r}: verify cannot make {name} for {type(model).__name__} from "
                    f"its config ({type(exc).__name__}: {exc})"
                ) from exc
    return out


def _decoder_start(config: Any) -> int:
    for c in (config, getattr(config, "decoder", None)):
        for key in ("decoder_start_token_id", "pad_token_id", "bos_token_id"):
            value = getattr(c, key, None) if c is not None else None
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return 0


def adds_to(inputs: Any, dummy: Any) -> bool:
    """Whether ``inputs`` hold an argument (other than ``labels``) that a model's own
    ``dummy_inputs`` lack: pixel values, boxes, or the decoder inputs of an encoder-decoder
    model whose dummy inputs feed only its encoder."""
    if not isinstance(inputs, dict) or not isinstance(dummy, dict):
        return False
    return bool(set(inputs) - set(dummy) - {"labels"})
