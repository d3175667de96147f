"""The Bayesian filter (bayes_filter): its reductions, the delta backend, decoding, bad inputs (long runs and the
conditioning: test_bayes_conditioning.py).

The token-loop reference is the oracle; here it is checked against the filter's known special cases
(covariance reset = the gated delta rule; the information form = the additive recurrence; no decay and
no process noise = ridge regression), and the "delta" backend against it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linmem.ops import bayes_filter, bayes_filter_step, linear_recurrence
from linmem.ops.bayes import information_form
from tests.helpers import rel_err

F64 = torch.float64


def _inputs(B=2, T=12, H=2, K=8, V=6, *, seed=0, dtype=F64, process_noise=True):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    t = dict(q=rnd(B, T, H, K), k=F.normalize(rnd(B, T, H, K), dim=-1), v=rnd(B, T, H, V),
             log_decay=F.logsigmoid(rnd(B, T, H) + 2), obs_noise=F.softplus(rnd(B, T, H)) + 0.05)
    if process_noise:
        t["process_noise"] = 0.1 * torch.rand(B, T, H, generator=gen, dtype=F64)
    return {n: x.to(dtype if n in ("q", "k", "v") else F64) for n, x in t.items()}


def _state(N, H, K, V, seed=1):
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(N, H, K, K, generator=gen, dtype=F64) / K ** 0.5
    return torch.randn(N, H, K, V, generator=gen, dtype=F64), A @ A.transpose(-1, -2) + 0.2 * torch.eye(K, dtype=F64)


def _with_grads(backend, t, seed=3, **kwargs):
    """Outputs and every input gradient of a random linear loss of o, var and the final state."""
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in t.items()}
    state = kwargs.pop("initial_state", None)
    if state is not None:
        state = tuple(x.detach().clone().requires_grad_(True) for x in state)
    o, var, (M, P) = bayes_filter(**leaves, initial_state=state, output_final_state=True, return_variance=True,
                                  backend=backend, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((x * torch.randn(x.shape, generator=gen, dtype=F64)).sum() for x in (o, var, M, P))
    wrt = list(leaves.values()) + (list(state) if state is not None else [])
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    grads = [torch.zeros_like(x) if d is None else d for x, d in zip(wrt, grads)]  # unused: a zero gradient
    return [x.detach() for x in (o, var, M, P)] + grads


def test_reset_mean_is_the_gated_delta_rule():
    t = _inputs(process_noise=False)
    p = 0.8
    o, _, (M, _) = bayes_filter(**t, prior=p, reset=True, output_final_state=True, backend="reference")
    beta = p / (p * t["k"].pow(2).sum(-1) + t["obs_noise"])
    o_delta, M_delta = linear_recurrence(t["q"], t["k"], t["v"], log_decay=t["log_decay"], beta=beta,
                                         output_final_state=True, backend="reference")
    assert rel_err(o, o_delta) < 1e-12 and rel_err(M, M_delta) < 1e-12


@pytest.mark.parametrize("varlen", [False, True])
def test_delta_backend_equals_reference(varlen):
    """Outputs, variance, final state and every gradient, with an initial mean (and a covariance it ignores)."""
    t = _inputs(B=1 if varlen else 2)
    kwargs = dict(prior=1.3, reset=True)
    N = 2
    if varlen:
        kwargs["cu_seqlens"] = torch.tensor([0, 5, 12])
    M0, P0 = _state(N, 2, 8, 6)
    ref = _with_grads("reference", t, initial_state=(M0, P0), **kwargs)
    got = _with_grads("delta", t, initial_state=(M0, P0), **kwargs)
    for i, (x, y) in enumerate(zip(got, ref)):
        assert rel_err(x, y) < 1e-10, i


def test_information_form_is_the_additive_recurrence():
    t = _inputs(process_noise=False)
    o, eta, _ = information_form(t["q"], t["k"], t["v"], log_decay=t["log_decay"], obs_noise=t["obs_noise"])
    v_over_r = t["v"] / t["obs_noise"][..., None]
    o_add, S = linear_recurrence(t["q"], t["k"], v_over_r, log_decay=t["log_decay"], output_final_state=True,
                                 backend="reference")
    assert rel_err(o, o_add) < 1e-12 and rel_err(eta, S) < 1e-12


def test_without_decay_or_process_noise_the_filter_is_ridge_regression():
    """a = 1, Q = 0: the posterior is (I / p + Lambda)^-1 (with Lambda the information form's precision)."""
    t = _inputs(T=20, process_noise=False)
    t["log_decay"] = torch.zeros_like(t["log_decay"])
    p = 0.5
    _, _, (M, P) = bayes_filter(**t, prior=p, output_final_state=True, backend="reference")
    _, eta, Lam = information_form(t["q"], t["k"], t["v"], log_decay=t["log_decay"], obs_noise=t["obs_noise"])
    P_ridge = torch.linalg.inv(torch.eye(8, dtype=F64) / p + Lam)
    assert rel_err(P, P_ridge) < 1e-10 and rel_err(M, P_ridge @ eta) < 1e-10


def test_extreme_gates_stay_finite():
    t = _inputs(process_noise=False)
    t["log_decay"] = torch.full_like(t["log_decay"], -1e4)  # a = 0: everything forgotten each step
    t["obs_noise"] = torch.full_like(t["obs_noise"], 1e-6)  # near-exact observations
    o, var, (M, P) = bayes_filter(**t, prior=1e3, output_final_state=True, return_variance=True,
                                  backend="reference")
    assert all(torch.isfinite(x).all() for x in (o, var, M, P))


def test_decoding_steps_equal_the_sequence():
    t = _inputs(B=2, T=5, process_noise=True)
    M0, P0 = _state(2, 2, 8, 6)
    o, var, (M, P) = bayes_filter(**t, initial_state=(M0, P0), output_final_state=True, return_variance=True,
                                  backend="reference")
    state = (M0.clone(), P0.clone())
    M_id = state[0].data_ptr()
    for i in range(5):
        step = {n: x[:, i] for n, x in t.items()}
        o_i, var_i, state = bayes_filter_step(step.pop("q"), step.pop("k"), step.pop("v"), state, **step,
                                              return_variance=True)
        assert rel_err(o_i, o[:, i]) < 1e-12 and rel_err(var_i, var[:, i]) < 1e-12
    assert state[0].data_ptr() == M_id, "the state is updated in place"
    assert rel_err(state[0], M) < 1e-12 and rel_err(state[1], P) < 1e-12


def test_decoding_step_with_autograd_leaves_the_state():
    t = _inputs(B=1, T=1)
    step = {n: x[:, 0] for n, x in t.items()}
    q = step.pop("q").requires_grad_(True)
    state = (torch.zeros(1, 2, 8, 6, dtype=F64), torch.eye(8, dtype=F64).repeat(1, 2, 1, 1))
    o, _, new = bayes_filter_step(q, step.pop("k"), step.pop("v"), state, **step)
    o.sum().backward()
    assert q.grad is not None and new[0] is not state[0] and not state[0].any()


def test_auto_takes_the_delta_form_for_reset(monkeypatch):
    import linmem.ops.bayes as bayes

    calls = []
    monkeypatch.setitem(bayes._BACKENDS, "delta", (lambda inputs: calls.append(1) or bayes.delta_filter(inputs),
                                                   bayes._delta_refusal))
    t = _inputs(process_noise=False)
    bayes_filter(**t, reset=True)
    assert calls == [1]
    bayes_filter(**t, reset=False, backend="delta")  # refused: falls back to the reference, no second call
    assert calls == [1]


@pytest.mark.parametrize("name,change,error,words", [
    ("obs_noise", torch.zeros_like, ValueError, "`obs_noise` must be > 0"),
    ("obs_noise", lambda x: -x, ValueError, "`obs_noise` must be > 0"),
    ("log_decay", lambda x: x.abs() + 0.1, ValueError, "`log_decay` must be <= 0"),
    ("process_noise", lambda x: -x - 1, ValueError, "`process_noise` must be >= 0"),
    ("obs_noise", lambda x: x[..., :1], ValueError, r"`obs_noise` must have shape \[B, T, H\]"),
    ("log_decay", lambda x: None, TypeError, "`log_decay` is required"),
    ("v", lambda x: x.float(), TypeError, "must share one dtype"),
    ("k", lambda x: x[..., :4], ValueError, "`k` must have shape"),
])
def test_bad_inputs_are_named(name, change, error, words):
    t = _inputs()
    t[name] = change(t[name])
    with pytest.raises(error, match=words):
        bayes_filter(**t)


def test_bad_arguments_are_named():
    t = _inputs(B=1)
    with pytest.raises(ValueError, match="`prior`"):
        bayes_filter(**t, prior=0.0)
    with pytest.raises(ValueError, match="unknown `backend`"):
        bayes_filter(**t, backend="fast")
    with pytest.raises(TypeError, match="`initial_state` must be a pair"):
        bayes_filter(**t, initial_state=torch.zeros(1, 2, 8, 6))
    with pytest.raises(ValueError, match=r"`initial_state\[1\] \(P\)` must have shape"):
        bayes_filter(**t, initial_state=(torch.zeros(1, 2, 8, 6, dtype=F64), torch.zeros(1, 2, 8, 6, dtype=F64)))
    with pytest.raises(ValueError, match="`cu_seqlens` must be non-decreasing"):
        bayes_filter(**t, cu_seqlens=torch.tensor([0, 7, 5, 12]))
    with pytest.raises(ValueError, match="`q` must be 3-D"):
        bayes_filter_step(t["q"], t["k"][:, 0], t["v"][:, 0], (None, None), log_decay=t["log_decay"][:, 0],
                          obs_noise=t["obs_noise"][:, 0])
    step = {n: t[n][:, 0] for n in ("q", "k", "v")}
    state = (torch.zeros(1, 2, 8, 6, dtype=F64), torch.eye(8, dtype=F64).repeat(1, 2, 1, 1))
    with pytest.raises(ValueError, match="unknown `backend` 'delta'; valid: auto, reference, triton"):
        bayes_filter_step(**step, state=state, log_decay=t["log_decay"][:, 0], obs_noise=t["obs_noise"][:, 0],
                          backend="delta")
