"""TTT-Linear and Titans' memory against token loops of their papers' equations, and Titans' momentum op.

The loops take the gradient of each paper's inner loss with autograd (``torch.autograd.grad``), so they check
the mapping of "one gradient step per token" onto the delta rule, not a hand-derived update. Titans with
momentum has its own op (:mod:`linmem.ops.titans`): its chunked form is checked against its token loop
(outputs, final state, gradients, packed sequences, padding, decoding steps), and the layer keeps the
invariants every mixer keeps (tests/layers/test_mixers.py) with the pair state.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linmem.layers import LayerState, MixerArgs, build_mixer
from linmem.layers.titans import TitansArgs
from linmem.models import LinmemConfig, LinmemForCausalLM
from linmem.ops.titans import titans_momentum, titans_momentum_step
from tests.helpers import rel_err

D, H = 32, 2
K = D // H


def make(name: str, momentum: bool = False, seed: int = 0, noise: float = 0.3) -> torch.nn.Module:
    """A mixer whose every parameter is moved off its init (zero output projections included)."""
    torch.manual_seed(seed)
    args = TitansArgs(hidden_size=D, num_heads=H, momentum=momentum) if name == "titans" else \
        MixerArgs(hidden_size=D, num_heads=H)
    m = build_mixer(name, args)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(noise * torch.randn_like(p))
    return m.eval()


def qkv(m, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The short-convolved projections, per head: q, k L2-normalised (x / sqrt(|x|^2 + 1e-6), DeltaNet's)
    [B, T, H, K], v [B, T, H, V]."""
    heads = lambda y: y.unflatten(-1, (H, -1))  # noqa: E731
    q, k, v = (heads(conv(proj(x))) for proj, conv in ((m.q_proj, m.q_conv), (m.k_proj, m.k_conv),
                                                        (m.v_proj, m.v_conv)))
    unit = lambda y: y / (y.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()  # noqa: E731
    return unit(q), unit(k), v


def gradient(loss_of, W: torch.Tensor) -> torch.Tensor:
    """d loss / d W, kept differentiable (the loops are differentiated again for the gradient tests)."""
    W = W if W.requires_grad else W.requires_grad_()
    return torch.autograd.grad(loss_of(W), W, create_graph=True)[0]


def ttt_loop(m, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TTT-Linear from the paper: keys and queries of norm sqrt(K), eta = sigmoid(W_eta x) / K,
    W_t = W_{t-1} - eta grad |k + k W - v|^2 / 2, z = q + LN(q W_t). Returns (y, W_T [B, H, K, V])."""
    q, k, v = qkv(m, x)
    q, k = K**0.5 * q, K**0.5 * k
    eta = torch.sigmoid(m.b_proj(x)) / K  # [B, T, H]
    B, T = x.shape[:2]
    W = x.new_zeros(B, H, K, K)
    ln_w, ln_b = m.ttt_norm.weight.view(H, K), m.ttt_norm.bias.view(H, K)
    zs = []
    for t in range(T):
        kt, vt = k[:, t], v[:, t]
        loss = lambda W: 0.5 * (kt + torch.einsum("bhk,bhkv->bhv", kt, W) - vt).pow(2).sum()  # noqa: B023,E731
        W = W - eta[:, t, :, None, None] * gradient(loss, W)
        read = torch.einsum("bhk,bhkv->bhv", q[:, t], W)
        zs.append(q[:, t] + F.layer_norm(read, (K,), eps=m.ttt_norm.eps) * ln_w + ln_b)
    z = torch.stack(zs, 1)
    return m.o_proj(m.o_norm(z).flatten(-2)), W


def titans_loop(m, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Titans from the paper (eqs. 13-14, linear memory): S = eta S - theta grad |k M - v|^2 / 2, M = a M + S
    (without momentum: M = a M - theta grad), o = q M / sqrt(K). Returns (y, (M,) or (M, S))."""
    q, k, v = qkv(m, x)
    a = torch.exp(-m.A_log.exp() * F.softplus(m.a_proj(x) + m.dt_bias))  # [B, T, H]: 1 - alpha
    theta = a * torch.sigmoid(m.b_proj(x))
    eta = torch.sigmoid(m.m_proj(x)) if m.args.momentum else None
    B, T = x.shape[:2]
    M, S = x.new_zeros(B, H, K, K), x.new_zeros(B, H, K, K)
    outs = []
    for t in range(T):
        kt, vt = k[:, t], v[:, t]
        loss = lambda M: 0.5 * (torch.einsum("bhk,bhkv->bhv", kt, M) - vt).pow(2).sum()  # noqa: B023,E731
        grad = gradient(loss, M)
        if eta is None:
            M = a[:, t, :, None, None] * M - theta[:, t, :, None, None] * grad
        else:
            S = eta[:, t, :, None, None] * S - theta[:, t, :, None, None] * grad
            M = a[:, t, :, None, None] * M + S
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], M) / K**0.5)
    o = torch.stack(outs, 1)
    y = m.o_proj(m.o_norm(o, m.g_proj(x).unflatten(-1, (H, K))).flatten(-2))
    return y, ((M,) if eta is None else (M, S))


