"""Mamba-2, RWKV-6, RWKV-7 and KDA against their papers' own formulas.

Each mixer (with random weights, so nothing cancels at init) must equal an independent
computation written in the paper's convention: the quadratic SSD form for Mamba-2,
the token loops of RWKV-6 and RWKV-7 with the state as [V, K] (keys on the right,
the RWKV reference convention), KDA's token loop with the state as [K, V]. The RWKV-7 loop
builds the transition matrix ``diag(w) - kappa^T (a * kappa)`` explicitly, so it checks the
mapping onto the op's a, b.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from linmem.layers import LayerState, MixerArgs, build_mixer
from tests.helpers import rel_err

D, H = 32, 2
NAMES = ("mamba2", "rwkv6", "rwkv7", "kda")


def make(name: str, seed: int = 0, noise: float = 0.3, **over) -> torch.nn.Module:
    """A mixer whose every parameter is moved off its init (zero output projections included)."""
    torch.manual_seed(seed)
    m = build_mixer(name, MixerArgs(hidden_size=D, num_heads=H, **over))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(noise * torch.randn_like(p))
    return m.eval()


def shifted(x: torch.Tensor) -> torch.Tensor:
    """x_{t-1} with zeros before the start: [B, T, C]."""
    return F.pad(x, (0, 0, 1, -1))


def lora(l, x: torch.Tensor, act=torch.tanh) -> torch.Tensor:
    h = x @ l.A
    h = act(h) if act is not None else h
    return h @ l.B + (0 if l.bias is None else l.bias)


def group_norm(m, y: torch.Tensor) -> torch.Tensor:
    """y: [B, T, H, V] -> per-head LayerNorm, [B, T, H * V]."""
    B, T = y.shape[:2]
    out = F.group_norm(y.reshape(B * T, -1), H, m.norm.weight, m.norm.bias, m.norm.eps)
    return out.view(B, T, -1)


# ----------------------------------------------------------------------------- Mamba-2


def mamba2_ssd(m, h: torch.Tensor) -> torch.Tensor:
    """Mamba-2 from its quadratic (attention-like) SSD form, ngroups = 1."""
    args = m.args
    N, P = args.key_dim, args.value_dim
    Bsz, T, _ = h.shape
    z, xBC, dt = m.in_proj(h).split([H * P, H * P + 2 * N, H], dim=-1)
    width = m.conv.weight.shape[1]
    xBC = F.conv1d(F.pad(xBC.transpose(1, 2), (width - 1, 0)), m.conv.weight[:, None, :], m.conv.bias,
                   groups=xBC.shape[-1])
    x, Bm, Cm = F.silu(xBC.transpose(1, 2)).split([H * P, N, N], dim=-1)
    x = x.view(Bsz, T, H, P)
    dt = F.softplus(dt + m.dt_bias)  # [B, T, H]
    dA = -torch.exp(m.A_log) * dt
    cum = dA.cumsum(1)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, :, :, None]  # [1, t, s, 1]
    segsum = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, -math.inf)  # sum_{s<r<=t} dA_r
    scores = torch.einsum("btn,bsn->bts", Cm, Bm)  # C_t . B_s
    y = torch.einsum("bts,btsh,bsh,bshp->bthp", scores, segsum.exp(), dt, x) + m.D[:, None] * x
    y = y.reshape(Bsz, T, H * P) * F.silu(z)  # gate, then RMSNorm over the inner width
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + m.norm.eps) * m.norm.weight
    return m.out_proj(y)


@pytest.mark.parametrize("expand_v", [1.0, 2.0])
def test_mamba2_equals_explicit_ssd(expand_v):
    m = make("mamba2", expand_v=expand_v).double()
    h = torch.randn(2, 19, D, dtype=torch.float64)
    with torch.no_grad():  # the shared RMSNorm normalises in fp32, hence not 1e-10
        assert rel_err(m(h), mamba2_ssd(m, h)) < 1e-6


# ----------------------------------------------------------------------------- RWKV-6


def rwkv6_loop(m, x: torch.Tensor) -> torch.Tensor:
    """RWKV-6 time mixing token by token, the state as [V, K] (as in the RWKV-6 CUDA kernel)."""
    B, T, _ = x.shape
    K, V = m.args.key_dim, m.args.value_dim
    dx = shifted(x) - x
    xx = x + dx * m.mu_x
    xw, xk, xv, xr, xg = (x + dx * lora(m.mix[n], xx) for n in "wkvrg")
    r = (xr @ m.receptance.weight.T).view(B, T, H, K)
    k = (xk @ m.key.weight.T).view(B, T, H, K)
    v = (xv @ m.value.weight.T).view(B, T, H, V)
    w = torch.exp(-torch.exp(lora(m.decay, xw))).view(B, T, H, K)  # decay in (0, 1)
    u = m.bonus  # [H, K]
    state = x.new_zeros(B, H, V, K)
    ys = []
    for t in range(T):
        kv = v[:, t, :, :, None] * k[:, t, :, None, :]  # v^T k: [B, H, V, K]
        ys.append(torch.einsum("bhvk,bhk->bhv", state + u[:, None, :] * kv, r[:, t]))
        state = state * w[:, t, :, None, :] + kv
    y = group_norm(m, torch.stack(ys, 1))
    return (y * F.silu(xg @ m.gate.weight.T)) @ m.output_proj.weight.T


def test_rwkv6_equals_token_loop():
    m = make("rwkv6").double()
    x = torch.randn(2, 17, D, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(m(x), rwkv6_loop(m, x)) < 1e-10


# ----------------------------------------------------------------------------- RWKV-7


def rwkv7_loop(m, x: torch.Tensor) -> torch.Tensor:
    """RWKV-7 time mixing as the paper writes it: wkv_t = wkv_{t-1} (diag(w) - kk^T (a kk)) + v^T k."""
    B, T, _ = x.shape
    K, V = m.args.key_dim, m.args.value_dim
    dx = shifted(x) - x
    xr, xw, xk, xv, xa, xg = (x + dx * m.mu[n] for n in "rwkvag")
    r = (xr @ m.receptance.weight.T).view(B, T, H, K)
    k = (xk @ m.key.weight.T).view(B, T, H, K)
    v = (xv @ m.value.weight.T).view(B, T, H, V)
    w = torch.exp(-math.exp(-0.5) * torch.sigmoid(lora(m.decay, xw))).view(B, T, H, K)
    a = torch.sigmoid(lora(m.icl_rate, xa, act=None)).view(B, T, H, K)
    g = lora(m.gate, xg, act=torch.sigmoid)
    kk = F.normalize(k * m.k_k.view(H, K), dim=-1)
    k = k * (1 + (a - 1) * m.k_a.view(H, K))
    state = x.new_zeros(B, H, V, K)
    ys = []
    for t in range(T):
        transition = torch.diag_embed(w[:, t]) - kk[:, t, :, :, None] * (a[:, t] * kk[:, t])[:, :, None, :]
        state = state @ transition + v[:, t, :, :, None] * k[:, t, :, None, :]
        ys.append((state @ r[:, t, :, :, None])[..., 0])  # wkv_t r_t^T: [B, H, V]
    y = group_norm(m, torch.stack(ys, 1))
    y = y + ((r * k * m.r_k).sum(-1, keepdim=True) * v).view(B, T, H * V)
    return (y * g) @ m.output_proj.weight.T


@pytest.mark.parametrize("expand_v", [1.0, 2.0])
def test_rwkv7_equals_paper_token_loop(expand_v):
    m = make("rwkv7", expand_v=expand_v).double()
    x = torch.randn(2, 17, D, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(m(x), rwkv7_loop(m, x)) < 1e-10


# ----------------------------------------------------------------------------- decays, dtypes, init


@pytest.mark.parametrize("name, per_channel", [("mamba2", False), ("rwkv6", True), ("rwkv7", True)])
def test_decay_is_fp32_log_space_with_documented_shape(name, per_channel):
    m = make(name, noise=1.0).to(torch.bfloat16)
    x = 3 * torch.randn(2, 7, D).to(torch.bfloat16)
    with torch.no_grad():
        g = m.recurrence_inputs(x, cache=None, cu_seqlens=None).log_decay
    K = m.args.key_dim
    assert g.dtype == torch.float32
    assert tuple(g.shape) == ((2, 7, H, K) if per_channel else (2, 7, H))
    assert bool((g <= 0).all()) and bool(torch.isfinite(g).all())
    if name == "rwkv7":  # w = exp(-e^{-1/2} sigmoid(.)) > 0.545
        assert bool((g >= -math.exp(-0.5)).all())


def test_rwkv7_low_rank_term_is_the_paper_transition_transposed():
    """S = wkv^T: a^T b must equal (-kappa^T (a * kappa))^T = -(a * kappa)^T kappa."""
    m = make("rwkv7").double()
    x = torch.randn(1, 5, D, dtype=torch.float64)
    with torch.no_grad():
        args = m.recurrence_inputs(x, cache=None, cu_seqlens=None)
    assert torch.allclose(args.b.norm(dim=-1), torch.ones(1, 5, H, dtype=torch.float64))  # kappa: unit norm
    icl = -(args.a / args.b)  # a = -(icl * kappa), b = kappa
    assert bool(((icl > 0) & (icl < 1)).all())


@pytest.mark.parametrize("name", NAMES)
def test_init_depends_on_layer_and_is_finite(name):
    def build(layer_idx, num_layers):
        torch.manual_seed(0)
        return build_mixer(name, MixerArgs(hidden_size=D, num_heads=H, layer_idx=layer_idx, num_layers=num_layers))

    single, first, last = build(0, 1), build(0, 4), build(3, 4)
    for m in (single, first, last):
        assert all(torch.isfinite(p).all() for p in m.parameters())
    if name.startswith("rwkv"):  # RWKV's token-shift mixes, decays and norm scales follow the depth
        changed = [n for n, p in first.named_parameters() if not torch.equal(p, dict(last.named_parameters())[n])]
        assert any(n.startswith("mu") for n in changed) and "decay.bias" in changed and "norm.weight" in changed


def test_init_decay_ranges_follow_the_papers():
    x = torch.randn(1, 3, D)
    with torch.no_grad():
        torch.manual_seed(0)
        mamba = build_mixer("mamba2", MixerArgs(hidden_size=D, num_heads=H))
        dt = F.softplus(mamba.dt_bias)
        assert bool(((dt > 0.9e-3) & (dt < 0.11)).all())  # dt ~ log-uniform in [1e-3, 0.1]
        assert bool(((mamba.A_log.exp() >= 1) & (mamba.A_log.exp() <= 16)).all())
        rwkv6 = build_mixer("rwkv6", MixerArgs(hidden_size=D, num_heads=H, layer_idx=0, num_layers=2))
        g = rwkv6.recurrence_inputs(x, cache=None, cu_seqlens=None).log_decay
        # log w = -exp(d), d from -6 (slowest channel) to -1 (fastest) at init (LoRA A starts at zero)
        assert math.isclose(float(g[0, 0, 0, 0]), -math.exp(-6), rel_tol=1e-5)
        assert math.isclose(float(g[0, 0, -1, -1]), -math.exp(-1), rel_tol=1e-5)


# ----------------------------------------------------------------------------- KDA


def kda_loop(m, x: torch.Tensor) -> torch.Tensor:
    """Kimi Delta Attention token by token: S <- diag(alpha) S, then the delta rule, state [K, V]."""
    B, T, _ = x.shape
    K, V = m.args.key_dim, m.args.value_dim

    def conv_silu(name: str, y: torch.Tensor) -> torch.Tensor:
        conv = m.convs[name]
        width = conv.weight.shape[1]
        y = F.conv1d(F.pad(y.transpose(1, 2), (width - 1, 0)), conv.weight[:, None, :], conv.bias, groups=y.shape[-1])
        return F.silu(y.transpose(1, 2))

    q = F.normalize(conv_silu("q", x @ m.q_proj.weight.T).view(B, T, H, K), dim=-1)
    k = F.normalize(conv_silu("k", x @ m.k_proj.weight.T).view(B, T, H, K), dim=-1)
    v = conv_silu("v", x @ m.v_proj.weight.T).view(B, T, H, V)
    f = x @ m.f_proj[0].weight.T @ m.f_proj[1].weight.T + m.dt_bias  # low-rank gate, one value per key channel
    alpha = torch.exp(-torch.exp(m.A_log)[:, None] * F.softplus(f).view(B, T, H, K))
    beta = torch.sigmoid(x @ m.b_proj.weight.T)  # [B, T, H]
    S = x.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = alpha[:, t, :, :, None] * S
        error = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + beta[:, t, :, None, None] * k[:, t, :, :, None] * error[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S) * K ** -0.5)
    o = torch.stack(outs, 1)  # [B, T, H, V]
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + m.o_norm.eps) * m.o_norm.weight
    gate = (x @ m.g_proj[0].weight.T @ m.g_proj[1].weight.T + m.g_proj[1].bias).view(B, T, H, V)
    return (o * torch.sigmoid(gate)).reshape(B, T, H * V) @ m.o_proj.weight.T


def test_kda_equals_token_loop():
    m = make("kda").double()
    x = torch.randn(2, 15, D, dtype=torch.float64)
    with torch.no_grad():  # the gated RMSNorm normalises in fp32
        assert rel_err(m(x), kda_loop(m, x)) < 1e-6


def test_kda_decay_is_per_key_channel_and_in_range():
    torch.manual_seed(0)
    m = build_mixer("kda", MixerArgs(hidden_size=D, num_heads=H))
    with torch.no_grad():
        g = m.recurrence_inputs(torch.randn(2, 5, D), cache=None, cu_seqlens=None).log_decay
    assert g.shape == (2, 5, H, D // H) and bool((g < 0).all())
    assert not torch.allclose(g[..., 0], g[..., 1])  # one decay per channel, not per head
    assert bool(((m.A_log.exp() >= 1) & (m.A_log.exp() <= 16)).all())


# ----------------------------------------------------------------------------- invariants with random weights


@pytest.mark.parametrize("name", NAMES)
def test_decode_and_varlen_with_random_weights(name):
    """The shared invariants again, with output projections that are not zero."""
    m = make(name)
    x = torch.randn(2, 11, D)
    with torch.no_grad():
        full = m(x)
        cache = LayerState()
        parts = [m(x[:, :4], cache=cache)] + [m(x[:, t : t + 1], cache=cache) for t in range(4, 11)]
        assert rel_err(torch.cat(parts, 1), full) < 1e-5
        packed = m(torch.cat([x[:1, :6], x[1:, :11]], 1), cu_seqlens=torch.tensor([0, 6, 17]))
        assert rel_err(packed[:, :6], m(x[:1, :6])) < 1e-5
        assert rel_err(packed[:, 6:], full[1:]) < 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_left_padding_with_random_weights(name):
    m = make(name)
    x = torch.randn(1, 8, D)
    xp = torch.cat([torch.zeros(1, 3, D), x], 1)
    mask = torch.arange(11)[None] >= 3
    with torch.no_grad():
        assert rel_err(m(xp, token_mask=mask)[:, 3:], m(x)) < 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_gets_a_nonzero_gradient(name):
    m = make(name).train()
    m(torch.randn(2, 9, D)).square().mean().backward()
    dead = [n for n, p in m.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert not dead, f"parameters without gradient: {dead}"
