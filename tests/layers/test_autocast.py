"""Every mixer runs under bf16 autocast (as the trainer uses it on GPU) and stays close to fp32:
inside a mixer some activations leave autocast in fp32, and the op needs one dtype."""

import pytest
import torch

from linmem.layers import MixerArgs, build_mixer, mixer_names


@pytest.mark.parametrize("name", mixer_names())
def test_mixer_under_bf16_autocast(name):
    torch.manual_seed(0)
    mixer = build_mixer(name, MixerArgs(hidden_size=32, num_heads=2, window=5))
    x = torch.randn(2, 12, 32, requires_grad=True)
    reference = mixer(x).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mixer(x)
    out.float().square().mean().backward()
    assert torch.isfinite(out.float()).all() and torch.isfinite(x.grad).all()
    out = out.detach()
    scale = reference.abs().max().clamp_min(1e-3)
    assert float((out.float() - reference).abs().max() / scale) < 0.1, "bf16 autocast far from fp32"
