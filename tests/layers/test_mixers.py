"""Invariants every registered mixer keeps at layer level:
prefill + token-by-token decoding equals the full forward, a packed varlen batch equals
the padded batch, left padding does not change the real tokens, gradients flow."""

from __future__ import annotations

import pytest
import torch

from linmem.layers import LayerState, MixerArgs, build_mixer, mixer_names

D, H = 32, 2
TOL = 1e-4


def make(name: str, **over) -> torch.nn.Module:
    torch.manual_seed(0)
    args = MixerArgs(hidden_size=D, num_heads=H, window=5, **over)
    return build_mixer(name, args).eval()


def max_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


@pytest.mark.parametrize("name", mixer_names())
def test_prefill_then_decode_equals_forward(name):
    m = make(name)
    x = torch.randn(2, 13, D)
    with torch.no_grad():
        full = m(x)
        cache = LayerState()
        parts = [m(x[:, :6], cache=cache)]
        parts += [m(x[:, t : t + 1], cache=cache) for t in range(6, 13)]
    assert max_err(torch.cat(parts, 1), full) < TOL


@pytest.mark.parametrize("name", mixer_names())
def test_chunked_prefill_equals_forward(name):
    m = make(name)
    x = torch.randn(1, 20, D)
    with torch.no_grad():
        full = m(x)
        cache = LayerState()
        parts = [m(x[:, :7], cache=cache), m(x[:, 7:15], cache=cache), m(x[:, 15:], cache=cache)]
    assert max_err(torch.cat(parts, 1), full) < TOL


@pytest.mark.parametrize("name", mixer_names())
def test_varlen_equals_separate_sequences(name):
    m = make(name)
    lengths = [9, 3, 14]
    xs = [torch.randn(1, n, D) for n in lengths]
    cu = torch.tensor([0, 9, 12, 26])
    with torch.no_grad():
        packed = m(torch.cat(xs, 1), cu_seqlens=cu)
        for i, x in enumerate(xs):
            assert max_err(packed[:, cu[i] : cu[i + 1]], m(x)) < TOL, f"sequence {i}"


@pytest.mark.parametrize("name", mixer_names())
def test_left_padding_leaves_real_tokens_unchanged(name):
    m = make(name)
    x = torch.randn(2, 10, D)
    T = 13
    xp = torch.zeros(2, T, D)
    mask = torch.zeros(2, T, dtype=torch.bool)
    positions = torch.zeros(2, T, dtype=torch.long)
    for i in range(2):
        n = 10 if i == 0 else 13
        src = x[i] if i == 0 else torch.cat([x[i], torch.randn(3, D)])
        xp[i, T - n :] = src
        mask[i, T - n :] = True
        positions[i, T - n :] = torch.arange(n)
    with torch.no_grad():
        out = m(xp, token_mask=mask, position_ids=positions)
        ref0 = m(x[:1])
        cache = LayerState()
        pre = m(xp[:, :8], cache=cache, token_mask=mask[:, :8], position_ids=positions[:, :8])
        dec = [m(xp[:, t : t + 1], cache=cache, token_mask=mask[:, t : t + 1], position_ids=positions[:, t : t + 1])
               for t in range(8, T)]
    assert max_err(out[:1, 3:], ref0) < TOL
    assert max_err(torch.cat([pre] + dec, 1)[mask], out[mask]) < TOL


@pytest.mark.parametrize("name", mixer_names())
def test_gradients_reach_every_parameter(name):
    m = make(name).train()
    x = torch.randn(2, 9, D, requires_grad=True)
    m(x).square().mean().backward()
    assert torch.isfinite(x.grad).all()
    missing = [n for n, p in m.named_parameters() if p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"


@pytest.mark.parametrize("name", mixer_names("memory"))
def test_memory_state_does_not_grow(name):
    m = make(name)
    cache = LayerState()
    with torch.no_grad():
        m(torch.randn(1, 4, D), cache=cache)
        size = cache.nbytes()
        for _ in range(20):
            m(torch.randn(1, 1, D), cache=cache)
    assert cache.nbytes() == size


def test_unknown_mixer_lists_valid_names():
    with pytest.raises(ValueError, match="gated_deltanet"):
        build_mixer("nope", MixerArgs(hidden_size=D, num_heads=H))
