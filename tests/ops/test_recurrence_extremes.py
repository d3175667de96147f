"""The unified recurrence at the edges of its input range: gates of -inf (forget everything),
non-finite tokens, and the triangular inverse of the delta rule with negative eigenvalues."""

from __future__ import annotations

import functools

import pytest
import torch

from linmem.ops import linear_recurrence
from linmem.ops.recurrence.chunk import unit_lower_inverse
from linmem.ops.recurrence.inputs import LOG_DECAY_FLOOR
from tests.helpers import DECAY_KINDS, RULES, make_inputs, rel_err, run_with_grads
from tests.ops.test_recurrence import FP32_TOL, assert_close

LENGTHS = [70, 0, 45]  # packed: a sequence across a chunk boundary, an empty one, a short one
CASES = [(kind, rule, False) for kind in DECAY_KINDS[1:] for rule in RULES] + [("vector", "additive", True)]


def with_minus_inf_gates(kind, rule, bonus, generator):
    """Packed inputs whose gates are -inf at about 1 token in 10 (the whole head for a constant decay),
    with one finite gate far below the floor."""
    t = make_inputs(kind, rule, bonus, B=1, T=sum(LENGTHS), H=2, K=4, V=3, generator=generator,
                    initial_state=False)
    g = t["log_decay"]
    if kind == "constant":
        g[0] = float("-inf")
    else:
        g[torch.rand(g.shape, generator=generator) < 0.1] = float("-inf")
        g.view(-1)[5] = -3e38
    t["initial_state"] = torch.randn(len(LENGTHS), 2, 4, 3, generator=generator)
    return t


@pytest.mark.parametrize("combo", CASES, ids=lambda c: "-".join(c[:2]) + ("-bonus" if c[2] else ""))
def test_minus_inf_gates_give_the_reference_answer(combo):
    """Every backend equals the reference for gates in [-inf, 0]; gradients are finite, and exactly 0
    at a -inf gate (the reference's exp(g) * dS there)."""
    t = with_minus_inf_gates(*combo, generator=torch.Generator().manual_seed(17))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    results = {backend: run_with_grads(functools.partial(linear_recurrence, cu_seqlens=cu, backend=backend), t)
               for backend in ("reference", "chunk")}
    o_ref, S_ref, g_ref = results["reference"]
    o, S, grads = results["chunk"]
    assert_close("o", o, o_ref, FP32_TOL)
    assert_close("final_state", S, S_ref, FP32_TOL)
    for name in t:
        assert torch.isfinite(g_ref[name]).all(), f"reference d{name} not finite"
        assert_close(f"d{name}", grads[name], g_ref[name], FP32_TOL)
    erased = torch.isinf(t["log_decay"])
    assert bool((g_ref["log_decay"][erased] == 0).all()) and bool((grads["log_decay"][erased] == 0).all())


def test_the_floor_changes_no_per_token_decay():
    """exp is exactly 0 in fp32 at the floor and 6 above it, so clamping changes no decay, also after the
    rounding of the largest cumulative sums a 64-token chunk can hold (every token at the floor)."""
    assert torch.exp(torch.tensor(LOG_DECAY_FLOOR + 6.0)) == 0
    G = torch.full((64,), LOG_DECAY_FLOOR).cumsum(0)
    assert bool((torch.exp(G[1:] - G[:-1]) == 0).all())


def test_a_non_finite_token_leaves_earlier_chunks_finite():
    """A NaN value at token 100 (chunk 1 of the chunk backend): the reference's outputs before it and the
    chunk backend's outputs of chunk 0 stay finite; from the token on every backend is non-finite."""
    t = make_inputs("scalar", "delta", False, B=1, T=160, H=1, K=4, V=3, generator=torch.Generator().manual_seed(2))
    t["v"][0, 100, 0, 1] = float("nan")
    o_ref, _ = linear_recurrence(**t, backend="reference")
    o, _ = linear_recurrence(**t, backend="chunk")
    assert torch.isfinite(o_ref[:, :100]).all() and torch.isfinite(o[:, :64]).all()
    assert rel_err(o[:, :64], o_ref[:, :64]) < FP32_TOL
    assert not torch.isfinite(o_ref[:, 100:]).all(dim=-1).any() and not torch.isfinite(o[:, 100:]).all(dim=-1).any()


@pytest.mark.parametrize("C", [1, 3, 16, 64])
def test_unit_lower_inverse_is_the_inverse_and_stable(C):
    """(I - A)^-1 by doubling blocks equals fp64 LAPACK, also for the delta rule's worst case: parallel keys
    with beta = 2 (A = -2 on every strictly lower entry), whose Neumann series would cancel catastrophically."""
    gen = torch.Generator().manual_seed(C)
    random = torch.randn(3, C, C, generator=gen).tril(-1) * 0.3
    parallel = torch.full((1, C, C), -2.0).tril(-1)
    for A in (random, parallel):
        expected = torch.linalg.inv(torch.eye(C, dtype=torch.float64) - A.double())
        assert rel_err(unit_lower_inverse(A), expected) < 1e-6


def test_unit_lower_inverse_gradient():
    A = torch.randn(1, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).tril(-1)
    assert torch.autograd.gradcheck(lambda x: unit_lower_inverse(x.tril(-1)), (A.requires_grad_(True),))