CASES = [("ttt", False), ("titans", False), ("titans", True)]
IDS = ["ttt", "titans", "titans-momentum"]


@pytest.mark.parametrize("name,momentum", CASES, ids=IDS)
def test_equals_the_papers_token_loop(name, momentum):
    """Outputs, final state and input gradients of the layer equal the paper's loop (fp64; the layer computes its
    gates, beta and the decay, in fp32)."""
    m = make(name, momentum).double()
    x = torch.randn(2, 37, D, dtype=torch.float64, requires_grad=True)
    cache = LayerState()
    y = m(x, cache=cache)
    if name == "ttt":
        ref, W = ttt_loop(m, x)
        states = (K**0.5 * W,)  # the layer's state is sqrt(K) W (it runs on unit keys)
    else:
        ref, states = titans_loop(m, x)
    assert rel_err(y.detach(), ref.detach()) < 1e-6
    for state_name, state in zip(m.state_names, states):
        assert rel_err(cache.get(state_name).detach(), state.detach()) < 1e-6, state_name
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g)
    (dx_ref,) = torch.autograd.grad(ref, x, g)
    assert rel_err(dx, dx_ref) < 1e-6


def test_titans_without_momentum_runs_on_the_gated_delta_rule():
    """No momentum: the unified recurrence's fastest backend (one matrix state); momentum: the pair."""
    assert make("titans").state_names == ("recurrent",)
    assert make("titans", momentum=True).state_names == ("recurrent", "momentum")


# ----------------------------------------------------------------------------- the momentum op


def momentum_inputs(B: int, T: int, *, seed: int = 0, dtype=torch.float64) -> dict:
    torch.manual_seed(seed)
    Hh, Kk, V = 2, 8, 6
    return dict(
        q=F.normalize(torch.randn(B, T, Hh, Kk, dtype=dtype), dim=-1),
        k=F.normalize(torch.randn(B, T, Hh, Kk, dtype=dtype), dim=-1),
        v=torch.randn(B, T, Hh, V, dtype=dtype),
        log_decay=F.logsigmoid(torch.randn(B, T, Hh, dtype=dtype) + 3),
        theta=torch.rand(B, T, Hh, dtype=dtype),
        log_momentum=F.logsigmoid(torch.randn(B, T, Hh, dtype=dtype) + 1),
    )


