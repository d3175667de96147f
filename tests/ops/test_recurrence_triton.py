"""The "triton" backend of the unified recurrence.

Every kernel equals the reference loop: outputs, final states and every input gradient, by
the error ratio ``rms(x - ref) / rms(ref)``. On a machine without CUDA the kernels run on
the CPU through the Triton interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py``
before triton is first imported) at small shapes; ``gpu`` tests repeat the checks at real
shapes on CUDA, with the fp32 bound there too (fp32 inputs' products run as three tf32
products, ``tf32x3``: error ratios near 6e-7 on an H200; one tf32 product would give about 1e-3).

bf16 is measured against the fp32 reference on the same (bf16-rounded) inputs and
cotangents, so the ratio counts only what the kernels lose.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import zlib

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import make_inputs, rel_err, triton_kernels_device

DEVICE = triton_kernels_device()

from linmem.ops import available_backends, linear_recurrence, linear_recurrence_step  # noqa: E402

if "triton" not in available_backends():
    pytest.skip("the triton backend is not registered", allow_module_level=True)

from linmem.ops import triton_launch  # noqa: E402
from linmem.ops.recurrence.triton import configs, cumsum, launch, numerics, pipeline  # noqa: E402
from linmem.ops.recurrence.triton.switches import Decay  # noqa: E402

FP32_TOL = 1e-4
LOW_TOL = 5e-3  # bf16 / fp16 against the fp32 reference
KINDS = ("none", "constant", "scalar", "vector")
COMBOS = [(kind, rule, bonus) for kind in KINDS for rule, bonus in (("additive", False), ("additive", True),
                                                                    ("delta", False))]


@pytest.fixture
def settings():
    """``settings(NAME=value, ...)`` changes launch settings (``configs.override``) for the rest of the test."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(configs.override(**changes))


def combo_id(c):
    kind, rule, bonus = c
    return f"{kind}-{rule}" + ("-bonus" if bonus else "")


def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def run(backend, tensors, do, dS, **kwargs):
    """Outputs and every input gradient of sum(o * do) + sum(S * dS) (cotangents cast to o's dtype)."""
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in tensors.items()}
    o, S = linear_recurrence(**leaves, output_final_state=True, backend=backend, **kwargs)
    loss = (o.float() * do.to(o.dtype).float()).sum() + (S * dS).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return o.detach(), S.detach(), dict(zip(leaves, grads))


def compare(tensors, tol, **kwargs):
    """The triton backend on ``tensors`` against the fp32 (fp64 for fp32 inputs) reference."""
    gen = seeded("cotangents", sorted(tensors))
    device = tensors["q"].device
    o_shape = (*tensors["v"].shape[:-1], tensors["v"].shape[-1])
    do = torch.randn(o_shape, generator=gen).to(tensors["q"].dtype).to(device)
    N = tensors["initial_state"].shape[0] if "initial_state" in tensors else o_shape[0]
    if "cu_seqlens" in kwargs:
        N = kwargs["cu_seqlens"].shape[0] - 1
    K, V = tensors["q"].shape[-1], tensors["v"].shape[-1]
    dS = torch.randn(N, o_shape[2], K, V, generator=gen).to(device)
    ref_dtype = torch.float64 if tensors["q"].dtype == torch.float32 else torch.float32
    ref = {n: x.to(ref_dtype) for n, x in tensors.items()}
    o_ref, S_ref, g_ref = run("reference", ref, do.to(ref_dtype), dS.to(ref_dtype), **kwargs)
    o, S, g = run("triton", tensors, do, dS, **kwargs)
    assert o.dtype == tensors["q"].dtype and S.dtype == torch.float32
    errors = {"o": rel_err(o, o_ref), "final_state": rel_err(S, S_ref)}
    errors.update({f"d{n}": rel_err(g[n], g_ref[n]) for n in tensors})
    for name, err in errors.items():
        assert err < tol, f"{name}: error ratio {err:.2e} >= {tol:.0e} (all: {errors})"
    for name, x in (("o", o), ("final_state", S), *((f"d{n}", g[n]) for n in tensors)):
        assert torch.isfinite(x).all(), f"{name}: non-finite values"
    return errors


def inputs(combo, B, T, H, K, V, dtype=torch.float32, initial_state=True):
    kind, rule, bonus = combo
    t = make_inputs(kind, rule, bonus, B=B, T=T, H=H, K=K, V=V, dtype=dtype, initial_state=initial_state,
                    generator=seeded(combo, B, T, H, K, V, str(dtype)))
    return {n: x.to(DEVICE) for n, x in t.items()}


def packed(combo, lengths, H, K, V, dtype=torch.float32):
    """Inputs of sequences of these lengths packed along T (B = 1), each with an initial state, and their
    ``cu_seqlens``."""
    t = inputs(combo, B=1, T=sum(lengths), H=H, K=K, V=V, dtype=dtype, initial_state=False)
    t["initial_state"] = torch.randn(len(lengths), H, K, V, generator=seeded("h0")).to(DEVICE)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return t, cu


def launch_both(t: dict, decay: int, do: torch.Tensor, cu_seqlens=None) -> tuple:
    """One forward+backward of the inputs ``t`` (as ``linmem.bench.ops.memory_inputs`` makes them) through the
    launchers alone, without autograd: (o, dq, dk, dv, dg, dbeta, du)."""
    q, k, v = (t[n].detach() for n in "qkv")
    g = t["log_decay"].detach().float().contiguous() if "log_decay" in t else None
    beta, u = t.get("beta"), t.get("bonus")
    scale = q.shape[-1] ** -0.5
    o, _, saved = pipeline.chunk_forward(q, k, v, g, beta, u, None, cu_seqlens, scale, decay, False)
    return (o, *pipeline.chunk_backward(q, k, v, beta, u, None, cu_seqlens, saved, do, None, scale, decay)[:6])


# ---------------------------------------------------------------- CPU (interpreter) and GPU, small shapes


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_triton_equals_reference(combo):
    """Two sequences, a full and a partial chunk, K != V."""
    compare(inputs(combo, B=2, T=80, H=1, K=16, V=24), FP32_TOL)


@pytest.mark.parametrize("T", [1, 63])
@pytest.mark.parametrize("combo", [("vector", "delta", False), ("scalar", "additive", True)], ids=combo_id)
def test_odd_lengths(combo, T):
    compare(inputs(combo, B=1, T=T, H=2, K=16, V=16), FP32_TOL)


def test_per_channel_delta_rule_over_several_value_blocks():
    """V = 96, two V blocks of 64 (the last 32 columns masked): with a per-channel decay, the delta rule's
    output kernel stores q e^G (qg) from its first V block and the second reads it back; state_bwd reads it
    for every V block."""
    assert configs.Shapes(T=70, TT=70, N=1, H=1, K=16, V=96, varlen=False).BV == 64
    compare(inputs(("vector", "delta", False), B=1, T=70, H=1, K=16, V=96), FP32_TOL)


@pytest.mark.parametrize("combo", [("vector", "delta", False), ("vector", "additive", True),
                                   ("scalar", "additive", False), ("scalar", "delta", False)], ids=combo_id)
def test_several_key_blocks_and_odd_head_dims(combo):
    """K = 80 spans two key blocks of 64 (of which intra_grads_kernel and dv_kernel mask the last 48
    columns), three of 32 (the per-channel delta rule's wy_grads_kernel) and one of 128 with its last 48
    columns masked (the scalar decays' gradient kernel); V = 40 is no power of two; no initial state."""
    compare(inputs(combo, B=1, T=70, H=1, K=80, V=40, initial_state=False), FP32_TOL)


@pytest.mark.parametrize("combo, varlen", [(("scalar", "delta", False), False), (("scalar", "delta", False), True),
                                           (("scalar", "additive", True), False), (("none", "delta", False), False)],
                         ids=lambda x: combo_id(x) if isinstance(x, tuple) else ("varlen" if x else "fixed"))
