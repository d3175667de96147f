"""The reference itself, checked against closed forms and against the identities that
tie the rules together (so that the oracle of every other test is right)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from linmem.ops import linear_recurrence, linear_recurrence_step
from tests.helpers import make_inputs, rel_err


def test_no_decay_is_causal_linear_attention():
    B, T, H, K, V = 2, 30, 3, 8, 5
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
    o, _ = linear_recurrence(q, k, v, scale=1.0, backend="reference")
    scores = torch.einsum("bthk,bshk->bhts", q, k).tril()
    expected = torch.einsum("bhts,bshv->bthv", scores, v)
    assert rel_err(o, expected) < 1e-6


def test_scalar_decay_is_masked_attention_with_decay_matrix():
    """Mamba-2 / SSD: o_t = sum_{s<=t} exp(G_t - G_s) (q_t.k_s) v_s."""
    B, T, H, K, V = 1, 25, 2, 4, 3
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
    g = F.logsigmoid(torch.randn(B, T, H))
    o, _ = linear_recurrence(q, k, v, log_decay=g, scale=1.0, backend="reference")
    G = g.cumsum(1)
    decay = torch.exp(G[:, :, None, :] - G[:, None, :, :]).permute(0, 3, 1, 2).tril()
    scores = torch.einsum("bthk,bshk->bhts", q, k) * decay
    assert rel_err(o, torch.einsum("bhts,bshv->bthv", scores, v)) < 1e-5


def test_constant_decay_equals_scalar_decay_repeated():
    B, T, H = 2, 20, 3
    t = make_inputs("scalar", "additive", False, B=B, T=T, H=H, K=4, V=4)
    const = torch.tensor([-0.1, -0.5, -2.0])
    o1, S1 = linear_recurrence(**{**t, "log_decay": const}, output_final_state=True, backend="reference")
    o2, S2 = linear_recurrence(**{**t, "log_decay": const.expand(B, T, H)}, output_final_state=True,
                               backend="reference")
    assert torch.equal(o1, o2) and torch.equal(S1, S2)


def test_full_decay_constant_over_values_equals_vector_decay():
    B, T, H, K, V = 1, 15, 2, 4, 3
    t = make_inputs("vector", "delta", True, B=B, T=T, H=H, K=K, V=V)
    o1, S1 = linear_recurrence(**t, output_final_state=True, backend="reference")
    full = t["log_decay"][..., None].expand(B, T, H, K, V)
    o2, S2 = linear_recurrence(**{**t, "log_decay": full}, output_final_state=True, backend="reference")
    assert rel_err(o1, o2) < 1e-6 and rel_err(S1, S2) < 1e-6


def test_delta_rule_is_dplr_with_a_minus_beta_k_b_k_decayed_and_beta_v():
    """S_t = (D - beta k^T k D) S + beta k^T v  ==  (D + a^T b) S + k^T (beta v), a = -beta k, b = k exp(g)."""
    B, T, H, K, V = 1, 20, 2, 6, 4
    t = make_inputs("vector", "delta", False, B=B, T=T, H=H, K=K, V=V)
    o1, S1 = linear_recurrence(**t, output_final_state=True, scale=1.0, backend="reference")
    beta, k, g = t["beta"][..., None], t["k"], t["log_decay"]
    dplr = dict(q=t["q"], k=k, v=beta * t["v"], log_decay=g, a=-beta * k, b=k * torch.exp(g),
                initial_state=t["initial_state"])
    o2, S2 = linear_recurrence(**dplr, output_final_state=True, scale=1.0, backend="reference")
    assert rel_err(S1, S2) < 1e-6 and rel_err(o1, o2) < 1e-6


def test_delta_rule_with_beta_one_stores_exactly_the_last_value_per_orthonormal_key():
    K = V = 4
    keys = torch.eye(K)  # orthonormal
    order = [0, 1, 2, 1, 3, 0]
    v = torch.randn(1, len(order), 1, V)
    k = keys[order][None, :, None, :]
    o, S = linear_recurrence(k, k, v, beta=torch.ones(1, len(order), 1), scale=1.0, output_final_state=True,
                             backend="reference")
    assert torch.allclose(o, v, atol=1e-6)  # reading with the key just written returns its value
    last = {key: t for t, key in enumerate(order)}
    for key, t in last.items():
        assert torch.allclose(S[0, 0, key], v[0, t, 0], atol=1e-6)


def test_bonus_reads_previous_state_plus_weighted_current_token():
    B, T, H, K, V = 1, 12, 1, 3, 2
    t = make_inputs("vector", "additive", True, B=B, T=T, H=H, K=K, V=V, initial_state=False)
    o, _ = linear_recurrence(**t, scale=1.0, backend="reference")
    q, k, v, g, u = t["q"][0, :, 0], t["k"][0, :, 0], t["v"][0, :, 0], t["log_decay"][0, :, 0], t["bonus"][0]
    S = torch.zeros(K, V)
    for step in range(T):
        expected = q[step] @ S + (q[step] * u * k[step]).sum() * v[step]
        assert torch.allclose(o[0, step, 0], expected, atol=1e-5)
        S = torch.exp(g[step])[:, None] * S + torch.outer(k[step], v[step])


def test_fp64_inputs_accumulate_in_fp64():
    t = make_inputs("scalar", "delta", False, B=1, T=9, H=1, K=4, V=4, dtype=torch.float64)
    o, S = linear_recurrence(**t, output_final_state=True, backend="reference")
    assert o.dtype == torch.float64 and S.dtype == torch.float64


def test_decode_steps_equal_the_sequence():
    for kind, rule, bonus in [("vector", "delta", False), ("scalar", "dplr", True), ("full", "additive", True),
                              ("constant", "delta", False), ("none", "additive", False)]:
        t = make_inputs(kind, rule, bonus, B=2, T=10, H=2, K=4, V=5)
        o_seq, S_seq = linear_recurrence(**t, output_final_state=True, backend="chunk")
        state = t["initial_state"].clone()
        for step in range(10):
            per_step = {}
            for name in ("q", "k", "v", "beta", "a", "b"):
                if name in t:
                    per_step[name] = t[name][:, step]
            if "log_decay" in t:
                g = t["log_decay"]
                per_step["log_decay"] = g if g.dim() == 1 else g[:, step]
            with torch.no_grad():
                o, returned = linear_recurrence_step(state=state, bonus=t.get("bonus"), **per_step)
            assert returned is state, "decode must update the state in place"
            assert rel_err(o, o_seq[:, step]) < 1e-5, (kind, rule, bonus, step)
        assert rel_err(state, S_seq) < 1e-5


def test_decode_step_keeps_the_state_when_recording_gradients():
    t = make_inputs("scalar", "additive", False, B=1, T=1, H=1, K=3, V=3)
    state = t["initial_state"].clone()
    q = t["q"][:, 0].requires_grad_(True)
    o, new = linear_recurrence_step(q, t["k"][:, 0], t["v"][:, 0], state, log_decay=t["log_decay"][:, 0])
    assert new is not state and torch.equal(state, t["initial_state"])
    o.sum().backward()
    assert q.grad is not None
