"""Linear attention (all feature maps), RetNet retention, Lightning attention, GLA and HGRN-2:
each layer's formula against an explicit computation, plus decoding and padding invariants for
the options the shared mixer tests do not build (feature maps, short convolutions, depth)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

from linmem.layers import LayerState, MixerArgs, build_mixer
from linmem.layers.hgrn2 import hgrn2_log_forget
from linmem.layers.linear_attention import DENOMINATOR_EPS, FEATURE_MAPS, FeatureMap
from linmem.layers.retention import alibi_slopes, lightning_log_decay, retnet_log_decay

D, H = 32, 2
TOL = 1e-4


def make(name: str, **over) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_mixer(name, MixerArgs(hidden_size=D, num_heads=H, **over)).eval()


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def heads(x: torch.Tensor) -> torch.Tensor:
    return rearrange(x, "b t (h d) -> b t h d", h=H)


def decode_matches_forward(m: torch.nn.Module, T: int = 11, split: int = 5) -> float:
    x = torch.randn(2, T, D)
    with torch.no_grad():
        full = m(x)
        cache = LayerState()
        parts = [m(x[:, :split], cache=cache)] + [m(x[:, t : t + 1], cache=cache) for t in range(split, T)]
    return max_err(torch.cat(parts, 1), full)


# ---------------------------------------------------------------- feature maps


def test_elementwise_feature_maps_follow_their_formulas():
    x = torch.randn(3, 5, 2, 8)
    assert torch.equal(FeatureMap("identity", 8)(x), x)
    assert torch.allclose(FeatureMap("elu", 8)(x), torch.where(x > 0, x + 1, torch.exp(x)))
    assert torch.equal(FeatureMap("relu", 8)(x), x.clamp_min(0))
    p = FeatureMap("softmax", 8)(x)
    assert torch.allclose(p, torch.exp(x) / torch.exp(x).sum(-1, keepdim=True))
    assert torch.allclose(p.sum(-1), torch.ones(3, 5, 2))


def test_based_features_give_the_taylor_expansion_of_exp():
    d = 16
    phi = FeatureMap("based", d)
    q, k = torch.randn(100, d, dtype=torch.float64), torch.randn(100, d, dtype=torch.float64)
    s = (q * k).sum(-1) / math.sqrt(d)
    assert phi(q).shape == (100, 1 + d + d * d) and phi.feature_dim == 1 + d + d * d
    assert torch.allclose((phi(q) * phi(k)).sum(-1), 1 + s + s**2 / 2, rtol=1e-12, atol=1e-12)
    # near 0 it approximates exp(q . k / sqrt(d)) to third order
    small = (phi(q * 1e-2) * phi(k * 1e-2)).sum(-1)
    assert torch.allclose(small, torch.exp(s * 1e-4), atol=1e-11)


def test_rebased_features_square_the_affine_normalised_dot_product():
    d = 16
    phi = FeatureMap("rebased", d).double()
    with torch.no_grad():
        phi.norm.weight.uniform_(0.5, 2.0)  # gamma
        phi.norm.bias.normal_()  # beta
    q, k = torch.randn(50, d, dtype=torch.float64), torch.randn(50, d, dtype=torch.float64)
    affine = lambda x: (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-6) \
        * phi.norm.weight + phi.norm.bias  # noqa: E731
    expected = (affine(q) * affine(k)).sum(-1) ** 2 / d
    assert torch.allclose((phi(q) * phi(k)).sum(-1), expected, rtol=1e-10)
    assert phi.feature_dim == d * d


def test_unknown_feature_map_lists_the_valid_ones():
    with pytest.raises(ValueError, match="rebased") as info:
        make("linear_attention", feature_map="cosine")
    assert all(name in str(info.value) for name in FEATURE_MAPS)


def test_default_feature_map_is_elu():
    assert make("linear_attention").feature_map.name == "elu"


# ---------------------------------------------------------------- linear attention


def explicit_linear_attention(m, x: torch.Tensor) -> torch.Tensor:
    """sum_{s<=t} phi(q_t).phi(k_s) v_s / (sum_{s<=t} phi(q_t).phi(k_s) + eps), then o_proj."""
    q, k, v = heads(m.q_proj(x)), heads(m.k_proj(x)), heads(m.v_proj(x))
    q, k = m.feature_map(q), m.feature_map(k)
    T = x.shape[1]
    scores = torch.einsum("bthk,bshk->bhts", q, k) * torch.ones(T, T).tril()  # [B, H, T, S]
    o = torch.einsum("bhts,bshv->bthv", scores, v) / (scores.sum(-1).transpose(1, 2)[..., None] + DENOMINATOR_EPS)
    return m.o_proj(rearrange(o, "b t h d -> b t (h d)"))


@pytest.mark.parametrize("feature_map", [f for f in FEATURE_MAPS if f != "identity"])
def test_normalised_linear_attention_equals_explicit_causal_sum(feature_map):
    m = make("linear_attention", feature_map=feature_map)
    if feature_map == "rebased":
        with torch.no_grad():
            m.feature_map.norm.weight.uniform_(0.5, 2.0)
            m.feature_map.norm.bias.normal_()
    x = torch.randn(2, 17, D)
    with torch.no_grad():
        assert max_err(m(x), explicit_linear_attention(m, x)) < TOL


def test_identity_linear_attention_is_unnormalised_and_rms_normed():
    m = make("linear_attention", feature_map="identity")
    x = torch.randn(2, 17, D)
    with torch.no_grad():
        q, k, v = heads(m.q_proj(x)), heads(m.k_proj(x)), heads(m.v_proj(x))
        scores = torch.einsum("bthk,bshk->bhts", q, k) * torch.ones(17, 17).tril() / math.sqrt(q.shape[-1])
        o = m.o_norm(torch.einsum("bhts,bshv->bthv", scores, v))
        assert max_err(m(x), m.o_proj(rearrange(o, "b t h d -> b t (h d)"))) < TOL


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_every_feature_map_decodes_like_the_forward(feature_map):
    assert decode_matches_forward(make("linear_attention", feature_map=feature_map)) < TOL


@pytest.mark.parametrize("feature_map", ["based", "rebased"])
def test_based_key_dim_is_the_expanded_feature_dim(feature_map):
    m = make("linear_attention", feature_map=feature_map)
    args = m.recurrence_inputs(torch.randn(1, 3, D), cache=None, cu_seqlens=None)
    K = {"based": 1 + 16 + 256, "rebased": 256}[feature_map]
    assert args.q.shape == args.k.shape == (1, 3, H, K)
    assert args.v.shape == (1, 3, H, D // H + 1)  # the ones column carries the normaliser


# ---------------------------------------------------------------- retention and lightning


def test_retention_decays_follow_retnet():
    for n in (1, 2, 8):
        expected = torch.tensor([math.log(1 - 2 ** (-5 - h)) for h in range(n)])
        g = retnet_log_decay(n)
        assert g.dtype == torch.float32 and g.shape == (n,)
        assert torch.allclose(g, expected, rtol=1e-6)
    args = make("retention").recurrence_inputs(torch.randn(1, 4, D), cache=None, cu_seqlens=None)
    assert torch.equal(args.log_decay, retnet_log_decay(H))


def test_retention_equals_its_parallel_form():
    """o = (Q K^T ⊙ D) V / sqrt(K), D_ts = gamma^(t-s), on rotated q, k; then gated norm and W_o."""
    m = make("retention")
    x = torch.randn(2, 15, D)
    with torch.no_grad():
        pos = torch.arange(15).expand(2, 15)
        q, k = m.rotary(heads(m.q_proj(x)), pos), m.rotary(heads(m.k_proj(x)), pos)
        v = heads(m.v_proj(x))
        t = torch.arange(15)
        gamma = 1 - 2.0 ** (-5 - torch.arange(H))
        decay = torch.where(t[:, None] >= t[None, :], gamma[:, None, None] ** (t[:, None] - t[None, :]), 0.0)
        o = torch.einsum("bthk,bshk,hts,bshv->bthv", q, k, decay, v) / math.sqrt(q.shape[-1])
        o = m.o_norm(o, heads(m.g_proj(x)))
        assert max_err(m(x), m.o_proj(rearrange(o, "b t h d -> b t (h d)"))) < TOL


def test_alibi_slopes():
    assert torch.allclose(alibi_slopes(8), 2.0 ** -torch.arange(1.0, 9.0))
    assert torch.allclose(alibi_slopes(4), 2.0 ** (-2 * torch.arange(1.0, 5.0)))
    # 6 heads: the 4-head series, then the odd slopes of the 8-head series
    assert torch.allclose(alibi_slopes(6), torch.tensor([2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]))


def test_lightning_decays_scale_with_depth():
    L = 4
    slopes = alibi_slopes(8)
    for l in range(L):
        assert torch.allclose(lightning_log_decay(8, l, L), -slopes * (1 - l / (L - 1) + 1e-5))
    assert torch.allclose(lightning_log_decay(8, 0, 1), -slopes * (1 + 1e-5))  # a one-layer stack
    last = lightning_log_decay(8, L - 1, L)
    assert (last < 0).all() and (last > -1e-5).all()  # decays approach but never reach 1
    m = make("lightning", layer_idx=2, num_layers=L)
    assert torch.equal(m.recurrence_inputs(torch.randn(1, 3, D), cache=None, cu_seqlens=None).log_decay,
                       lightning_log_decay(H, 2, L))


def test_lightning_equals_its_parallel_form():
    """o = (silu(Q) silu(K)^T ⊙ M) V with M_ts = exp(-m_h (t - s)), then RMSNorm(o) * U and W_o."""
    m = make("lightning")
    x = torch.randn(2, 15, D)
    with torch.no_grad():
        q, k, v = F.silu(heads(m.q_proj(x))), F.silu(heads(m.k_proj(x))), heads(m.v_proj(x))
        t = torch.arange(15.0)
        lag = (t[:, None] - t[None, :])
        decay = torch.exp(lightning_log_decay(H, 0, 1)[:, None, None] * lag).tril()
        o = torch.einsum("bthk,bshk,hts,bshv->bthv", q, k, decay, v)
        expected = m.o_proj(m.o_norm(rearrange(o, "b t h d -> b t (h d)")) * m.g_proj(x))
        assert max_err(m(x), expected) < TOL


def test_retention_positions_continue_across_calls():
    m = make("retention")
    cache = LayerState()
    with torch.no_grad():
        m(torch.randn(3, 4, D), cache=cache)
        m(torch.randn(3, 1, D), cache=cache)
    assert cache.get("position").tolist() == [5, 5, 5]


# ---------------------------------------------------------------- GLA


def test_gla_log_decay_is_a_scaled_logsigmoid_per_key_channel():
    m = make("gla")
    x = torch.randn(2, 9, D)
    with torch.no_grad():
        m.gk_proj[1].bias.normal_(0, 20)  # push some gates to saturation
        g = m.recurrence_inputs(x, cache=None, cu_seqlens=None).log_decay
        K = D // H
        assert g.shape == (2, 9, H, K) and g.dtype == torch.float32
        assert torch.allclose(g, heads(F.logsigmoid(m.gk_proj(x).float())) / 16)
    assert (g <= 0).all() and (g > -100 / 16).all()
    assert m.gk_proj[0].out_features == 16  # the paper's rank


def test_gla_initialisation_and_low_rank_option():
    m = make("gla", gate_low_rank=4)
    assert m.gk_proj[0].out_features == 4
    assert torch.equal(m.gk_proj[1].bias, torch.zeros_like(m.gk_proj[1].bias))
    bound = 2**-2.5 * math.sqrt(6 / (D + D))  # xavier-uniform bound of a D x D weight
    assert m.q_proj.weight.abs().max() <= bound


def test_gla_output_is_gated_rms_norm():
    m = make("gla")
    x = torch.randn(1, 6, D)
    with torch.no_grad():
        args = m.recurrence_inputs(x, cache=None, cu_seqlens=None)
        o = torch.randn(1, 6, H, D // H)
        rms = o / o.pow(2).mean(-1, keepdim=True).add(m.o_norm.eps).sqrt()
        expected = m.o_proj(rearrange(rms * F.silu(heads(m.g_proj(x))), "b t h d -> b t (h d)"))
        assert max_err(m.output(o, x, args), expected) < TOL


# ---------------------------------------------------------------- HGRN-2


def test_hgrn2_keys_are_one_minus_forget():
    for layer in (0, 2):
        m = make("hgrn2", layer_idx=layer, num_layers=4)
        x = torch.randn(2, 7, D)
        with torch.no_grad():
            args = m.recurrence_inputs(x, cache=None, cu_seqlens=None)
            f = torch.exp(args.log_decay)
            assert args.log_decay.shape == (2, 7, H, D // H) and args.log_decay.dtype == torch.float32
            assert torch.allclose(args.k, 1 - f, atol=1e-6)
            lb = layer / 4
            assert torch.allclose(f, lb + (1 - lb) * torch.sigmoid(heads(m.f_proj(x))), atol=1e-6)
            assert (f >= lb).all()


def test_hgrn2_first_layer_is_an_exact_logsigmoid_even_when_saturated():
    logits = torch.tensor([-200.0, -30.0, 0.0, 30.0])
    assert torch.equal(hgrn2_log_forget(logits, 0.0), F.logsigmoid(logits))
    assert torch.isfinite(hgrn2_log_forget(logits, 0.0)).all()
    assert torch.allclose(hgrn2_log_forget(logits, 0.5).exp(), 0.5 + 0.5 * torch.sigmoid(logits))


def test_hgrn2_matches_an_explicit_loop():
    m = make("hgrn2", layer_idx=1, num_layers=3)
    x = torch.randn(1, 8, D)
    with torch.no_grad():
        q = F.silu(heads(m.q_proj(x)))[0]
        f = (1 / 3 + 2 / 3 * torch.sigmoid(heads(m.f_proj(x))))[0]
        i = heads(m.i_proj(x))[0]
        S = torch.zeros(H, D // H, D // H)
        outs = []
        for t in range(8):
            S = f[t][..., None] * S + (1 - f[t])[..., None] * i[t][:, None, :]
            outs.append(torch.einsum("hk,hkv->hv", q[t], S))
        o = rearrange(torch.stack(outs), "t h v -> 1 t (h v)")
        assert max_err(m(x), m.o_proj(m.o_norm(o))) < TOL


# ---------------------------------------------------------------- options of all five


@pytest.mark.parametrize("name", ["linear_attention", "retention", "lightning", "gla", "hgrn2"])
def test_short_convolution_option_decodes_and_packs(name):
    m = make(name, use_short_conv=True)
    assert len(m.convs) > 0
    assert decode_matches_forward(m) < TOL
    xs = [torch.randn(1, n, D) for n in (5, 2, 8)]
    cu = torch.tensor([0, 5, 7, 15])
    with torch.no_grad():
        packed = m(torch.cat(xs, 1), cu_seqlens=cu)
        for j, x in enumerate(xs):
            assert max_err(packed[:, cu[j] : cu[j + 1]], m(x)) < TOL


@pytest.mark.parametrize("name", ["lightning", "hgrn2"])
def test_deep_layers_decode_like_the_forward(name):
    assert decode_matches_forward(make(name, layer_idx=5, num_layers=6)) < TOL


@pytest.mark.parametrize("name", ["linear_attention", "retention", "lightning", "gla", "hgrn2"])
def test_long_sequences_stay_finite_with_gradients(name):
    m = make(name).train()
    x = torch.randn(1, 512, D, requires_grad=True)
    m(x).square().mean().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())