def test_gradient_key_blocks_on_the_grid(combo, varlen):
    """bf16 at K = 80: ``grads_kernel`` runs one program per key block of 64 (``configs.key_grid``), the second
    block masked to 16 columns; a scalar decay's gate gradient arrives as one part per block (the delta rule's
    WY part in the first), which the launcher sums (packed sequences: parts of all tokens, idle slots between)."""
    decay = Decay.of(combo[0])
    assert configs.key_grid(decay, combo[2], torch.bfloat16)
    assert configs.Shapes(T=70, TT=70, N=1, H=1, K=80, V=40, varlen=False).grads_BK(decay, True) == 64
    if varlen:
        t, cu = packed(combo, [5, 0, 70, 1, 33], H=1, K=80, V=40, dtype=torch.bfloat16)
        compare(t, LOW_TOL, cu_seqlens=cu)
    else:
        compare(inputs(combo, B=1, T=70, H=1, K=80, V=40, dtype=torch.bfloat16), LOW_TOL)


@pytest.mark.parametrize("combo", [("vector", "additive", True), ("scalar", "additive", False),
                                   ("none", "additive", False)], ids=combo_id)
def test_value_blocks_past_64(combo):
    """V = 96: the decayed additive rules' dv_kernel takes it as one V block of 128 with its last 32
    columns masked (``Shapes.dv_BV``), the undecayed rule as two blocks of 64."""
    assert configs.Shapes(T=70, TT=70, N=1, H=1, K=16, V=96, varlen=False).dv_BV(int(combo[0] != "none")) == (
        128 if combo[0] != "none" else 64)
    compare(inputs(combo, B=1, T=70, H=1, K=16, V=96), FP32_TOL)


@pytest.mark.parametrize("combo", [("vector", "delta", False), ("vector", "additive", True),
                                   ("scalar", "additive", True)], ids=combo_id)
def test_varlen_equals_reference(combo):
    """Packed sequences of lengths 5, 0, 70, 1, 33: an empty one, partial chunks, idle slots (and, with
    the bonus and per-channel decays, the shifted reads of intra_grads_kernel and dv_kernel)."""
    t, cu = packed(combo, [5, 0, 70, 1, 33], H=1, K=16, V=16)
    compare(t, FP32_TOL, cu_seqlens=cu)


