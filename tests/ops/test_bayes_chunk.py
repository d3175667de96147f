"""The chunked Bayesian filter (backend "chunk") against the token-loop reference.

Outputs, variances, the final state and the gradient of every input, with and without process noise,
T a multiple of the chunk size or not or shorter than one chunk, an initial state, varlen with an empty
sequence, strong decays; fp64 error ratio < 1e-9, fp32 < 1e-4.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from linmem.ops import bayes_filter
from linmem.ops.bayes.chunk import chunk_filter
from linmem.ops.bayes.inputs import validate
from linmem.ops.bayes.reference import reference_filter
from tests.helpers import rel_err

F64 = torch.float64
NAMES = ("o", "var", "M", "P", "dq", "dk", "dv", "dlog_decay", "dobs_noise", "dprocess_noise", "dM0", "dP0")


def _inputs(B=2, T=12, H=2, K=8, V=6, *, seed=0, dtype=F64, process_noise=True, min_log_decay=None):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    t = dict(q=rnd(B, T, H, K), k=F.normalize(rnd(B, T, H, K), dim=-1), v=rnd(B, T, H, V),
             log_decay=F.logsigmoid(rnd(B, T, H) + 2), obs_noise=F.softplus(rnd(B, T, H)) + 0.05,
             process_noise=0.1 * torch.rand(B, T, H, generator=gen, dtype=F64) if process_noise else None)
    if min_log_decay is not None:  # decays spread down to exp(min_log_decay), the extreme itself included
        t["log_decay"] = min_log_decay * torch.rand(B, T, H, generator=gen, dtype=F64)
        t["log_decay"][:, ::3] = min_log_decay
    return {n: None if x is None else x.to(dtype) for n, x in t.items()}


def _state(N, H=2, K=8, V=6, seed=1, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(N, H, K, K, generator=gen, dtype=F64) / K ** 0.5
    M0 = torch.randn(N, H, K, V, generator=gen, dtype=F64)
    return M0.to(dtype), (A @ A.transpose(-1, -2) + 0.2 * torch.eye(K, dtype=F64)).to(dtype)


def _run(backend, chunk_size, t, state=None, cu_seqlens=None, seed=3):
    """Outputs and every input gradient of a random linear loss of o, var and the final state."""
    leaves = {n: None if x is None else x.detach().clone().requires_grad_(True) for n, x in t.items()}
    if state is not None:
        state = tuple(x.detach().clone().requires_grad_(True) for x in state)
    inputs = validate(**leaves, prior=1.3, reset=False, scale=None, initial_state=state, output_final_state=True,
                      cu_seqlens=cu_seqlens, return_variance=True)
    o, var, (M, P) = chunk_filter(inputs, chunk_size) if backend == "chunk" else reference_filter(inputs)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((x * torch.randn(x.shape, generator=gen, dtype=F64).to(x.dtype)).sum() for x in (o, var, M, P))
    wrt = [leaves[n] for n in ("q", "k", "v", "log_decay", "obs_noise", "process_noise")] + list(state or (None,) * 2)
    present = [x for x in wrt if x is not None]
    grads = iter(torch.autograd.grad(loss, present))
    return [x.detach() for x in (o, var, M, P)] + [None if x is None else next(grads) for x in wrt]


def _assert_equal(got, ref, tol):
    for name, x, y in zip(NAMES, got, ref):
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.isfinite(x).all(), name
            assert rel_err(x, y) < tol, (name, rel_err(x, y))


@pytest.mark.parametrize("T,chunk_size,process_noise,initial", [
    (12, 4, True, False),  # T a multiple of the chunk size
    (13, 5, True, True),  # a shorter last chunk, an initial state
    (13, 5, False, True),  # no process noise
    (7, 64, True, False),  # T shorter than one chunk
])
def test_chunk_equals_reference_fp64(T, chunk_size, process_noise, initial):
    t = _inputs(T=T, process_noise=process_noise)
    state = _state(2) if initial else None
    _assert_equal(_run("chunk", chunk_size, t, state), _run("reference", 0, t, state), 1e-9)


def test_chunk_equals_reference_varlen_with_an_empty_sequence():
    """Sequences of 5, 0 and 17 tokens, each from its own initial state: nothing leaks across a boundary."""
    t = _inputs(B=1, T=22)
    cu = torch.tensor([0, 5, 5, 22])
    state = _state(3)
    got, ref = _run("chunk", 4, t, state, cu), _run("reference", 0, t, state, cu)
    _assert_equal(got, ref, 1e-9)
    assert torch.equal(got[2][1], state[0][1]) and torch.equal(got[3][1], state[1][1])  # the empty one keeps it


def test_chunk_equals_reference_fp32():
    t = _inputs(T=20, dtype=torch.float32)
    state = _state(2, dtype=torch.float32)
    got, ref = _run("chunk", 8, t, state), _run("reference", 0, t, state)
    assert got[0].dtype == torch.float32 and got[3].dtype == torch.float32
    _assert_equal(got, ref, 1e-4)


@pytest.mark.parametrize("process_noise", [False, True])
def test_strong_decays_stay_finite_and_equal(process_noise):
    """log_decay down to -20 (a = 2e-9): the decays across a chunk underflow to 0 without NaN or inf."""
    t = _inputs(T=16, process_noise=process_noise, min_log_decay=-20.0)
    _assert_equal(_run("chunk", 8, t, _state(2)), _run("reference", 0, t, _state(2)), 1e-9)


def test_the_backend_serves_bayes_filter_and_auto_keeps_its_choice(monkeypatch):
    import linmem.ops.bayes as bayes

    t = _inputs(T=9)
    got = bayes_filter(**t, output_final_state=True, return_variance=True, backend="chunk")
    ref = bayes_filter(**t, output_final_state=True, return_variance=True, backend="reference")
    _assert_equal([got[0], got[1], *got[2]], [ref[0], ref[1], *ref[2]], 1e-9)
    calls = []
    monkeypatch.setitem(bayes._BACKENDS, "chunk", (lambda inputs: calls.append(1) or chunk_filter(inputs),
                                                   bayes._chunk_refusal))
    bayes_filter(**t)  # "auto" on the CPU: the reference
    assert calls == []


def test_reset_is_refused(caplog):
    """Named explicitly with reset=True, "chunk" falls back to "delta" (logged) and still equals the reference."""
    t = _inputs(T=9)
    with caplog.at_level(logging.DEBUG, logger="linmem.ops"):
        got = bayes_filter(**t, reset=True, output_final_state=True, return_variance=True, backend="chunk")
    assert "backend 'chunk' cannot serve these inputs (reset=True is the delta rule" in caplog.text
    ref = bayes_filter(**t, reset=True, output_final_state=True, return_variance=True, backend="reference")
    _assert_equal([got[0], got[1], *got[2]], [ref[0], ref[1], *ref[2]], 1e-9)
    inputs = validate(**t, prior=1.0, reset=True, scale=None, initial_state=None, output_final_state=False,
                      cu_seqlens=None, return_variance=False)
    with pytest.raises(ValueError, match="reset=True is the delta rule"):
        chunk_filter(inputs)
    inputs.reset = False
    with pytest.raises(ValueError, match="`chunk_size` must be an int >= 1, got 0"):
        chunk_filter(inputs, 0)
