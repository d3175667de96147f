"""gfw, gateloop, mamba and s4 against token loops of their papers' equations (outputs, final states,
gradients of every parameter), their decays' shapes and initialisations, MoM over the rules that allow
it, and the mixers inside LinmemForCausalLM (save and load, generation). tests/layers/test_mixers.py
checks their decoding, varlen and padding invariants like every registered mixer's."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

from linmem.layers import LayerState, MixerArgs, build_mixer
from linmem.layers.mom import MoMArgs, mom_rules
from linmem.models import LinmemConfig, LinmemForCausalLM
from tests.helpers import rel_err

D, H = 32, 2
NAMES = ("gfw", "gateloop", "mamba", "s4")
TOL = 1e-5


def make(name: str, seed: int = 0, noise: float = 0.3, **over) -> torch.nn.Module:
    """A mixer (fp64) whose every parameter is moved off its init, so that nothing cancels."""
    torch.manual_seed(seed)
    m = build_mixer(name, MixerArgs(**{"hidden_size": D, "num_heads": H, **over})).double()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(noise * torch.randn_like(p))
    return m.eval()


def causal_conv(x: torch.Tensor, conv: torch.nn.Module) -> torch.Tensor:
    """SiLU of the depthwise causal convolution of x [B, T, C] with weight [C, W] and bias [C]."""
    W = conv.weight.shape[1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), conv.weight[:, None], conv.bias, groups=x.shape[-1])
    return F.silu(y.transpose(1, 2))


def heads(x: torch.Tensor) -> torch.Tensor:
    return rearrange(x, "b t (h d) -> b t h d", h=H)


# ----------------------------------------------------------------------------- the token loops


def fast_weights_loop(m, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """M_t = A_t ⊙ M_{t-1} + k_t^T v_t, o_t = q_t M_t / sqrt(K), token by token; (y, final M [B, H, K, V])."""
    q, k, v = heads(m.q_proj(x)), heads(m.k_proj(x)), heads(m.v_proj(x))
    if m.name == "gfw":
        A = torch.sigmoid(heads(m.alpha_proj(x)))[..., :, None] * torch.sigmoid(heads(m.beta_proj(x)))[..., None, :]
    else:  # gateloop: the same gate for every value column
        A = torch.sigmoid(heads(m.a_proj(x)))[..., :, None].expand(-1, -1, -1, -1, v.shape[-1])
    M = x.new_zeros(x.shape[0], H, q.shape[-1], v.shape[-1])
    outs = []
    for t in range(x.shape[1]):
        M = A[:, t] * M + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], M) / math.sqrt(q.shape[-1]))
    o = torch.stack(outs, 1)
    y = m.o_proj(rearrange(m.o_norm(o, heads(m.g_proj(x))), "b t h d -> b t (h d)"))
    return y, M


def mamba_loop(m, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-1's selective scan (the paper's Algorithm 2 with its ZOH-A / Euler-B discretisation), channel by
    channel: h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t x_t, y_t = C_t h_t + D x_t; (out, final h [B, E, N])."""
    N = m.args.key_dim
    u, z = m.in_proj(x).chunk(2, dim=-1)
    u = causal_conv(u, m.conv)
    delta, B, C = m.x_proj(u).split([m.dt_rank, N, N], dim=-1)
    dt = F.softplus(delta @ m.dt_proj.weight.T + m.dt_bias)  # [B, T, E]
    A = -torch.exp(m.A_log)  # [E, N]
    h = x.new_zeros(x.shape[0], m.inner, N)
    ys = []
    for t in range(x.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + dt[:, t, :, None] * B[:, t, None, :] * u[:, t, :, None]
        ys.append((h * C[:, t, None, :]).sum(-1) + m.D * u[:, t])
    y = torch.stack(ys, 1)
    return m.out_proj(y * F.silu(z)), h


def s4d_loop(m, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """S4D-Real with the zero-order hold, channel by channel: h_t = exp(ΔA) h_{t-1} + (exp(ΔA) - 1)/A u_t,
    y_t = C h_t + D u_t, out = GLU(W GELU(y)); (out, final h [B, D, N])."""
    A = -torch.exp(m.A_log)  # [D, N]
    dt = torch.exp(m.log_dt)[:, None]
    A_bar, B_bar = torch.exp(dt * A), (torch.exp(dt * A) - 1) / A
    h = x.new_zeros(x.shape[0], D, A.shape[1])
    ys = []
    for t in range(x.shape[1]):
        h = A_bar * h + B_bar * x[:, t, :, None]
        ys.append((h * m.C).sum(-1) + m.D * x[:, t])
    y = torch.stack(ys, 1)
    return F.glu(m.out_proj(F.gelu(y)), dim=-1), h


def loop(m, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's loop for mixer m: (output [B, T, D], final state in the layer's cache layout)."""
    if m.name == "mamba":
        y, h = mamba_loop(m, x)
        return y, rearrange(h, "b (h v) n -> b h n v", h=H)
    if m.name == "s4":
        y, h = s4d_loop(m, x)
        return y, h[..., None]
    return fast_weights_loop(m, x)


@pytest.mark.parametrize("name", NAMES)
def test_equals_the_papers_token_loop_in_outputs_states_and_gradients(name):
    m = make(name).train()
    x = torch.randn(2, 11, D, dtype=torch.float64)
    cache = LayerState()
    y = m(x, cache=cache)
    ref, state = loop(m, x)
    assert rel_err(y.detach(), ref.detach()) < TOL
    assert rel_err(cache.get("recurrent").detach(), state.detach()) < TOL
    grad = torch.randn_like(y)
    mine = torch.autograd.grad(y, list(m.parameters()), grad)
    theirs = torch.autograd.grad(ref, list(m.parameters()), grad)
    for (pname, _), a, b in zip(m.named_parameters(), mine, theirs):
        assert rel_err(a, b) < TOL, pname


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_gets_a_nonzero_gradient(name):
    m = make(name).train()
    m(torch.randn(2, 9, D, dtype=torch.float64)).square().mean().backward()
    dead = [n for n, p in m.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert not dead, f"parameters without gradient: {dead}"


@pytest.mark.parametrize("name, shape", [
    ("gfw", "full"), ("gateloop", "vector"), ("mamba", "full"), ("s4", "vector"),
])
def test_decays_are_fp32_log_space_of_the_documented_shape(name, shape):
    torch.manual_seed(0)
    m = build_mixer(name, MixerArgs(hidden_size=D, num_heads=H))
    x = torch.randn(2, 7, D)
    args = m.recurrence_inputs(x, cache=None, cu_seqlens=None)
    K, V = args.q.shape[-1], args.v.shape[-1]
    heads_ = D if name == "s4" else H
    expected = [2, 7, heads_, K, V] if shape == "full" else [2, 7, heads_, K]
    assert list(args.log_decay.shape) == expected
    assert args.log_decay.dtype == torch.float32
    assert bool((args.log_decay <= 0).all())
    if name == "s4":  # time-invariant
        assert torch.equal(args.log_decay, args.log_decay[:, :1].expand_as(args.log_decay))


def test_ssm_inits_follow_the_papers():
    torch.manual_seed(0)
    N = 8
    mamba = build_mixer("mamba", MixerArgs(hidden_size=D, num_heads=1, head_dim=N, expand_v=2 * D / N))
    s4 = build_mixer("s4", MixerArgs(hidden_size=D, num_heads=H, head_dim=N))
    real = -torch.arange(1, N + 1, dtype=torch.float32)  # S4D-Real
    for m in (mamba, s4):
        assert torch.allclose(-torch.exp(m.A_log), real.expand_as(m.A_log))
    assert mamba.inner == 2 * D and mamba.dt_rank == math.ceil(D / 16)
    assert torch.equal(mamba.D, torch.ones(2 * D))
    dt = F.softplus(mamba.dt_bias)
    assert bool((dt >= 1e-3 * 0.99).all() and (dt <= 0.1 * 1.01).all())
    dt = torch.exp(s4.log_dt)
    assert bool((dt >= 1e-3 * 0.99).all() and (dt <= 0.1 * 1.01).all())


def test_mamba_heads_only_split_the_channels():
    """Mamba-1 has no heads: the same weights give the same output for any split of the inner width."""
    one = make("mamba", num_heads=1, head_dim=8, expand_v=8.0)
    four = build_mixer("mamba", MixerArgs(hidden_size=D, num_heads=4, head_dim=8, expand_v=2.0)).double().eval()
    four.load_state_dict(one.state_dict())
    x = torch.randn(2, 9, D, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(four(x), one(x)) < 1e-12


def test_mom_takes_the_rules_with_input_projections():
    rules = mom_rules()
    assert {"gfw", "gateloop", "mamba"} <= set(rules)
    assert "s4" not in rules
    with pytest.raises(ValueError, match="mom_memory"):
        build_mixer("mom", MoMArgs(hidden_size=D, num_heads=H, mom_memory="s4"))


@pytest.mark.parametrize("rule", ["gfw", "gateloop", "mamba"])
def test_mom_over_the_rule_equals_its_memories_run_alone(rule):
    """Top-1 of two memories without the shared one: every token's output is the plain rule's with the weights
    of the memory it was routed to, run over that memory's own tokens (outputs and final states)."""
    torch.manual_seed(0)
    mom = build_mixer("mom", MoMArgs(hidden_size=D, num_heads=H, mom_memory=rule, num_memories=2, top_k=1,
                                     shared_memory=False)).double().eval()
    plain = build_mixer(rule, MixerArgs(hidden_size=D, num_heads=H)).double().eval()
    x = torch.randn(1, 12, D, dtype=torch.float64)
    with torch.no_grad():
        cache = LayerState()
        y = mom(x, cache=cache)
        chosen = mom.router(x).argmax(-1)[0]  # [T]
        for memory in range(2):
            state = plain.state_dict()
            for name, value in mom.memory.state_dict().items():
                if name.split(".")[0] in plain.memory_projections:
                    value = value[memory]
                state[name] = value.reshape(state[name].shape)
            plain.load_state_dict(state)
            tokens = (chosen == memory).nonzero()[:, 0]
            if len(tokens):
                assert rel_err(y[:, tokens], plain(x[:, tokens])) < 1e-10


@pytest.mark.parametrize("name", NAMES)
def test_model_saves_loads_and_generates(name, tmp_path):
    torch.manual_seed(0)
    config = LinmemConfig(vocab_size=64, hidden_size=D, num_heads=H, layer_pattern="LN", memory=name)
    model = LinmemForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 9))
    out = model(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    model.save_pretrained(tmp_path)
    loaded = LinmemForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
        full = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True)
        again = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
    assert torch.equal(full, again)
