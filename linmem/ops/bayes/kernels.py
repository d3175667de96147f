"""Triton kernels of the Bayesian filter: a sequential forward and a three-pass backward.

Layout: q, k ``[tokens, H, K]``, v ``[tokens, H, V]``, the gates g (log decay), r (observation noise)
and w (process noise) ``[tokens, H]`` fp32; sequence n owns tokens ``[bos, eos)``. Each program
serves one (sequence, head) and one block of BV value columns (grid: V blocks x N * H). The
covariance ``P [K, K]`` lives in registers in fp32; it does not depend on the values, so every
V block recomputes it and block 0 writes what belongs to the covariance (u, s, var, P_T).

Forward, per token (``u = P^- k``, ``s = k.u + r``, gain ``g = u / s``)::

    P^- = a^2 P + w I,   M^- = a M,   e = v - M^-T k
    M   = M^- + g e^T
    P   = P^- - g u^T - u g^T + s g g^T      (the Joseph form, expanded; = P^- - u u^T / s)

The Joseph form keeps P symmetric up to the rounding of each update (the compiler may contract the
products into FMAs in either order, so the stored final P is symmetrised) and cancels the first-order
error of a rounded gain (the simple form ``P^- - u u^T / s`` carries it), at three outer products
instead of one.

Backward. The adjoints of M and P (D and G) run backwards through the transposed transitions, which
need only the per-token vectors u, s and e that the forward saved, not the states::

    D += scale q do^T;   de = D^T u / s;   D_{t-1} = a (D - k de^T)                     (pass 1)
    G += dvar q q^T;     ds = (u^T G u - u^T D e) / s^2;   du = D e / s - 2 G u / s + ds k
    dP^- = G + (du k^T + k du^T) / 2;   G_{t-1} = a^2 dP^-                            (pass 2)

What needs the states (``dk += -M^- de + P^- du``, ``dq = scale M do + 2 dvar P q``) runs in a
third pass forward in time that recomputes them from the initial belief. The gate gradient
``dg = <dM^-, M^-> + 2 <dP^-, a^2 P_{t-1}>`` needs both a state and an adjoint; each inner product
is carried as a running scalar instead:

* the mean's, forward in pass 3: ``X_t = <D_t, M_t>`` obeys ``X_t = dg_t + de_t . v_t`` and
  ``dg_t = X_{t-1} - do_{t-1} . o_{t-1}``, from ``X_0 = <dM_0, M_0>``;
* the covariance's, backwards in pass 2: ``Z_t = <dP^-_t, P^-_t> = W_t + u^T G u / s + du . u``
  with ``W_t = <G_t, P_t>`` and ``W_{t-1} = Z_t - w_t tr(dP^-_t) + dvar_{t-1} q^T P_{t-1} q``; then
  ``dg_t = 2 (Z_t - w_t tr(dP^-_t))``, from ``W_T = <dP_T, P_T>``.

The trade-off: storing the states would cost ``T K (K + V)`` floats per head (128 MiB per head at
T = 2048, K = V = 128), checkpoints every C tokens ``T K (K + V) / C`` plus a recomputation and a
scratch of C states per program. The running scalars need neither: the backward saves
``T (K + V + 2)`` floats per head (u, s, e, q^T P q: about the size of q, k, v in fp32) and costs one
reverse pass over the adjoints and one forward pass over the states, about three forwards in all.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..recurrence.triton.layout import sequence_bounds
from ..recurrence.triton.numerics import exp, rounded, total

# Zero tiles are tl.full(shape, 0.0, tl.float32): tl.zeros is a @jit function of triton.language, which the
# Triton interpreter cannot call when triton.language was imported before TRITON_INTERPRET=1 was set.


@triton.jit
def _ranges(K, V, BK: tl.constexpr, BV: tl.constexpr):
    """This program's (sequence n, head h, key rows, value columns, their masks) for grid (V blocks, N * H)."""
    kr = tl.arange(0, BK)
    vr = tl.program_id(0) * BV + tl.arange(0, BV)
    return kr, vr, kr < K, vr < V


