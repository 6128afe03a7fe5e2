"""A consumer of a weight stream that does what an inference engine's ``load_weights`` does.

vLLM and SGLang take ``(name, tensor)`` pairs in Hugging Face checkpoint names, map per-expert
tensors into their fused expert parameters (``make_expert_params_mapping``), and end every load in
``param.copy_(tensor)``, which rounds silently to the parameter's dtype; parameters they allocate
in fp32 (routers, in some models) keep fp32. This consumer is a Hugging Face Qwen3-MoE in bf16
(transformers 5 fuses its experts) that does the same: per-expert names into the fused tensors,
``copy_`` for everything, and the parameters the stream keeps allocated in their kept dtype.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch
import torch.nn as nn

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def load_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], kept: Mapping[str, torch.dtype]
) -> set[str]:
    """Load ``weights`` into ``model`` as an engine does; return the names loaded.

    ``kept``: name -> dtype of what the stream keeps (its ``kept`` metadata): those parameters
    are allocated in that dtype first, as an engine that allocates a router in fp32 does."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            match = _EXPERT.match(name)
            if match is None:
                param = params[name]  # an unknown name is an error, as in vLLM
                if name in kept and param.dtype != kept[name]:
                    param.data = torch.empty_like(param, dtype=kept[name])
                param.copy_(tensor)
            else:
                experts, index, which = match.group(1), int(match.group(2)), match.group(3)
                if which == "down_proj":
                    params[f"{experts}.down_proj"][index].copy_(tensor)
                else:
                    fused = params[f"{experts}.gate_up_proj"][index]
                    half = fused.shape[0] // 2
                    part = fused[:half] if which == "gate_proj" else fused[half:]
                    part.copy_(tensor)
            loaded.add(name)
    return loaded
