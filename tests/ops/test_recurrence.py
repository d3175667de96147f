"""The unified recurrence's invariants: every backend equals the reference (outputs, final
states, all gradients), varlen equals one-by-one, and two pieces with `initial_state` equal
one pass."""

from __future__ import annotations

import functools
import zlib

import pytest
import torch

from linmem.ops import linear_recurrence
from linmem.ops.recurrence.chunk import chunk_recurrence
from linmem.ops.recurrence.inputs import validate
from tests.helpers import DECAY_KINDS, RULES, make_inputs, rel_err, run_with_grads

FP32_TOL = 1e-4
COMBOS = [(kind, rule, bonus) for kind in DECAY_KINDS for rule in RULES for bonus in (False, True)]


def combo_id(c):
    kind, rule, bonus = c
    return f"{kind}-{rule}" + ("-bonus" if bonus else "")


def validated(tensors, **kwargs):
    """The RecurrenceInputs of linear_recurrence(**tensors, output_final_state=True, **kwargs)."""
    args = dict(log_decay=None, beta=None, bonus=None, a=None, b=None, initial_state=None, scale=None,
                cu_seqlens=None, output_final_state=True)
    args.update(tensors)
    args.update(kwargs)
    return validate(**args)


def assert_close(name, x, ref, tol):
    assert x is not None and ref is not None, f"{name}: missing"
    assert torch.isfinite(x).all(), f"{name}: non-finite values"
    err = rel_err(x, ref)
    assert err < tol, f"{name}: error ratio {err:.2e} >= {tol:.0e}"


def compare_backends(tensors, backend, tol, **kwargs):
    fn = functools.partial(linear_recurrence, **kwargs)
    o_ref, S_ref, g_ref = run_with_grads(functools.partial(fn, backend="reference"), tensors)
    o, S, g = run_with_grads(functools.partial(fn, backend=backend), tensors)
    assert o.shape == o_ref.shape and o.dtype == tensors["q"].dtype
    assert S.dtype == torch.float32 or tensors["q"].dtype == torch.float64
    assert_close("o", o, o_ref, tol)
    assert_close("final_state", S, S_ref, tol)
    for name in tensors:
        assert_close(f"d{name}", g[name], g_ref[name], tol)


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
@pytest.mark.parametrize("T", [1, 63, 200])
@pytest.mark.parametrize("KV", [(16, 8), (8, 24)], ids=lambda kv: f"K{kv[0]}V{kv[1]}")
def test_chunk_equals_reference(combo, T, KV):
    kind, rule, bonus = combo
    K, V = KV
    gen = torch.Generator().manual_seed(zlib.crc32(repr((combo, T, KV)).encode()))
    tensors = make_inputs(kind, rule, bonus, B=2, T=T, H=2, K=K, V=V, generator=gen)
    compare_backends(tensors, "chunk", FP32_TOL)


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 128])
@pytest.mark.parametrize("combo", [("vector", "delta", False), ("scalar", "dplr", True), ("full", "additive", False)],
                         ids=combo_id)
def test_chunk_size_does_not_change_the_function(combo, chunk_size):
    gen = torch.Generator().manual_seed(chunk_size)
    tensors = make_inputs(*combo, B=1, T=45, H=2, K=8, V=4, generator=gen)
    inputs = validated(tensors)
    o_ref, S_ref = linear_recurrence(**tensors, output_final_state=True, backend="reference")
    o, S = chunk_recurrence(inputs, chunk_size=chunk_size)
    assert_close("o", o, o_ref, FP32_TOL)
    assert_close("final_state", S, S_ref, FP32_TOL)


def _split_time(tensors, start, end):
    out = {}
    for name, x in tensors.items():
        if name in ("bonus", "initial_state") or (name == "log_decay" and x.dim() == 1):
            out[name] = x
        else:
            out[name] = x[:, start:end]
    return out


@pytest.mark.parametrize("backend", ["reference", "chunk"])
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_varlen_equals_one_by_one(combo, backend):
    lengths = [5, 1, 0, 70, 33]
    T = sum(lengths)
    gen = torch.Generator().manual_seed(7)
    packed = make_inputs(*combo, B=1, T=T, H=2, K=8, V=6, generator=gen, initial_state=False)
    N = len(lengths)
    packed["initial_state"] = torch.randn(N, 2, 8, 6, generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    o, S = linear_recurrence(**packed, cu_seqlens=cu, output_final_state=True, backend=backend)
    assert o.shape == (1, T, 2, 6) and S.shape == (N, 2, 8, 6)
    for n in range(N):
        start, end = int(cu[n]), int(cu[n + 1])
        one = _split_time(packed, start, end)
        one["initial_state"] = packed["initial_state"][n : n + 1]
        o_n, S_n = linear_recurrence(**one, output_final_state=True, backend="reference")
        if end > start:
            assert_close(f"o[{n}]", o[:, start:end], o_n, FP32_TOL)
        assert_close(f"S[{n}]", S[n : n + 1], S_n, FP32_TOL)


@pytest.mark.parametrize("backend", ["reference", "chunk"])
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_two_pieces_with_initial_state_equal_one_pass(combo, backend):
    gen = torch.Generator().manual_seed(11)
    tensors = make_inputs(*combo, B=2, T=90, H=2, K=8, V=8, generator=gen)
    o, S = linear_recurrence(**tensors, output_final_state=True, backend=backend)
    first = _split_time(tensors, 0, 37)
    o1, S1 = linear_recurrence(**first, output_final_state=True, backend=backend)
    second = _split_time(tensors, 37, 90)
    second["initial_state"] = S1
    o2, S2 = linear_recurrence(**second, output_final_state=True, backend=backend)
    assert_close("o", torch.cat([o1, o2], dim=1), o, FP32_TOL)
    assert_close("final_state", S2, S, FP32_TOL)


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_gradcheck_chunk_float64(combo):
    kind, rule, bonus = combo
    gen = torch.Generator().manual_seed(3)
    tensors = make_inputs(kind, rule, bonus, B=1, T=5, H=1, K=3, V=2, dtype=torch.float64, generator=gen)
    names = list(tensors)

    def f(*xs):
        return chunk_recurrence(validated(dict(zip(names, xs))), chunk_size=2)

    xs = tuple(tensors[n].clone().requires_grad_(True) for n in names)
    assert torch.autograd.gradcheck(f, xs, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("strength", ["strong", "weak"])
@pytest.mark.parametrize("kind", ["scalar", "vector"])
def test_extreme_gates_long_sequence_are_finite(kind, rule, strength):
    """T = 4096 with decays near 0 (log_decay ~ -60) and near 1 (~ -1e-6): finite outputs and gradients."""
    B, T, H, K, V = 1, 4096, 2, 16, 16
    gen = torch.Generator().manual_seed(5)
    tensors = make_inputs(kind, rule, False, B=B, T=T, H=H, K=K, V=V, generator=gen)
    shape = tensors["log_decay"].shape
    if strength == "strong":
        tensors["log_decay"] = -60.0 * (1 + torch.rand(shape, generator=gen))
    else:
        tensors["log_decay"] = -1e-6 * torch.rand(shape, generator=gen)
    o, S, grads = run_with_grads(functools.partial(linear_recurrence, backend="chunk"), tensors)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    for name, g in grads.items():
        assert g is not None and torch.isfinite(g).all(), f"d{name} not finite"