@triton.jit
def _initial_belief(M0, P0, nh, K, V, kr, vr, mk, mv, prior, PRESENT: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr):
    """(M [BK, BV], P [BK, BK]) at the start of sequence/head nh: the given state with P read as
    (P + P^T) / 2, or M = 0, P = prior I."""
    if PRESENT:
        M = tl.load(M0 + nh.to(tl.int64) * K * V + kr[:, None] * V + vr[None, :], mask=mk[:, None] & mv[None, :],
                    other=0.0)
        base = P0 + nh.to(tl.int64) * K * K
        mkk = mk[:, None] & mk[None, :]
        P = tl.load(base + kr[:, None] * K + kr[None, :], mask=mkk, other=0.0)
        P = 0.5 * (P + tl.load(base + kr[None, :] * K + kr[:, None], mask=mkk, other=0.0))
    else:
        M = tl.full([BK, BV], 0.0, tl.float32)
        P = tl.where((kr[:, None] == kr[None, :]) & mk[:, None], prior, 0.0)
    return M, P


@triton.jit
def _load_token(q, k, g, r, w, tok, K, kr, mk, HAS_W: tl.constexpr):
    """q_t, k_t (fp32 [BK]), the decay a_t, r_t and w_t (0 without process noise) of token row ``tok``."""
    qt = tl.load(q + tok * K + kr, mask=mk, other=0.0).to(tl.float32)
    kt = tl.load(k + tok * K + kr, mask=mk, other=0.0).to(tl.float32)
    a = exp(tl.load(g + tok))
    rt = tl.load(r + tok)
    wt = rt * 0.0
    if HAS_W:
        wt = tl.load(w + tok)
    return qt, kt, a, rt, wt


@triton.jit
def _filter_step(M, P, kt, vt, a, rt, wt, eye):
    """One step: -> (M_t, P_t, P^-, M^-, u, s, e); see the module docstring."""
    Pm = (a * a) * P + wt * eye
    u = total(Pm * kt[None, :], 1)
    s = total(kt * u, 0) + rt
    Mm = a * M
    e = vt - total(kt[:, None] * Mm, 0)
    gain = u / s
    M = Mm + gain[:, None] * e[None, :]
    P = Pm - gain[:, None] * u[None, :] - u[:, None] * gain[None, :] + s * (gain[:, None] * gain[None, :])
    return M, P, Pm, Mm, u, s, e