@pytest.mark.parametrize("block_span", [64, -1], ids=["block-products", "pairwise"])
@pytest.mark.parametrize("combo", [("vector", "delta", False), ("vector", "additive", True)], ids=combo_id)
def test_bf16_per_channel_chunks_past_one_reference(combo, block_span, settings):
    """bf16 inputs through the per-channel paths of chunks whose gates fall past CHUNK_SPAN (block products,
    or pairwise loops with BLOCK_SPAN negative), whose products and pairwise loops read the bf16 dA and dL widened.
    (With dL's pairwise coefficients left bf16, the interpreter multiplied bf16 bit patterns: dk NaN here.)"""
    settings(CHUNK_SPAN=-1)
    settings(BLOCK_SPAN=block_span)
    compare(inputs(combo, B=1, T=130, H=1, K=32, V=16, dtype=torch.bfloat16), LOW_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("combo", [("vector", "delta", False), ("vector", "additive", True), ("none", "delta", False),
                                   ("scalar", "delta", False)], ids=combo_id)
def test_half_against_fp32_reference(combo, dtype):
    """bf16 and fp16 inputs, so the intermediates stored in their dtype (dA; the delta rule's d, dd, Y, W^T and dL)
    and the products that read them run (in bf16 or fp16, or in tf32 on a per-channel decay's dA and dL, or on a bf16
    dA with the other operand in two bf16 parts, ``numerics.mm_wide``); the delta
    rule's W and U as split bf16 products, on fp16 keys and values split in two bf16 parts."""
    compare(inputs(combo, B=1, T=130, H=1, K=32, V=16, dtype=dtype), LOW_TOL)


@pytest.mark.parametrize("combo", [("none", "delta", False), ("scalar", "delta", False), ("vector", "delta", False)],
                         ids=combo_id)
def test_four_state_tiles(combo, settings):
    """The delta rule's sequential passes with the state as four tiles of 16 key rows (K = 56: the last
    tile is masked to 8 rows), as K = 256 runs them at tiles of 64."""
    settings(STATE_KB=16)
    t = inputs(combo, B=1, T=70, H=1, K=56, V=24)
    assert configs.shapes_of(t["q"], t["v"], None).state_KB(True) == 16
    compare(t, FP32_TOL)


def test_split_products_keep_sixteen_bits():
    """``numerics.mm_split`` and ``numerics.mm_parts`` (an fp32 left factor as its bf16 part plus the bf16 rounding of
    its remainder, ``numerics.bf16_parts``, times a bf16 right factor) keep about 16 of the fp32 factor's mantissa
    bits: within 2^-14 of the float64 product, where rounding the factor to bf16 alone (no remainder) misses by
    about 2^-9."""
    import triton
    import triton.language as tl

    @triton.jit
    def products(a_ptr, b_ptr, split_ptr, parts_ptr, N: tl.constexpr):
        r = tl.arange(0, N)
        a = tl.load(a_ptr + r[:, None] * N + r[None, :])
        b = tl.load(b_ptr + r[:, None] * N + r[None, :])
        tl.store(split_ptr + r[:, None] * N + r[None, :], numerics.mm_split(a, b))
        ah, al = numerics.bf16_parts(a)
        tl.store(parts_ptr + r[:, None] * N + r[None, :], numerics.mm_parts(ah, al, b))

    n = 64
    gen = seeded("split")
    a = torch.randn(n, n, generator=gen).to(DEVICE)
    b = torch.randn(n, n, generator=gen).to(DEVICE, torch.bfloat16)
    split, parts = torch.empty(n, n, device=DEVICE), torch.empty(n, n, device=DEVICE)
    products[(1,)](a, b, split, parts, N=n)
    exact = a.double() @ b.double()
    assert rel_err(split, exact) < 2 ** -14
    assert rel_err(parts, exact) < 2 ** -14
    assert rel_err(a.bfloat16().double() @ b.double(), exact) > 2 ** -11  # what the remainder adds back
    assert torch.allclose(split, parts, rtol=0, atol=1e-5)


def test_host_size_helpers_equal_tritons():
    """configs.pow2 and configs.cdiv (plain integers, for host time) give what triton.next_power_of_2 and
    triton.cdiv give, on every size a launch may ask of them."""
    import triton

    for n in range(0, 1100):
        assert configs.pow2(n) == max(16, triton.next_power_of_2(n)), n
    for a in range(0, 5000, 7):
        for b in (1, 16, 32, 64, 128, 256):
            assert configs.cdiv(a, b) == triton.cdiv(a, b), (a, b)


@pytest.mark.skipif(DEVICE != "cpu", reason="sets the SM count the interpreter assumes")
@pytest.mark.parametrize("sms", [1, 1000], ids=["wide-grid", "narrow-grid"])
def test_both_state_blocks(sms, settings):
    """The sequential passes take the V blocks of ``configs.SEQUENTIAL`` while their grid fills the SMs (64
    forward, 32 backward for the delta rule: V = 40 leaves 24 and 8 columns masked), else blocks of 16."""
    settings(INTERPRETER_SMS=sms)
    t = inputs(("scalar", "delta", False), B=1, T=70, H=1, K=16, V=40)
    s, dev = configs.shapes_of(t["q"], t["v"], None), t["q"].device
    blocks = (configs.sequential_config("state_fwd", s, True, Decay.SCALAR, dev)[0],
              configs.sequential_config("state_bwd", s, True, Decay.SCALAR, dev)[0])
    assert blocks == ((64, 32) if sms == 1 else (16, 16))
    compare(t, FP32_TOL)


@pytest.mark.skipif(DEVICE != "cpu", reason="sets the SM count the interpreter assumes")
@pytest.mark.parametrize("kind", ["none", "scalar", "vector"])
def test_delta_rule_bf16_factors_on_a_wide_grid(kind, settings):
    """bf16 inputs on a grid that fills at least half the SMs, K <= 128: the delta rule's W and U are bf16 and the
    forward pass splits its products (``configs.factors_dtype``, ``numerics.mm_split``) and, except with a per-channel
    decay, reads W from its transposed copy (``configs.W_READ_TRANSPOSED``); two V blocks, the second partly
    masked. On a narrower grid only the rules of ``configs.NARROW_BF16_FACTORS`` keep bf16 factors."""
    settings(INTERPRETER_SMS=1)
    t = inputs((kind, "delta", False), B=2, T=100, H=2, K=32, V=80, dtype=torch.bfloat16)
    s, dev = configs.shapes_of(t["q"], t["v"], None), t["q"].device
    assert configs.factors_dtype(s, torch.bfloat16, Decay.of(kind), dev) == torch.bfloat16
    assert configs.factors_dtype(s, torch.float16, Decay.of(kind), dev) == torch.float32
    wide_256 = configs.Shapes(T=100, TT=200, N=2, H=2, K=256, V=80, varlen=False)  # four state tiles: fp32
    assert configs.factors_dtype(wide_256, torch.bfloat16, Decay.of(kind), dev) == torch.float32
    programs = 2 * 2 * 2  # V blocks of 64 x sequences x heads
    settings(INTERPRETER_SMS=2 * programs)  # half the SMs filled: still bf16
    assert configs.factors_dtype(s, torch.bfloat16, Decay.of(kind), dev) == torch.bfloat16
    settings(INTERPRETER_SMS=2 * programs + 1)
    narrow = Decay.of(kind) in configs.NARROW_BF16_FACTORS
    assert configs.factors_dtype(s, torch.bfloat16, Decay.of(kind), dev) == (
        torch.bfloat16 if narrow else torch.float32)
    settings(INTERPRETER_SMS=1)
    compare(t, LOW_TOL)


@pytest.mark.skipif(DEVICE != "cpu", reason="sets the SM count the interpreter assumes")
@pytest.mark.parametrize("kind", ["none", "scalar"])
def test_delta_rule_bf16_factors_on_a_narrow_grid(kind, settings):
    """bf16 inputs on a grid narrower than half the SMs, no or a scalar decay (``configs.NARROW_BF16_FACTORS``):
    bf16 W and U, read transposed, with W h split and k^T d one tf32 product (``state_fwd_kernel``'s NARROW);
    several chunks, two V blocks."""
    settings(INTERPRETER_SMS=1000)
    t = inputs((kind, "delta", False), B=2, T=100, H=2, K=32, V=80, dtype=torch.bfloat16)
    s, dev = configs.shapes_of(t["q"], t["v"], None), t["q"].device
    assert configs.factors_dtype(s, torch.bfloat16, Decay.of(kind), dev) == torch.bfloat16
    assert not configs.fills_half(s, Decay.of(kind), dev)
    compare(t, LOW_TOL)


@pytest.mark.skipif(DEVICE != "cpu", reason="sets the SM count the interpreter assumes")
@pytest.mark.parametrize("sms", [1, 1000], ids=["wide", "narrow"])
def test_delta_rule_bf16_factors_varlen(sms, settings):
    """The same on packed sequences (lengths 5, 0, 70, 1, 33): bf16 factors with empty and partial chunks, on a
    wide and a narrow grid."""
    settings(INTERPRETER_SMS=sms)
    t, cu = packed(("scalar", "delta", False), [5, 0, 70, 1, 33], H=2, K=16, V=16, dtype=torch.bfloat16)
    s = configs.shapes_of(t["q"], t["v"], cu)
    assert configs.factors_dtype(s, torch.bfloat16, Decay.SCALAR, t["q"].device) == torch.bfloat16
    compare(t, LOW_TOL, cu_seqlens=cu)


@pytest.mark.parametrize("kind", ["none", "scalar", "vector"])
def test_wy_part_inside_score_grads_equals_two_kernels(kind, settings):
    """bf16, every decay kind: ``score_grads_kernel`` runs ``wy_grads_kernel``'s part itself
    (``configs.WY_FUSED``), on Y and dL read back as it stored them; every output and gradient equals the two
    kernels' bit for bit (two key blocks, the second partly masked; an odd length)."""
    assert Decay.of(kind) in configs.WY_FUSED
    t = inputs((kind, "delta", False), B=1, T=130, H=2, K=80, V=48, dtype=torch.bfloat16)
    gen = seeded("cotangents", kind)
    do = torch.randn(1, 130, 2, 48, generator=gen).to(torch.bfloat16).to(DEVICE)
    dS = torch.randn(1, 2, 80, 48, generator=gen).to(DEVICE)
    o, S, g = run("triton", t, do, dS)
    settings(WY_FUSED=())
    o2, S2, g2 = run("triton", t, do, dS)
    assert torch.equal(o, o2) and torch.equal(S, S2)
    for name in t:
        assert torch.equal(g[name], g2[name]), f"d{name} differs"


@pytest.mark.parametrize("case", ["vector-delta", "scalar-additive-bonus", "none-delta", "packed"])
def test_planned_calls_equal_the_reference(case, monkeypatch):
    """A call that runs from its launch plans (``launch.plan_for``: no config search) equals the reference on its
    output, final state and every gradient, as the first call with that key did."""
    searches = []
    real_fitting = launch._launch_fitting

    def fitting(name, *rest):
        searches.append(name)
        return real_fitting(name, *rest)

    monkeypatch.setattr(launch, "_launch_fitting", fitting)
    launch._PLANS.clear()
    if case == "packed":
        t, cu = packed(("vector", "delta", False), [20, 45, 1, 64], H=2, K=32, V=32)
        kwargs = {"cu_seqlens": cu}
    else:
        kind, rule, *bonus = case.split("-")
        t, kwargs = inputs((kind, rule, bool(bonus)), B=2, T=70, H=2, K=32, V=32), {}
    compare(t, FP32_TOL, **kwargs)
    assert searches
    searches.clear()
    compare(t, FP32_TOL, **kwargs)
    assert searches == []


def _misaligned(x: torch.Tensor) -> torch.Tensor:
    """A copy of x whose address is one element past a 16-byte boundary (contiguous, same shape)."""
    y = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view(x.shape)
    assert y.data_ptr() % 16
    return y.copy_(x)


@pytest.mark.parametrize("op, dtype", [("gla", torch.float32), ("gated_deltanet", torch.bfloat16),
                                       ("deltanet", torch.float32)], ids=str)
def test_plans_key_every_launch(op, dtype, monkeypatch, settings):
    """A launcher call's plan (``launch.plan_for``) is keyed on everything its launches depend on. Under one key each
    kernel (told apart by its constexprs) meets one specialization of its arguments (``triton_launch._arg_key``:
    alignment, integers) at one config; the second call with the key runs from the plan (no config search) and
    gives the same bits; a misaligned input, packed sequences or a changed setting make another key. On CUDA every
    planned launch passes the compiled kernel that the dispatcher's own key names."""
    from linmem.bench.ops import memory_inputs

    plans, seen, searches = [], {}, []
    real_plan, real_run, real_fitting = launch.plan_for, launch.run_kernel, launch._launch_fitting

    def plan(*parts):
        plans.append(real_plan(*parts))
        return plans[-1]

    def run(kernel, grid, args, constexprs, warps, stages, maxnreg=None, compiled=None):
        if compiled is not None:
            key = triton_launch._cache_key(kernel, args, constexprs, warps, stages, maxnreg)
            assert compiled is triton_launch._COMPILED[key]
        spec = (triton_launch._arg_key(args), warps, stages, maxnreg)
        assert seen.setdefault((id(plans[-1]), kernel.__name__, *constexprs.items()), spec) == spec
        return real_run(kernel, grid, args, constexprs, warps, stages, maxnreg, compiled)

    def fitting(name, *rest):
        searches.append(name)
        return real_fitting(name, *rest)

    monkeypatch.setattr(pipeline, "plan_for", plan)
    monkeypatch.setattr(launch, "run_kernel", run)
    monkeypatch.setattr(launch, "_launch_fitting", fitting)
    launch._PLANS.clear()
    t = memory_inputs(op, 1, 130, 2, 32, dtype, DEVICE)
    do = torch.randn(t["v"].shape, generator=seeded("plans", op)).to(DEVICE, dtype)
    decay = Decay.of({"gla": "vector", "gated_deltanet": "scalar", "deltanet": "none"}[op])
    first = launch_both(t, decay, do)
    keys = list(plans)
    assert len(keys) == 2 and len(searches) >= 6  # the forward's plan and the backward's, each launch searched
    searches.clear()
    again = launch_both(t, decay, do)
    assert plans[2] is keys[0] and plans[3] is keys[1] and searches == []
    for a, b in zip(first, again):
        assert a is None and b is None or torch.equal(a, b)
    shifted = launch_both({**t, "q": _misaligned(t["q"])}, decay, do)
    assert plans[4] is not keys[0] and plans[5] is not keys[1] and searches
    for a, b in zip(first, shifted):
        assert a is None and b is None or torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    launch_both(t, decay, do, torch.tensor([0, 22, 65, 130], dtype=torch.int32, device=DEVICE))
    output = "output_vector" if op == "gla" else "output"
    settings(LAUNCH={output: (2, 1)})
    searches.clear()
    launch_both(t, decay, do)
    assert all(p is not k for p in plans[-2:] for k in keys) and output in searches
    assert len(launch._PLANS) == 2  # a changed setting dropped the plans of the aligned, misaligned, packed calls


def test_kernels_call_no_jit_helper_of_triton_language():
    """The kernels call Triton builtins only: the jit helpers of ``triton.language`` (tl.zeros, tl.sum, ...) are
    fixed when triton is imported, so where triton was imported before TRITON_INTERPRET=1 (the full CPU suite),
    the interpreter refuses them inside a kernel (``numerics.total`` spells tl.sum with builtins for this)."""
    import pathlib
    import re

    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    helpers = {name for name in dir(tl) if isinstance(getattr(tl, name), (JITFunction, InterpretedFunction))}
    assert "zeros" in helpers  # what this test guards against
    called = {}
    for path in pathlib.Path(numerics.__file__).parent.glob("*.py"):
        for name in set(re.findall(r"\btl\.(\w+)\(", path.read_text())) & helpers:
            called.setdefault(name, []).append(path.name)
    assert not called, f"jit helpers of triton.language called in the kernels: {called}"


def test_launch_drops_stages_until_they_fit(caplog, settings):
    """A config whose pipelining exceeds shared memory runs with one stage fewer at a time (the debug log
    says so), and later launches of it start at the stages that fitted."""
    from triton.runtime.errors import OutOfResources

    calls = []

    class Kernel:  # needs 3 stages' worth of shared memory less than configured
        def __getitem__(self, grid):
            def run(*args, num_warps, num_stages, **constexprs):
                calls.append(num_stages)
                if num_stages > 2:
                    raise OutOfResources(300000, 232448, "shared memory")
            return run

    settings(LAUNCH={"fake": (4, 4)})
    with caplog.at_level(logging.DEBUG, logger="linmem.ops"):
        launch.launch_kernel({}, "fake", Kernel(), (1,), torch.zeros(1), X=1)
    launch.launch_kernel({}, "fake", Kernel(), (1,), torch.zeros(1), X=1)  # another call's plan: the fitting is kept
    assert calls == [4, 3, 2, 2]
    assert "fake with 4 stages does not fit" in caplog.text


@pytest.mark.skipif(DEVICE != "cpu", reason="sets the SM count the interpreter assumes")
def test_sequential_pass_narrows_before_one_stage(caplog, settings):
    """A sequential pass whose config does not fit drops stages down to 2, then halves its V block at 2 stages,
    and runs 1 stage (at its own V block) only when no V block fits 2; later launches start at what fitted."""
    from triton.runtime.errors import OutOfResources

    assert launch._sequential_fallbacks(32, 3) == [(32, 3), (32, 2), (16, 2), (32, 1)]
    assert launch._sequential_fallbacks(64, 2) == [(64, 2), (32, 2), (16, 2), (64, 1)]
    settings(INTERPRETER_SMS=1)  # a wide grid: the configured (V block, stages)
    settings(SEQUENTIAL={("state_bwd", True, Decay.SCALAR): (32, 3)})
    s = configs.Shapes(T=64, TT=64, N=1, H=2, K=256, V=64, varlen=False)

    def kernel(fits):
        calls = []

        class Kernel:
            def __getitem__(self, grid):
                def run(*args, BV, num_warps, num_stages, **constexprs):
                    calls.append((grid[0], BV, num_stages))
                    if not fits(BV, num_stages):
                        raise OutOfResources(300000, 232448, "shared memory")
                return run
        return Kernel(), calls

    narrow, calls = kernel(lambda bv, stages: bv * stages <= 32)
    with caplog.at_level(logging.DEBUG, logger="linmem.ops"):
        launch.launch_sequential({}, "state_bwd", narrow, s, True, Decay.SCALAR, torch.zeros(1), X=1)
    launch.launch_sequential({}, "state_bwd", narrow, s, True, Decay.SCALAR, torch.zeros(1), X=1)
    assert calls == [(2, 32, 3), (2, 32, 2), (4, 16, 2), (4, 16, 2)]  # grid: V blocks of the V block tried
    assert "state_bwd at V block 32, 2 stages does not fit" in caplog.text
    one_stage, calls = kernel(lambda bv, stages: stages == 1)
    launch.launch_sequential({}, "state_bwd", one_stage, s, True, Decay.SCALAR, torch.zeros(1), X=2)
    assert calls == [(2, 32, 3), (2, 32, 2), (4, 16, 2), (2, 32, 1)]


@pytest.mark.skipif(DEVICE != "cpu", reason="sets the SM count the interpreter assumes")
@pytest.mark.parametrize("sms, forward, backward", [(60, (64, 2), (32, 3)), (100, (64, 3), (32, 3)),
                                                    (200, (32, 3), (32, 3)), (300, (16, 3), (16, 3))])
def test_sequential_grid_classes(sms, forward, backward, settings):
    """N * H = 32, V = 128: 64 programs at V block 64, 128 at 32, 256 at 16. A grid of at least one program
    per SM takes ``configs.SEQUENTIAL`` (GLA's forward: 64, 2 stages); a smaller one ``NARROW_STAGES`` and
    halves the V block while it fills less than half the SMs (the delta rule's backward starts at 32)."""
    settings(INTERPRETER_SMS=sms)
    s, cpu = configs.Shapes(T=64, TT=128, N=2, H=16, K=64, V=128, varlen=False), torch.device("cpu")
    assert configs.sequential_config("state_fwd", s, False, Decay.CHANNEL, cpu) == forward
    assert configs.sequential_config("state_bwd", s, True, Decay.NONE, cpu) == backward


@pytest.mark.parametrize("sub", [4, 8, 16, 32])
@pytest.mark.parametrize("combo", [("vector", "delta", False), ("vector", "additive", True)], ids=combo_id)
def test_pairwise_sub_blocks(combo, sub, settings):
    """Per-channel decays: pairwise inside sub-blocks of any size, through reference points across them
    (T = 70: a full chunk and a partial one that ends inside a sub-block). Negative CHUNK_SPAN and BLOCK_SPAN
    send every chunk to these loops (the mild gates here would otherwise take one reference per chunk)."""
    settings(PAIR_SUB=sub)
    settings(CHUNK_SPAN=-1)
    settings(BLOCK_SPAN=-1)
    compare(inputs(combo, B=1, T=70, H=1, K=16, V=16), FP32_TOL)


@pytest.mark.parametrize("combo", [c for c in COMBOS if c[0] == "vector"], ids=combo_id)
def test_block_products(combo, settings):
    """Per-channel decays through the reference points of blocks of 16 rows, with no pairwise exponential
    (``scores._block_scores``, the block path of ``intra_grads_kernel``, and the delta rule's WY gradients through
    ``scores._block_rows`` and ``_block_cols``): a negative CHUNK_SPAN sends every chunk there (T = 70: a partial
    chunk that ends inside a block)."""
    settings(CHUNK_SPAN=-1)
    compare(inputs(combo, B=1, T=70, H=1, K=16, V=16), FP32_TOL)


@pytest.mark.parametrize("combo", [("vector", "delta", False), ("vector", "additive", True),
                                   ("vector", "additive", False)], ids=combo_id)
def test_three_paths_in_one_call(combo):
    """Per-channel decays choose their path per chunk (the forward's scores, and whether the backward's
    intra-chunk gradients need intra_grads_kernel), then per block of rows and key channels (intra_grads_kernel):
    - gates falling by at most 2^-CHUNK_SPAN over a chunk split at the chunk's start (one product);
    - else by at most 2^-BLOCK_SPAN inside every block of 16 rows, at the blocks' starts (block products);
    - else pairwise.
    K = 80 (key blocks of 64 and 16). The first and last chunks have the mild default gates (one product). The
    second one's key channels 64-79 decay by e^-6 per token (2^-138 over 16 rows): its scores run pairwise, and
    its intra_grads_kernel programs pairwise at those channels, by block products at the others. The third
    one's channels 0-15 decay by e^-0.9 per token (2^-83 over the chunk, 2^-21 over 16 rows): block products."""
    t = inputs(combo, B=1, T=200, H=1, K=80, V=16)
    t["log_decay"][:, 64:128, :, 64:] = -6.0
    t["log_decay"][:, 128:192, :, :16] = -0.9
    compare(t, FP32_TOL)


@pytest.mark.parametrize("combo", [("vector", "delta", False), ("vector", "additive", True)], ids=combo_id)
def test_extreme_per_channel_gates_equal_the_reference(combo):
    """Log decays of -60 to -120 per token: the cross-sub-block factors underflow to exactly 0, never
    to inf or NaN, and the outputs and gradients still match the reference. The gate gradient is
    then ~1e-27 in exact arithmetic, a cancellation of terms of size ~1 (q dq - k dk), so it is
    held to fp32 rounding of those terms instead of a ratio."""
    t = inputs(combo, B=1, T=70, H=1, K=16, V=16)
    t["log_decay"] = -60.0 * (1 + torch.rand(t["log_decay"].shape, generator=seeded("extreme"))).to(DEVICE)
    gen = seeded("extreme cotangents")
    do = torch.randn(t["v"].shape, generator=gen).to(DEVICE)
    dS = torch.randn(1, 1, 16, 16, generator=gen).to(DEVICE)
    o_ref, S_ref, g_ref = run("reference", {n: x.double() for n, x in t.items()}, do.double(), dS.double())
    o, S, g = run("triton", t, do, dS)
    assert rel_err(o, o_ref) < FP32_TOL and rel_err(S, S_ref) < FP32_TOL
    for name in t:
        assert torch.isfinite(g[name]).all(), name
        if name == "log_decay":
            assert (g[name].double() - g_ref[name]).abs().max() < 1e-5
        else:
            assert rel_err(g[name], g_ref[name]) < FP32_TOL, name


@pytest.mark.parametrize("combo", [c for c in COMBOS if c[1] == "delta"], ids=combo_id)
def test_correlated_keys_and_beta_near_two_equal_the_reference(combo):
    """Keys near one direction and beta in (1.9, 2) (the delta rule with negative eigenvalues): the chunk's
    (I + L)^-1 keeps entries of order 1 while the powers of L grow. An inverse that forms those powers (the
    nilpotent series, ``dev/kernels/wy_inverse_accuracy.py``) loses T to their cancellation: error ratios 3.7e-3 to
    3.9e-2 here without a decay or with a scalar one."""
    t = inputs(combo, B=1, T=128, H=1, K=16, V=16)
    gen = seeded("correlated keys", combo)
    direction = torch.randn(16, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 128, 1, 1, generator=gen, dtype=torch.float64) * direction
    t["k"] = F.normalize(k + 0.05 * torch.randn(k.shape, generator=gen, dtype=torch.float64), dim=-1).float().to(DEVICE)
    t["beta"] = (1.9 + 0.1 * torch.rand(1, 128, 1, generator=gen)).to(DEVICE)
    compare(t, FP32_TOL)


def test_gradients_when_only_the_output_is_used():
    """No initial state, no final state: the backward runs without a state gradient."""
    t = inputs(("scalar", "delta", False), B=1, T=70, H=1, K=16, V=16, initial_state=False)
    do = torch.randn(t["v"].shape, generator=seeded("do")).to(DEVICE)
    grads = {}
    for backend in ("reference", "triton"):
        leaves = {n: x.detach().clone().requires_grad_(True) for n, x in t.items()}
        o, S = linear_recurrence(**leaves, backend=backend)
        assert S is None
        grads[backend] = torch.autograd.grad((o * do).sum(), list(leaves.values()))
    for name, g, g_ref in zip(t, grads["triton"], grads["reference"]):
        assert rel_err(g, g_ref) < FP32_TOL, name


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while ``fn`` runs."""
    seen = {}

    def pack(x):
        seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return sum(seen.values())


#: GLA-like per-channel decay, RWKV-6, scalar decay, DeltaNet, Gated DeltaNet, KDA; fixed and packed sequences
SAVED_CASES = [(("vector", "additive", False), False), (("vector", "additive", True), False),
               (("scalar", "additive", False), True), (("none", "delta", False), False),
               (("scalar", "delta", False), True), (("vector", "delta", False), False)]


def _case_id(x) -> str:
    return combo_id(x) if isinstance(x, tuple) else ("varlen" if x else "fixed")


@pytest.mark.parametrize("combo, varlen", [(("scalar", "delta", False), True), (("vector", "delta", False), False),
                                           (("vector", "additive", True), False), (("none", "additive", False), True)],
                         ids=_case_id)
def test_recomputed_states_equal_kept_ones(combo, varlen, settings):
    """The backward that recomputes the chunk-start states (and the delta rule's T^T, W^T, corrected writes and a
    per-channel decay's decayed keys; a scalar decay's WY stage reading the forward's G rather than summing g again)
    gives the gradients of the one that kept them, to the bit (the same kernels on the same inputs), from smaller
    saved tensors."""
    if varlen:
        t, cu = packed(combo, [37, 64, 90], H=2, K=16, V=16)
        kwargs = {"cu_seqlens": cu}
    else:
        t, kwargs = inputs(combo, B=2, T=100, H=2, K=16, V=16), {}
    gen = seeded("recompute", combo)
    do = torch.randn(t["v"].shape, generator=gen).to(DEVICE)
    dS = torch.randn(t["initial_state"].shape, generator=gen).to(DEVICE)
    leaves = {n: x.detach().requires_grad_(True) for n, x in t.items()}
    results, saved = [], []
    for keep in (True, False):
        settings(KEEP_STATES=keep)
        saved.append(_saved_bytes(lambda: linear_recurrence(**leaves, backend="triton", **kwargs)))
        results.append(run("triton", t, do, dS, **kwargs))
    for name in results[0][2]:
        assert torch.equal(results[0][2][name], results[1][2][name]), name
    assert saved[1] < saved[0]


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
@pytest.mark.parametrize("combo, varlen", SAVED_CASES, ids=_case_id)
def test_backward_keeps_the_cumulative_gates_not_the_log_decay(combo, varlen, keep, settings):
    """Of the gates, autograd keeps the chunk-local cumulative sums G alone, which the backward reads, and not the
    fp32 log decay g they were summed from (for fp32 gates the caller's own tensor): what it saves is the inputs but
    g and the forward's kept buffers (``pipeline.kept``), each once. Its gradients (an initial state, packed
    sequences) equal, to the bit, those of the launchers given every buffer of a forward that keeps its states: with
    ``KEEP_STATES`` off, what the backward recomputes (a scalar decay's WY stage reading the forward's G rather than
    summing g again, a per-channel decay's decayed keys) gives the kept gradients."""
    if varlen:
        t, cu = packed(combo, [37, 64, 90], H=2, K=16, V=16)
        kwargs = {"cu_seqlens": cu}
    else:
        t, cu, kwargs = inputs(combo, B=2, T=100, H=2, K=16, V=16), None, {}
    settings(KEEP_STATES=keep)
    leaves = {n: x.detach().requires_grad_(True) for n, x in t.items()}
    storages = {}

    def pack(x):
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        linear_recurrence(**leaves, output_final_state=True, backend="triton", **kwargs)
    g = t.get("log_decay")
    assert g is None or g.untyped_storage().data_ptr() not in storages
    decay = Decay.of(combo[0])
    buffers = pipeline.kept(pipeline.saved_buffers(t["q"], t["v"], g, "beta" in t, cu))
    given = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes()
             for n, x in (*t.items(), ("cu_seqlens", cu)) if x is not None and n != "log_decay"}
    assert sum(storages.values()) == sum(given.values()) + sum(b.nbytes for b in buffers if b is not None)
    gen = seeded("saved gates", combo)
    do = torch.randn(t["v"].shape, generator=gen).to(DEVICE)
    dS = torch.randn(t["initial_state"].shape, generator=gen).to(DEVICE)
    grads = run("triton", t, do, dS, **kwargs)[2]
    q, k, v, h0 = t["q"], t["k"], t["v"], t["initial_state"]
    beta, u = t.get("beta"), t.get("bonus")
    with configs.override(KEEP_STATES=True):
        _, _, saved = pipeline.chunk_forward(q, k, v, g, beta, u, h0, cu, 16 ** -0.5, decay, True)
    launched = pipeline.chunk_backward(q, k, v, beta, u, h0, cu, saved, do, dS, 16 ** -0.5, decay)
    for name, grad in zip(("q", "k", "v", "log_decay", "beta", "bonus", "initial_state"), launched):
        assert (grad is None) == (name not in t), name
        assert grad is None or torch.equal(grads[name], grad), name


@pytest.mark.parametrize("combo", [("vector", "delta", False), ("constant", "additive", True)], ids=combo_id)
def test_few_tokens_without_grad_use_the_recurrent_kernel(combo):
    """Up to 16 tokens without autograd: the fused recurrent kernel (decoding a few tokens)."""
    t = inputs(combo, B=2, T=3, H=2, K=16, V=8)
    with torch.no_grad():
        o_ref, S_ref = linear_recurrence(**t, output_final_state=True, backend="reference")
        o, S = linear_recurrence(**t, output_final_state=True, backend="triton")
    assert rel_err(o, o_ref) < FP32_TOL and rel_err(S, S_ref) < FP32_TOL


@pytest.mark.parametrize("case", ["dplr", "full", "delta-bonus", "float64", "K512"])
def test_unserved_inputs_fall_back_to_chunk_with_a_logged_reason(case, caplog):
    combo = {"dplr": ("scalar", "dplr", False), "full": ("full", "additive", False),
             "delta-bonus": ("scalar", "delta", True)}.get(case, ("scalar", "additive", False))
    K = 512 if case == "K512" else 8
    dtype = torch.float64 if case == "float64" else torch.float32
    t = make_inputs(*combo, B=1, T=9, H=1, K=K, V=4, dtype=dtype, generator=seeded(case))
    with caplog.at_level(logging.DEBUG, logger="linmem.ops"):
        o, S = linear_recurrence(**t, output_final_state=True, backend="triton")
    assert any("'triton' cannot serve" in r.getMessage() for r in caplog.records)
    o_ref, S_ref = linear_recurrence(**t, output_final_state=True, backend="chunk")
    assert torch.equal(o, o_ref) and torch.equal(S, S_ref)


@pytest.mark.parametrize("combo", [("none", "delta", False), ("scalar", "additive", True)], ids=combo_id)
def test_custom_op_traces_without_graph_breaks(combo):
    """Under torch.compile the kernels run as torch.library custom ops (fullgraph compilation sees one
    opaque op); in eager mode as a plain autograd.Function and a direct decode call. Both give the same
    outputs and gradients, and the few-token decode path compiles too."""
    t = inputs(combo, B=1, T=20, H=1, K=16, V=16)
    backend = "aot_eager" if DEVICE == "cpu" else "inductor"

    def f(**x):
        return linear_recurrence(**x, output_final_state=True, backend="triton")

    results = []
    for fn in (torch.compile(f, fullgraph=True, backend=backend), f):
        leaves = {n: x.detach().clone().requires_grad_(True) for n, x in t.items()}
        o, S = fn(**leaves)
        grads = torch.autograd.grad((o * torch.cos(o)).sum() + S.square().sum(), list(leaves.values()))
        results.append((o, S, *grads))
    for name, compiled, eager in zip(["o", "S", *("d" + n for n in t)], *results):
        assert torch.equal(compiled, eager), name
    few = {n: (x[:, :3] if x.dim() > 2 and x.shape[1] == 20 else x) for n, x in t.items()}
    with torch.no_grad():
        o_c, S_c = torch.compile(f, fullgraph=True, backend=backend)(**few)
        o_e, S_e = f(**few)
    assert torch.equal(o_c, o_e) and torch.equal(S_c, S_e)


@pytest.mark.parametrize("combo", [("scalar", "delta", False), ("vector", "additive", True),
                                   ("vector", "delta", False)],
                         ids=combo_id)
def test_fake_outputs_match_the_kernels(combo):
    """The custom ops' fake implementations (what torch.compile traces with) give every output, the
    saved bf16/fp32 intermediates included, the shape and dtype the kernels give it."""
    from linmem.ops.recurrence.triton import ops

    t = inputs(combo, B=1, T=20, H=1, K=16, V=16, dtype=torch.bfloat16)
    decay = Decay.of(combo[0])
    args = (t["q"], t["k"], t["v"], t["log_decay"].float().contiguous(), t.get("beta"), t.get("bonus"),
            t["initial_state"].float(), None, 0.25, decay, True)
    torch.library.opcheck(ops.chunk_fwd_op, args, test_utils=("test_faketensor",))


# ---------------------------------------------------------------- log decays of -inf (decay 0: forget everything)


def _gates_with_minus_inf(t: dict, pattern: str) -> dict:
    """t with its log decays set per ``pattern``: "few" puts -inf at a few tokens (and, per channel, a few
    channels), "all" everywhere, "mixed" beside finite gates far below where exp underflows (down to -3e38, whose
    chunk sums would overflow) and gates near 0."""
    g = t["log_decay"].clone()
    if pattern == "all":
        g[:] = float("-inf")
    elif g.dim() == 1:  # a constant decay: one per head
        g[0] = float("-inf")
    else:
        channel = (slice(None),) if g.dim() == 3 else (slice(None), slice(0, None, 5))
        g[(slice(None), 3, slice(None), *channel[1:])] = float("-inf")
        g[(slice(None), 40, slice(None), *channel[1:])] = float("-inf")
        g[:, 64] = float("-inf")  # the first token of a chunk
        if pattern == "mixed":
            g[:, 10] = -3e38
            g[:, 11] = -3e38
            g[:, 20:26] = -1e4
            g[:, 50] = -150.0
            g[:, 51] = -104.0
            g[:, 52] = -90.0
            g[:, 60:63] = -1e-7
    return {**t, "log_decay": g}


@pytest.mark.parametrize("combo, pattern, varlen", [
    (("scalar", "additive", False), "few", False),
    (("vector", "delta", False), "few", False),
    (("vector", "additive", True), "mixed", False),
    (("scalar", "delta", False), "mixed", True),
    (("vector", "additive", False), "all", False),
    (("constant", "delta", False), "few", False),
], ids=lambda x: combo_id(x) if isinstance(x, tuple) else str(x))
def test_minus_inf_gates_equal_the_reference(combo, pattern, varlen):
    """A log decay of -inf (decay 0) at a few tokens and channels, everywhere, or beside finite gates far below
    where exp underflows: the outputs, the final state and the gradients of q, k, v, beta, the bonus and the initial
    state equal the reference's, and the gate gradient is finite and the reference's (0 at a -inf gate): the
    cumulative-sum stage floors each log decay at ``cumsum.LOG_DECAY_FLOOR``, below which its decay is 0 in fp32.
    (Gates above the floor load unchanged: every other test holds the kernels to the same bits there.)"""
    if varlen:  # an empty sequence, one that ends inside a chunk, one that holds its -inf gates
        t, cu = packed(combo, [3, 0, 67], H=1, K=16, V=16)
        kwargs = {"cu_seqlens": cu}
    else:
        t, kwargs = inputs(combo, B=1, T=70, H=1, K=16, V=16), {}
    t = _gates_with_minus_inf(t, pattern)
    gen = seeded("minus inf", combo, pattern)
    do = torch.randn(t["v"].shape, generator=gen).to(DEVICE)
    N = t["initial_state"].shape[0]
    dS = torch.randn(N, 1, 16, 16, generator=gen).to(DEVICE)
    o_ref, S_ref, g_ref = run("reference", {n: x.double() for n, x in t.items()}, do.double(), dS.double(), **kwargs)
    o, S, g = run("triton", t, do, dS, **kwargs)
    assert rel_err(o, o_ref) < FP32_TOL and rel_err(S, S_ref) < FP32_TOL
    for name in t:
        assert torch.isfinite(g[name]).all(), name
        if name != "log_decay":
            assert rel_err(g[name], g_ref[name]) < FP32_TOL, name
    dg, dg_ref = g["log_decay"].double(), g_ref["log_decay"]
    assert torch.isfinite(dg_ref).all()
    if dg_ref.abs().max() > 0:
        assert rel_err(dg, dg_ref) < FP32_TOL
    # at a floored gate the reference's gradient is 0 (e^-104 in float64), and the kernels' is the cancellation of
    # terms of the size of q dq and k dk (see test_extreme_per_channel_gates_equal_the_reference): held to their
    # fp32 rounding, per token (a constant gate's gradient sums that cancellation over every token)
    floored = t["log_decay"] < cumsum.LOG_DECAY_FLOOR.value
    bound = 2e-5 * (t["v"].shape[1] if combo[0] == "constant" else 1)
    assert dg_ref[floored].abs().max() < 1e-30 and dg[floored].abs().max() < bound


def test_spans_stay_below_the_gate_floor():
    """The span bounds that pick the per-channel paths stay below the floored gate's fall (158.7 in log2 units), so
    a chunk holding a floored gate takes the pairwise path; a setting past that is refused, as is an unknown one."""
    assert max(configs.BLOCK_SPAN, configs.CHUNK_SPAN) <= configs.MAX_SPAN < -cumsum.LOG_DECAY_FLOOR.value * 1.4426
    for bad in ({"CHUNK_SPAN": 200}, {"BLOCK_SPAN": 151}, {"CHUNK": 32}):
        with pytest.raises(ValueError, match="override"):
            with configs.override(**bad):
                pass


def test_minus_inf_gates_in_the_decoding_kernel():
    """The fused recurrent kernel (a few tokens without autograd) takes -inf log decays as decay 0, like the chunk
    kernels and the reference."""
    t = _gates_with_minus_inf(inputs(("vector", "delta", False), B=2, T=5, H=2, K=16, V=8), "all")
    with torch.no_grad():
        o_ref, S_ref = linear_recurrence(**t, output_final_state=True, backend="reference")
        o, S = linear_recurrence(**t, output_final_state=True, backend="triton")
    assert rel_err(o, o_ref) < FP32_TOL and rel_err(S, S_ref) < FP32_TOL


# ---------------------------------------------------------------- GPU, real shapes

gpu = pytest.mark.gpu


@gpu
def test_gpu_cached_launch_takes_the_dispatchers_kernel():
    """The launchers' cache of compiled kernels (``triton_launch.run_kernel``) launches, for each variant of the
    arguments that Triton specializes on (a misaligned tensor, an integer that is 1 or not divisible by 16), the
    kernel Triton's dispatcher compiles for it, and gives its results bit for bit."""
    kernel = cumsum.chunk_cumsum_kernel
    base = torch.randn(4096 + 1, generator=seeded("cached-launch")).cuda()
    constexprs = dict(VECTOR=0, C=configs.CHUNK, BK=64)
    seen = set()
    for T, H, offset in [(128, 16, 0), (128, 16, 1), (1, 16, 0), (100, 3, 0), (100, 3, 1)]:
        g = base[offset:offset + 2 * T * H].view(2, T, H)
        args_of = lambda G: (g, G, None, T, H, 2, 128)  # noqa: E731  (no cu_seqlens: a None argument)
        grid = (2 * configs.cdiv(T, configs.CHUNK), H, 1)
        cached, direct = torch.empty_like(g), torch.empty_like(g)
        for _ in range(2):  # the first launch fills the cache, the second takes it
            triton_launch.run_kernel(kernel, grid, args_of(cached), constexprs, 4, 2)
        compiled = kernel[grid](*args_of(direct), **constexprs, num_warps=4, num_stages=2)
        entry = triton_launch._COMPILED[triton_launch._cache_key(kernel, args_of(cached), constexprs, 4, 2, None)]
        assert entry is not None and entry[0] is compiled.run and entry[1] == compiled.function, (T, H, offset)
        assert torch.equal(cached, direct)
        seen.add(id(compiled))
    assert len(seen) == 5  # each variant took a kernel of its own


@gpu
def test_gpu_fast_launch_switch(tmp_path):
    """``LINMEM_TRITON_FAST_LAUNCH=0``: every launch goes through Triton's dispatcher (no compiled kernel kept for
    the fast path, by the recurrence or a fused op), with the same results as the fast path's."""
    import subprocess

    script = (
        "import sys, torch\n"
        "from linmem.ops import linear_recurrence\n"
        "from linmem.ops import triton_launch\n"
        "from linmem.ops.fused.triton.swiglu import swiglu_forward\n"
        "from tests.helpers import make_inputs\n"
        "t = {n: x.cuda() for n, x in make_inputs('vector', 'delta', False, B=1, T=200, H=2, K=64, V=64, "
        "dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0)).items()}\n"
        "for _ in range(2):\n"
        "    o, S = linear_recurrence(**t, output_final_state=True, backend='triton')\n"
        "    y = swiglu_forward(t['q'][0, :, 0], t['k'][0, :, 0])\n"
        "torch.save((o.cpu(), S.cpu(), y.cpu()), sys.argv[1])\n"
        "print(triton_launch.FAST_LAUNCH, sum(e is not None for e in triton_launch._COMPILED.values()))\n")
    runs = {}
    for switch in ("1", "0"):
        env = {**os.environ, "LINMEM_TRITON_FAST_LAUNCH": switch}
        out = subprocess.run([sys.executable, "-c", script, str(tmp_path / switch)], env=env, capture_output=True,
                             text=True, check=True).stdout.split()
        runs[switch] = (out, torch.load(tmp_path / switch))
    assert runs["1"][0][0] == "True" and int(runs["1"][0][1]) > 0
    assert runs["0"][0] == ["False", "0"]
    assert all(torch.equal(a, b) for a, b in zip(runs["1"][1], runs["0"][1]))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_gpu_real_shapes(combo, dtype):
    tol = LOW_TOL if dtype != torch.float32 else FP32_TOL
    compare(inputs(combo, B=2, T=777, H=4, K=128, V=128, dtype=dtype), tol)


@gpu
@pytest.mark.parametrize("KV", [(64, 256), (256, 64), (100, 72)], ids=lambda kv: f"K{kv[0]}V{kv[1]}")
@pytest.mark.parametrize("combo", [("vector", "delta", False), ("scalar", "delta", False),
                                   ("scalar", "additive", True)],
                         ids=combo_id)
def test_gpu_head_dims(combo, KV):
    compare(inputs(combo, B=1, T=300, H=2, K=KV[0], V=KV[1], dtype=torch.bfloat16), LOW_TOL)


@gpu
@pytest.mark.parametrize("combo", [c for c in COMBOS if c[0] in ("scalar", "vector")], ids=combo_id)
def test_gpu_varlen(combo):
    t, cu = packed(combo, [1000, 0, 1, 64, 200, 511], H=4, K=128, V=64, dtype=torch.bfloat16)
    compare(t, LOW_TOL, cu_seqlens=cu)


@gpu
@pytest.mark.parametrize("combo", [("vector", "additive", False), ("scalar", "delta", False), ("none", "delta", False)],
                         ids=combo_id)
def test_gpu_wide_grid(combo):
    """B * H above the SM count: the sequential passes' V blocks and stages of ``configs.SEQUENTIAL``; the delta
    rule's forward pass with bf16 W and U ("state_fwd_bf16")."""
    t = inputs(combo, B=3, T=150, H=48, K=128, V=128, dtype=torch.bfloat16)
    s, dev = configs.shapes_of(t["q"], t["v"], None), t["q"].device
    delta, decay = combo[1] == "delta", Decay.of(combo[0])
    if delta:
        assert configs.factors_dtype(s, torch.bfloat16, decay, dev) == torch.bfloat16
    for kernel in ("state_fwd_bf16" if delta else "state_fwd", "state_bwd"):
        assert configs.sequential_config(kernel, s, delta, decay, dev) == configs.SEQUENTIAL[(kernel, delta, decay)]
    compare(t, LOW_TOL)


@gpu
@pytest.mark.parametrize("kind", ["none", "scalar", "vector"])
def test_gpu_delta_rule_bf16_factors_on_a_half_filled_grid(kind):
    """Between half the SM count and the SM count (2 V blocks x 1 sequence x 3/8 SMs heads): bf16 W and U, the
    forward pass at V block 64 and ``configs.NARROW_STAGES`` (one program per SM), as at 4 x 4096 on an H200."""
    H = 3 * configs.sm_count(torch.device(DEVICE)) // 8
    t = inputs((kind, "delta", False), B=1, T=150, H=H, K=128, V=128, dtype=torch.bfloat16)
    s, dev, decay = configs.shapes_of(t["q"], t["v"], None), t["q"].device, Decay.of(kind)
    assert configs.factors_dtype(s, torch.bfloat16, decay, dev) == torch.bfloat16
    assert configs.sequential_config("state_fwd_bf16", s, True, decay, dev) == (64, configs.NARROW_STAGES)
    compare(t, LOW_TOL)


@gpu
@pytest.mark.parametrize("kind", ["none", "scalar", "vector"])
def test_gpu_delta_rule_bf16_factors_varlen(kind):
    """Packed sequences on a wide grid (6 sequences x 24 heads x 2 V blocks): bf16 factors with empty, one-token
    and partial chunks (W read from its transposed copy except with a per-channel decay,
    ``configs.W_READ_TRANSPOSED``)."""
    t, cu = packed((kind, "delta", False), [100, 0, 64, 1, 150, 37], H=24, K=128, V=128, dtype=torch.bfloat16)
    s = configs.shapes_of(t["q"], t["v"], cu)
    assert configs.factors_dtype(s, torch.bfloat16, Decay.of(kind), t["q"].device) == torch.bfloat16
    compare(t, LOW_TOL, cu_seqlens=cu)


@gpu
@pytest.mark.parametrize("kind", ["none", "scalar", "vector"])
def test_gpu_delta_rule_wide_grid_at_head_dim_256(kind):
    """K = V = 256 on a wide grid: fp32 W and U (``configs.BF16_FACTORS_MAX_K``) with the state in four key tiles."""
    H = configs.sm_count(torch.device(DEVICE)) // 4 + 1  # 4 V blocks of 64: more programs than SMs
    t = inputs((kind, "delta", False), B=1, T=130, H=H, K=256, V=256, dtype=torch.bfloat16)
    s = configs.shapes_of(t["q"], t["v"], None)
    assert configs.factors_dtype(s, torch.bfloat16, Decay.of(kind), t["q"].device) == torch.float32
    compare(t, LOW_TOL)


@gpu
@pytest.mark.parametrize("combo", [("vector", "additive", False), ("scalar", "delta", False), ("none", "delta", False)],
                         ids=combo_id)
def test_gpu_narrow_grid(combo):
    """B * H * V / 32 below the SM count, B * H * V / 16 above it: the sequential passes at V block 32 and
    ``configs.NARROW_STAGES`` (one program per SM)."""
    H = configs.sm_count(torch.device(DEVICE)) // 4 - 1
    t = inputs(combo, B=1, T=150, H=H, K=128, V=128, dtype=torch.bfloat16)
    s, dev = configs.shapes_of(t["q"], t["v"], None), t["q"].device
    delta, decay = combo[1] == "delta", Decay.of(combo[0])
    if delta:  # bf16 W and U on this grid too (configs.NARROW_BF16_FACTORS), k^T d in tf32
        assert configs.factors_dtype(s, torch.bfloat16, decay, dev) == torch.bfloat16
    for kernel in ("state_fwd_bf16" if delta else "state_fwd", "state_bwd"):
        assert configs.sequential_config(kernel, s, delta, decay, dev) == (32, configs.NARROW_STAGES)
    compare(t, LOW_TOL)


@gpu
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_gpu_backward_is_deterministic(combo):
    """Three forward+backward runs on the same inputs give the same bits. At this size (bf16, 2 x 4096, 16 heads
    of 128) the per-channel ``grads_kernel`` at 2 or 3 stages, as Triton 3.6 compiles it for Hopper, changes a few
    key columns of dq and dg in most runs while every error ratio passes, when its chunk-end term reads the tiles
    of its products (it reads tiles of its own: see the WORKAROUND in ``grads.py``)."""
    t = inputs(combo, B=2, T=4096, H=16, K=128, V=128, dtype=torch.bfloat16)
    gen = seeded("determinism", combo)
    do = torch.randn(2, 4096, 16, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    dS = torch.randn(2, 16, 128, 128, generator=gen).to(DEVICE)
    o, S, g = run("triton", t, do, dS)
    for _ in range(2):
        o2, S2, g2 = run("triton", t, do, dS)
        assert torch.equal(o, o2) and torch.equal(S, S2)
        for name in t:
            differs = g[name] != g2[name]
            assert not differs.any(), f"d{name} differs at {int(differs.sum())} elements between two runs"


@gpu
def test_gpu_fp16():
    compare(inputs(("vector", "delta", False), B=1, T=500, H=2, K=64, V=64, dtype=torch.float16), LOW_TOL)


@gpu
@pytest.mark.parametrize("kind", ["scalar", "vector"])
@pytest.mark.parametrize("strength", [-60.0, -1e-6])
@pytest.mark.parametrize("rule", ["additive", "delta"])
def test_gpu_extreme_gates_are_finite(kind, strength, rule):
    """Decays near 0 (log ~ -60 per token) and near 1, T = 4096: finite outputs and gradients."""
    t = inputs((kind, rule, False), B=1, T=4096, H=2, K=64, V=64, dtype=torch.bfloat16)
    t["log_decay"] = strength * (1 + torch.rand(t["log_decay"].shape, generator=seeded(kind, strength))).to(DEVICE)
    do = torch.randn(t["v"].shape, device=DEVICE)
    o, S, g = run("triton", t, do, torch.randn(1, 2, 64, 64, device=DEVICE))
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert all(torch.isfinite(x).all() for x in g.values())


@gpu
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_gpu_decode_step_updates_the_state_in_place(combo):
    t = inputs(combo, B=3, T=1, H=4, K=128, V=64, dtype=torch.bfloat16)
    step = {n: (x if n in ("bonus", "initial_state") or (n == "log_decay" and x.dim() == 1) else x[:, 0])
            for n, x in t.items()}
    t["initial_state"] = t["initial_state"].float()
    state = step.pop("initial_state").float()
    expected_o, expected_S = linear_recurrence(**t, output_final_state=True, backend="reference")
    with torch.no_grad():
        o, S = linear_recurrence_step(step.pop("q"), step.pop("k"), step.pop("v"), state, **step)
    assert S is state
    assert rel_err(o, expected_o[:, 0]) < LOW_TOL and rel_err(S, expected_S) < FP32_TOL


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("combo", [("scalar", "delta", False), ("vector", "additive", True)], ids=combo_id)
def test_gpu_inputs_on_a_device_that_is_not_current(combo):
    """A layer on cuda:1 called while cuda:0 is current (a model split over GPUs in one process): the chunk
    kernels, forward and backward, and the decode kernel run on the inputs' device and equal the reference."""
    long = {n: x.to("cuda:1") for n, x in inputs(combo, B=2, T=100, H=2, K=32, V=32).items()}
    short = {n: x.to("cuda:1") for n, x in inputs(combo, B=2, T=5, H=2, K=32, V=32).items()}
    with torch.cuda.device(0):
        compare(long, FP32_TOL)
        with torch.no_grad():  # a few tokens without autograd: the fused recurrent kernel
            o, S = linear_recurrence(**short, output_final_state=True, backend="triton")
        o_ref, S_ref = linear_recurrence(**short, output_final_state=True, backend="reference")
        assert torch.cuda.current_device() == 0
    assert o.device == short["q"].device and rel_err(o, o_ref) < FP32_TOL and rel_err(S, S_ref) < FP32_TOL


@gpu
def test_gpu_auto_picks_triton(caplog):
    t = inputs(("vector", "delta", False), B=1, T=64, H=1, K=16, V=16)
    with caplog.at_level(logging.DEBUG, logger="linmem.ops"):
        o_auto, _ = linear_recurrence(**t, backend="auto")
    o_triton, _ = linear_recurrence(**t, backend="triton")
    assert torch.equal(o_auto, o_triton)
    assert not any("cannot serve" in r.getMessage() for r in caplog.records)