def initial(N: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(N, 2, 8, 6, dtype=dtype), torch.randn(N, 2, 8, 6, dtype=dtype)


@pytest.mark.parametrize("T", [1, 31, 32, 75])
def test_momentum_chunk_equals_token_loop(T):
    """Outputs, final (M, S) and the gradients of every input and of the initial state."""
    inputs = momentum_inputs(2, T)
    state = initial(2)
    leaves = [*inputs.values(), *state]
    for x in leaves:
        x.requires_grad_()
    results = {}
    for backend in ("reference", "chunk"):
        o, (M, S) = titans_momentum(**inputs, initial_state=state, output_final_state=True, backend=backend)
        loss = (o * torch.linspace(-1, 1, o.shape[-1], dtype=o.dtype)).sum() + M.square().sum() + (S * M).sum()
        results[backend] = (o, M, S, torch.autograd.grad(loss, leaves))
    ref, chunk = results["reference"], results["chunk"]
    for a, b in zip(chunk[:3], ref[:3]):
        assert rel_err(a.detach(), b.detach()) < 1e-12
    for a, b in zip(chunk[3], ref[3]):
        assert rel_err(a, b) < 1e-10


def test_momentum_chunk_in_fp32_stays_close():
    inputs = momentum_inputs(2, 200, dtype=torch.float32)
    o, (M, S) = titans_momentum(**inputs, output_final_state=True)
    ref, (M_ref, S_ref) = titans_momentum(**{n: x.double() for n, x in inputs.items()}, output_final_state=True,
                                          backend="reference")
    assert rel_err(o, ref) < 1e-5 and rel_err(M, M_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5


@pytest.mark.parametrize("backend", ["reference", "chunk"])
def test_momentum_varlen_equals_separate_sequences(backend):
    lengths = [9, 40, 0, 3]
    inputs = momentum_inputs(1, sum(lengths))
    state = initial(len(lengths))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    o, (M, S) = titans_momentum(**inputs, initial_state=state, output_final_state=True, cu_seqlens=cu,
                                backend=backend)
    for n in range(len(lengths)):
        part = {name: x[:, cu[n] : cu[n + 1]] for name, x in inputs.items()}
        o_n, (M_n, S_n) = titans_momentum(**part, initial_state=(state[0][n : n + 1], state[1][n : n + 1]),
                                          output_final_state=True, backend="reference")
        assert torch.allclose(o[:, cu[n] : cu[n + 1]], o_n, atol=1e-12)
        assert torch.allclose(M[n], M_n[0], atol=1e-12) and torch.allclose(S[n], S_n[0], atol=1e-12)


def test_momentum_padding_leaves_the_pair_unchanged():
    """rho = 0 with a = eta = 1, theta = 0 is a step that moves neither M nor S (the momentum included)."""
    inputs = momentum_inputs(1, 5)
    pad = torch.tensor([1.0, 0, 0, 1, 1], dtype=torch.float64)[None, :, None].expand(1, 5, 2)
    masked = dict(inputs, log_decay=inputs["log_decay"] * pad, theta=inputs["theta"] * pad,
                  log_momentum=inputs["log_momentum"] * pad)
    state = initial(1)
    o, (M, S) = titans_momentum(**masked, rho=pad, initial_state=state, output_final_state=True)
    keep = {name: x[:, [0, 3, 4]] for name, x in inputs.items()}
    ref, (M_ref, S_ref) = titans_momentum(**keep, initial_state=state, output_final_state=True,
                                          backend="reference")
    assert torch.allclose(M, M_ref, atol=1e-12) and torch.allclose(S, S_ref, atol=1e-12)
    assert torch.allclose(o[:, [0, 3, 4]], ref, atol=1e-12)


def test_momentum_steps_equal_the_sequence():
    inputs = momentum_inputs(3, 7)
    state = initial(3)
    o, final = titans_momentum(**inputs, initial_state=state, output_final_state=True)
    M, S = (x.clone() for x in state)
    with torch.no_grad():
        for t in range(7):
            o_t, (M_t, S_t) = titans_momentum_step(*(inputs[n][:, t] for n in ("q", "k", "v")), (M, S),
                                                   **{n: inputs[n][:, t] for n in ("log_decay", "theta",
                                                                                   "log_momentum")})
            assert M_t is M and S_t is S  # updated in place
            assert torch.allclose(o_t, o[:, t], atol=1e-12)
    assert torch.allclose(M, final[0], atol=1e-12) and torch.allclose(S, final[1], atol=1e-12)


def test_momentum_refuses_bad_arguments():
    inputs = momentum_inputs(1, 4)
    with pytest.raises(ValueError, match="`backend` 'triton'"):
        titans_momentum(**inputs, backend="triton")
    with pytest.raises(ValueError, match="`theta` must be"):
        titans_momentum(**dict(inputs, theta=inputs["theta"][..., :1]))
    with pytest.raises(TypeError, match="one floating dtype"):
        titans_momentum(**dict(inputs, v=inputs["v"].float()))
    with pytest.raises(ValueError, match="`cu_seqlens` must rise from 0 to T = 4"):
        titans_momentum(**inputs, cu_seqlens=torch.tensor([0, 3, 2, 4]))


# ----------------------------------------------------------------------------- the layer with momentum


def test_momentum_layer_keeps_the_mixer_invariants():
    """Prefill + decoding, chunked prefill, packed sequences and left padding equal the plain forward."""
    m = make("titans", momentum=True)
    x = torch.randn(2, 13, D)
    with torch.no_grad():
        full = m(x)
        cache = LayerState()
        parts = [m(x[:, :6], cache=cache)] + [m(x[:, t : t + 1], cache=cache) for t in range(6, 13)]
        assert rel_err(torch.cat(parts, 1), full) < 1e-5
        cache = LayerState()
        parts = [m(x[:, :4], cache=cache), m(x[:, 4:11], cache=cache), m(x[:, 11:], cache=cache)]
        assert rel_err(torch.cat(parts, 1), full) < 1e-5
        packed = m(torch.cat([x[:1, :6], x[1:]], 1), cu_seqlens=torch.tensor([0, 6, 19]))
        assert rel_err(packed[:, :6], m(x[:1, :6])) < 1e-5 and rel_err(packed[:, 6:], full[1:]) < 1e-5
        xp = torch.cat([torch.zeros(2, 3, D), x], 1)
        mask = (torch.arange(16)[None] >= 3).expand(2, -1)
        assert rel_err(m(xp, token_mask=mask)[:, 3:], full) < 1e-5
        cache = LayerState()
        pre = m(xp[:, :8], cache=cache, token_mask=mask[:, :8])
        dec = [m(xp[:, t : t + 1], cache=cache, token_mask=mask[:, t : t + 1]) for t in range(8, 16)]
        assert rel_err(torch.cat([pre, *dec], 1)[:, 3:], full) < 1e-5


def test_momentum_layer_gives_every_parameter_a_gradient():
    m = make("titans", momentum=True).train()
    m(torch.randn(2, 9, D)).square().mean().backward()
    dead = [n for n, p in m.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert not dead, f"parameters without gradient: {dead}"


def test_ttt_refuses_a_value_width_other_than_the_key_width():
    with pytest.raises(ValueError, match="ttt: `expand_v` must be 1"):
        build_mixer("ttt", MixerArgs(hidden_size=D, num_heads=H, expand_v=2.0))
    with pytest.raises(ValueError, match="`titans.momentum` must be True or False"):
        LinmemConfig(memory="titans", titans={"momentum": 1})


# ----------------------------------------------------------------------------- models


MODELS = [
    dict(memory="ttt"),
    dict(memory="titans"),
    dict(memory="titans", titans={"momentum": True}),
    dict(memory="mom", mom={"memory": "ttt", "num_memories": 2, "top_k": 1}),
    dict(memory="mom", mom={"memory": "titans", "num_memories": 2, "top_k": 1}),
]
MODEL_IDS = ["ttt", "titans", "titans-momentum", "mom-ttt", "mom-titans"]


def tiny(**options) -> LinmemForCausalLM:
    torch.manual_seed(0)
    config = LinmemConfig(vocab_size=64, hidden_size=D, num_heads=H, layer_pattern="LN", **options)
    return LinmemForCausalLM(config).eval()


@pytest.mark.parametrize("options", MODELS, ids=MODEL_IDS)
def test_model_trains_decodes_and_round_trips(options, tmp_path):
    """Loss and gradients are finite, cached decoding equals the full forward, save/load keeps the logits."""
    model = tiny(**options)
    ids = torch.randint(0, 64, (2, 10))
    out = model.train()(ids, labels=ids, use_cache=False)
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(torch.isfinite(p.grad).all() for p in model.parameters()
                                            if p.grad is not None)
    model.eval()
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        first = model(ids[:, :6], use_cache=True)
        cache, steps = first.past_key_values, [first.logits]
        for t in range(6, 10):
            step = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            steps.append(step.logits)
    assert rel_err(torch.cat(steps, 1), full) < 1e-5
    model.save_pretrained(tmp_path)
    loaded = LinmemForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.titans == model.config.titans and loaded.config.memory == options["memory"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