@triton.jit
def filter_fwd_kernel(q, k, v, g, r, w, M0, P0, o, var, MT, PT, U, S, E, QPQ, cu_seqlens, scale, prior, T, H, K, V,
                      HAS_W: tl.constexpr, HAS_INIT: tl.constexpr, VAR: tl.constexpr, SAVE: tl.constexpr,
                      IS_VARLEN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The filter over one sequence, head and V block.

    o: [tokens, H, V] (the dtype of q); var, and for the backward S (s), QPQ (q^T P q): [tokens, H] fp32;
    U (u): [tokens, H, K], E (e): [tokens, H, V] fp32; M0, MT: [N, H, K, V], P0, PT: [N, H, K, K] fp32
    (MT, PT may be M0, P0 when the grid has one V block: the state is read before it is written).
    """
    nh = tl.program_id(1)
    n, h = nh // H, nh % H
    lead = tl.program_id(0) == 0
    bos, eos = sequence_bounds(n, cu_seqlens, T, IS_VARLEN)
    kr, vr, mk, mv = _ranges(K, V, BK, BV)
    eye = tl.where((kr[:, None] == kr[None, :]) & mk[:, None], 1.0, 0.0)
    M, P = _initial_belief(M0, P0, nh, K, V, kr, vr, mk, mv, prior, HAS_INIT, BK, BV)
    for t in range(bos, eos):
        tok = t * H + h
        qt, kt, a, rt, wt = _load_token(q, k, g, r, w, tok, K, kr, mk, HAS_W)
        vt = tl.load(v + tok * V + vr, mask=mv, other=0.0).to(tl.float32)
        M, P, Pm, Mm, u, s, e = _filter_step(M, P, kt, vt, a, rt, wt, eye)
        out = scale * total(qt[:, None] * M, 0)
        tl.store(o + tok * V + vr, rounded(out, o.dtype.element_ty), mask=mv)
        if SAVE:
            tl.store(E + tok * V + vr, e, mask=mv)
        if lead:
            if SAVE:
                tl.store(U + tok * K + kr, u, mask=mk)
                tl.store(S + tok, s)
            if VAR:
                qpq = total(qt * total(P * qt[None, :], 1), 0)
                tl.store(var + tok, qpq + rt)
                if SAVE:
                    tl.store(QPQ + tok, qpq)
    tl.store(MT + nh.to(tl.int64) * K * V + kr[:, None] * V + vr[None, :], M, mask=mk[:, None] & mv[None, :])
    if lead:
        P = 0.5 * (P + tl.trans(P))  # symmetric bit for bit, whatever the contraction of the updates into FMAs
        tl.store(PT + nh.to(tl.int64) * K * K + kr[:, None] * K + kr[None, :], P, mask=mk[:, None] & mk[None, :])


@triton.jit
def mean_bwd_kernel(q, k, g, U, S, E, do, dMT, dM0, dE, DE, cu_seqlens, scale, T, H, K, V, TOKENS,
                    HAS_DFINAL: tl.constexpr, IS_VARLEN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Pass 1, backwards: the mean's adjoint D [BK, BV] from dM_T through every token.

    Writes de = D^T u / s (= dv, fp32 [tokens, H, V]), this block's share of D e (DE: [V blocks, tokens, H, K])
    and dM_0 [N, H, K, V].
    """
    nh = tl.program_id(1)
    n, h = nh // H, nh % H
    bos, eos = sequence_bounds(n, cu_seqlens, T, IS_VARLEN)
    kr, vr, mk, mv = _ranges(K, V, BK, BV)
    state = nh.to(tl.int64) * K * V + kr[:, None] * V + vr[None, :]
    mkv = mk[:, None] & mv[None, :]
    D = tl.full([BK, BV], 0.0, tl.float32)
    if HAS_DFINAL:
        D = tl.load(dMT + state, mask=mkv, other=0.0)
    share = DE + tl.program_id(0).to(tl.int64) * TOKENS * H * K
    for i in range(0, eos - bos):
        tok = (eos - 1 - i) * H + h
        qt = tl.load(q + tok * K + kr, mask=mk, other=0.0).to(tl.float32)
        kt = tl.load(k + tok * K + kr, mask=mk, other=0.0).to(tl.float32)
        u = tl.load(U + tok * K + kr, mask=mk, other=0.0)
        s = tl.load(S + tok)
        e = tl.load(E + tok * V + vr, mask=mv, other=0.0)
        dot = tl.load(do + tok * V + vr, mask=mv, other=0.0).to(tl.float32)
        D += scale * (qt[:, None] * dot[None, :])
        de = total(D * u[:, None], 0) / s
        tl.store(dE + tok * V + vr, de, mask=mv)
        tl.store(share + tok * K + kr, total(D * e[None, :], 1), mask=mk)
        D = exp(tl.load(g + tok)) * (D - kt[:, None] * de[None, :])
    tl.store(dM0 + state, D, mask=mkv)


@triton.jit
def covariance_bwd_kernel(q, k, g, w, U, S, QPQ, DE, dvar, PT, dPT, dP0, dU, dS, dr, dw, dgP, cu_seqlens, T, H, K,
                          TOKENS, NV, HAS_W: tl.constexpr, VAR: tl.constexpr, HAS_DFINAL: tl.constexpr,
                          IS_VARLEN: tl.constexpr, BK: tl.constexpr):
    """Pass 2, backwards: the covariance's adjoint G [BK, BK] (kept symmetric) from dP_T through every token.

    Writes du [tokens, H, K], ds, dr, dw (trace of dP^-), the covariance's part of dg ([tokens, H], fp32) and
    dP_0 [N, H, K, K]; D e is the sum of the NV shares pass 1 wrote.
    """
    nh = tl.program_id(0)
    n, h = nh // H, nh % H
    bos, eos = sequence_bounds(n, cu_seqlens, T, IS_VARLEN)
    kr = tl.arange(0, BK)
    mk = kr < K
    mkk = mk[:, None] & mk[None, :]
    eye = tl.where((kr[:, None] == kr[None, :]) & mk[:, None], 1.0, 0.0)
    state = nh.to(tl.int64) * K * K
    G = tl.full([BK, BK], 0.0, tl.float32)
    W = total(tl.full([BK], 0.0, tl.float32), 0)  # <G_t, P_t>
    if HAS_DFINAL:
        G = tl.load(dPT + state + kr[:, None] * K + kr[None, :], mask=mkk, other=0.0)
        G = 0.5 * (G + tl.load(dPT + state + kr[None, :] * K + kr[:, None], mask=mkk, other=0.0))
        PT_ = tl.load(PT + state + kr[:, None] * K + kr[None, :], mask=mkk, other=0.0)
        W = total(total(G * PT_, 1), 0)
    for i in range(0, eos - bos):
        tok = (eos - 1 - i) * H + h
        kt = tl.load(k + tok * K + kr, mask=mk, other=0.0).to(tl.float32)
        u = tl.load(U + tok * K + kr, mask=mk, other=0.0)
        s = tl.load(S + tok)
        a = exp(tl.load(g + tok))
        De = tl.full([BK], 0.0, tl.float32)
        for j in range(0, NV):
            De += tl.load(DE + (j * TOKENS * H + tok) * K + kr, mask=mk, other=0.0)
        ds_var = s * 0.0
        if VAR:
            qt = tl.load(q + tok * K + kr, mask=mk, other=0.0).to(tl.float32)
            ds_var = tl.load(dvar + tok)
            G += ds_var * (qt[:, None] * qt[None, :])
            W += ds_var * tl.load(QPQ + tok)
        Gu = total(G * u[None, :], 1)
        gam = total(u * Gu, 0)
        ds = (gam - total(u * De, 0)) / (s * s)
        du = De / s - 2.0 * Gu / s + ds * kt
        tl.store(dU + tok * K + kr, du, mask=mk)
        tl.store(dS + tok, ds)
        tl.store(dr + tok, ds + ds_var)
        trace = total(total(G * eye, 1), 0) + total(du * kt, 0)  # tr(dP^-)
        Z = W + gam / s + total(du * u, 0)  # <dP^-, P^->
        wt = s * 0.0
        if HAS_W:
            wt = tl.load(w + tok)
            tl.store(dw + tok, trace)
        W = Z - wt * trace  # <dP^-, a^2 P_{t-1}>: the next W before its token's variance term
        tl.store(dgP + tok, 2.0 * W)
        G = (a * a) * (G + 0.5 * (du[:, None] * kt[None, :] + kt[:, None] * du[None, :]))
    tl.store(dP0 + state + kr[:, None] * K + kr[None, :], G, mask=mkk)


@triton.jit
def filter_grads_kernel(q, k, v, g, r, w, M0, P0, do, dvar, dE, dU, dS, dM0, dQ, dK, dG, cu_seqlens, scale, prior,
                        T, H, K, V, TOKENS, HAS_W: tl.constexpr, HAS_INIT: tl.constexpr, VAR: tl.constexpr,
                        IS_VARLEN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Pass 3, forward: the states again, and what needs them.

    Writes this V block's share of dq, dk ([V blocks, tokens, H, K]) and of the mean's part of dg
    ([V blocks, tokens, H]); block 0 adds the covariance's terms of dq and dk.
    """
    nh = tl.program_id(1)
    n, h = nh // H, nh % H
    lead = tl.program_id(0) == 0
    bos, eos = sequence_bounds(n, cu_seqlens, T, IS_VARLEN)
    kr, vr, mk, mv = _ranges(K, V, BK, BV)
    eye = tl.where((kr[:, None] == kr[None, :]) & mk[:, None], 1.0, 0.0)
    M, P = _initial_belief(M0, P0, nh, K, V, kr, vr, mk, mv, prior, HAS_INIT, BK, BV)
    X = total(tl.full([BK], 0.0, tl.float32), 0)  # <D_t, M_t>, this block's columns
    if HAS_INIT:
        dM = tl.load(dM0 + nh.to(tl.int64) * K * V + kr[:, None] * V + vr[None, :], mask=mk[:, None] & mv[None, :],
                     other=0.0)
        X = total(total(dM * M, 1), 0)
    read = X * 0.0  # do . o of the previous token
    share = tl.program_id(0).to(tl.int64) * TOKENS * H
    for t in range(bos, eos):
        tok = t * H + h
        qt, kt, a, rt, wt = _load_token(q, k, g, r, w, tok, K, kr, mk, HAS_W)
        vt = tl.load(v + tok * V + vr, mask=mv, other=0.0).to(tl.float32)
        dot = tl.load(do + tok * V + vr, mask=mv, other=0.0).to(tl.float32)
        de = tl.load(dE + tok * V + vr, mask=mv, other=0.0)
        M, P, Pm, Mm, u, s, e = _filter_step(M, P, kt, vt, a, rt, wt, eye)
        dk = -total(Mm * de[None, :], 1)
        dq = scale * total(M * dot[None, :], 1)
        dg = X - read
        X = dg + total(de * vt, 0)
        read = scale * total(dot * total(qt[:, None] * M, 0), 0)
        if lead:
            du = tl.load(dU + tok * K + kr, mask=mk, other=0.0)
            dk += tl.load(dS + tok) * u + total(Pm * du[None, :], 1)
            if VAR:
                dq += 2.0 * tl.load(dvar + tok) * total(P * qt[None, :], 1)
        tl.store(dQ + (share + tok) * K + kr, dq, mask=mk)
        tl.store(dK + (share + tok) * K + kr, dk, mask=mk)
        tl.store(dG + share + tok, dg)
