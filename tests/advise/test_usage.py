"""A traced forward (the plan's topmost-unit trace, the advisor's) leaves the model as it found
it: bitsandbytes' 4-bit layers repack their weight in place for their AVX-512-BF16 CPU kernel at
an eval-mode no-grad forward, which FSDP's sharding of the original codes then contradicts (on
such CPUs the trace a plan runs broke QLoRA: ``tests/integrations/test_qlora.py``)."""

from __future__ import annotations

import pytest
import torch

from fsdp_precision._advise.usage import quiet_forward

bnb = pytest.importorskip(
    "bitsandbytes", reason="bitsandbytes is not installed (pip install '.[peft]')"
)
bf16 = torch.bfloat16


def four_bit() -> torch.nn.Module:
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(
        64, 64, bias=False, compute_dtype=bf16, quant_type="nf4", quant_storage=torch.float16
    )
    layer.load_state_dict({"weight": torch.randn(64, 64)})
    layer = layer.to("cpu")  # quantizes: packed codes, shape (numel / 2 / itemsize, 1)
    layer.support_avx512bf16_for_cpu = True  # as on an AVX-512-BF16 CPU, whatever this one is
    return layer


def test_a_traced_forward_does_not_repack_4bit_weights() -> None:
    layer = four_bit()
    codes = layer.weight.detach().clone()
    with quiet_forward(layer):
        layer(torch.randn(2, 64, dtype=bf16))
    bits = layer.weight.detach().view(torch.int16)  # codes, not numbers: NaN patterns included
    assert bits.shape == codes.shape and torch.equal(bits, codes.view(torch.int16))
    assert layer.support_avx512bf16_for_cpu is True  # restored


def test_negative_control_the_same_forward_unguarded_repacks_them() -> None:
    layer = four_bit().eval()
    shape = tuple(layer.weight.shape)
    with torch.no_grad():
        try:
            layer(torch.randn(2, 64, dtype=bf16))
        except RuntimeError:  # the packed kernel itself may need that CPU; the repack came first
            pass
    assert tuple(layer.weight.shape) != shape
