"""Model knowledge for boundary casts: modules whose outputs go back to the activation dtype
under ``boundary="auto"`` although they hold a matrix (see :mod:`fsdp_precision._policy.casts`).

``"auto"`` keeps a kept matrix's outputs in its dtype: most routers return logits that the model
takes through softmax and top-k itself, in fp32 as the kept router computed them. A router that
finishes the routing inside its own forward and returns the mixing weights that multiply the
hidden states needs them back in the activations' dtype, or the next matmul meets fp32 inputs;
nothing of the routing decision is lost by then. (A router that casts its results to its input's
dtype, ``type_as(hidden_states)``, returns fp32 after the input cast: the same case.) The screen
(``scripts/screen_hf_keep.py``, ``tests/hf/test_moe_screen.py``) finds them: every architecture
trains with ``"auto"``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.nn as nn

__all__ = ["RETURNS_ACTIVATIONS", "returns_activations"]

#: Module class name -> why its outputs are activations.
RETURNS_ACTIVATIONS: Mapping[str, str] = {
    "Llama4Router": "transformers llama4: top-k and sigmoid inside; its scores scale the "
    "hidden states the experts take",
    "JetMoeTopKGating": "transformers jetmoe: top-k and softmax inside, the gates cast to its "
    "input's dtype (type_as(hidden_states)); they scale the experts' outputs",
}


def returns_activations(module: nn.Module) -> bool:
    """Whether ``module``'s outputs go back to the activation dtype under ``"auto"``."""
    return type(module).__name__ in RETURNS_ACTIVATIONS
