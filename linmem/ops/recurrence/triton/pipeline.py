"""The chunked recurrence's forward and backward as their stages in order: tensors in, tensors out, no autograd.

With ``G`` the chunk-local cumulative log decay, ``h`` the state at a chunk's start and ``Gamma = G`` of its last
token, one chunk of C tokens computes::

    delta rule only:  T = (I + diag(beta) strict(A_kk))^-1,  W = T (beta k e^G),  U = T (beta v)
                      d = U - W h                                  (the corrected writes)
    additive:         d = v
    o      = scale (q e^Gq) h + A_qk d  (+ scale (q . (u k)) v  with the RWKV-6 bonus)
    h_next = e^Gamma h + (k e^(Gamma - G))^T d

where ``A_xy[t, s] = sum_k x_tk y_sk exp(G_t - G_s)`` and ``Gq = G`` (``G`` of the previous token with the bonus).
The backward's gradients, with ``dH`` the gradient of a chunk's end state::

    dd    = A_qk^T dO + (k e^(Gamma - G)) dH                 gradient of the writes d
    dH'   = e^Gamma dH + scale (q e^Gq)^T dO  (- W^T dd)     gradient of the chunk-start state
    dq    = scale (e^Gq dO h^T + A-side of dO d^T) (+ bonus)
    dk    = e^(Gamma - G) (d dH^T) + A-side of (dO d^T)^T (+ bonus)
    delta rule, with Y = T^T dd:
          dv = beta Y,   d(beta k e^G) = -Y h^T,   dL = -Y d^T   (L = I + diag(beta) strict(A_kk))

(``dL = -Y d^T`` because U - W h = d, so the U and W parts of the inverse's gradient combine.) The gate gradient
follows from G entering only as exp(+-G) factors: ``dG_t = q_t dq_t - k_t dk_t(e^-G parts) + k_t dk_t(e^+G
parts)``, plus the chunk-end term ``e^Gamma sum_v h dH + sum_t k_t dk_t(end state)``; dg is the reverse cumulative
sum of dG inside the chunk (exclusive on the query side with the bonus, whose reads use G_{t-1}).

Each stage is a module holding its kernel and its launcher; everything here is shape arithmetic, with no host
synchronisation, so a varlen batch costs no more host time than a fixed one. Transposed products are computed as
products of transposed loads, never by transposing a product (a Hopper miscompilation of Triton 3.4-3.7.0 hits
that pattern); the operands the backward needs transposed (the delta rule's T, fp32, and W, in the states' dtype)
are stored transposed by the forward instead.

What the backward reads that the forward computed is saved, or with ``configs.KEEP_STATES`` off recomputed: the
forward then saves only the cumulative gates G and the scores A (and the per-channel delta rule's decayed q), and
the backward first reruns the WY stage and the forward pass for the chunk-start states, the delta rule's T^T, W^T
and corrected writes (and decayed k), into fresh buffers. Of the gates the backward reads G alone, never the log
decay g it was summed from: g is not saved (autograd would otherwise keep a second fp32 copy of the gates).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import configs
from .configs import CHUNK, precision_for, shapes_of
from .cumsum import cumulative_gates
from .dv import additive_dv
from .grads import gate_grad_parts, key_channel_grads
from .intra_grads import intra_grads
from .launch import on_inputs_device, plan_for
from .output import chunk_output
from .score_grads import score_grads
from .state_bwd import backward_pass
from .state_fwd import forward_pass
from .switches import Decay
from .wy_grads import wy_grads
from .wy_prep import wy_factors


def recomputed_buffers(q: torch.Tensor, v: torch.Tensor, delta: bool, channel: bool,
                       cu_seqlens: Optional[torch.Tensor]) -> tuple:
    """Empty buffers of what the backward can recompute, ``(hs, d, Tt, Wt, Kg)``, in the dtypes of
    ``configs.precision_for``: the chunk-start states ``hs`` [slots, H, K, V]; for the delta rule only, the corrected
    writes ``d`` [B, T, H, V], ``Tt`` [B, T, H, C] and ``Wt`` [slots, H, K, C]; ``Kg`` (k e^(Gamma - G) in q's dtype,
    which the sequential passes read instead of k and G) only for the delta rule with a per-channel decay
    (``channel``). Absent ones are None."""
    s = shapes_of(q, v, cu_seqlens)
    P = precision_for(q.dtype)
    hs = q.new_empty(s.slots, s.H, s.K, s.V, dtype=P.state)
    if not delta:
        return hs, None, None, None, None
    return (hs, v.new_empty(v.shape, dtype=P.writes), q.new_empty(*q.shape[:3], CHUNK, dtype=P.wy),
            q.new_empty(s.slots, s.H, s.K, CHUNK, dtype=P.state), torch.empty_like(q) if channel else None)


def saved_buffers(q: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor], delta: bool,
                  cu_seqlens: Optional[torch.Tensor]) -> tuple:
    """Empty buffers of what the forward saves for the backward, ``(G, hs, A, d, Tt, Wt, Qg, Kg)``, in the dtypes
    of ``configs.precision_for``: ``G`` [g's shape] fp32 only with a decay (g given), the scores ``A`` [B, T, H, C],
    ``hs``, ``d``, ``Tt``, ``Wt`` and ``Kg`` as :func:`recomputed_buffers`, and ``Qg`` (q e^G in q's dtype, which the
    backward pass reads instead of q and G) only for the delta rule with a per-channel decay (else None). The
    forward fills them; ``ops`` takes its fake outputs from here too."""
    channel = g is not None and g.dim() == 4
    hs, d, Tt, Wt, Kg = recomputed_buffers(q, v, delta, channel, cu_seqlens)
    G = torch.empty_like(g, dtype=torch.float32) if g is not None else None  # (empty_like: no shape to parse)
    A = q.new_empty(*q.shape[:3], CHUNK, dtype=precision_for(q.dtype).scores)
    Qg = torch.empty_like(q) if delta and channel else None
    return G, hs, A, d, Tt, Wt, Qg, Kg


def kept(saved: tuple) -> tuple:
    """What of the forward's ``(G, hs, A, d, Tt, Wt, Qg, Kg)`` is saved for the backward: all of it with
    ``configs.KEEP_STATES``, else hs, d, Tt, Wt and Kg become None (the backward recomputes them)."""
    if configs.KEEP_STATES:
        return saved
    G, _, A, _, _, _, Qg, _ = saved
    return G, None, A, None, None, None, Qg, None


def recompute(plan: dict, s, q, k, v, beta, h0, cu_seqlens, G, decay: int) -> tuple:
    """The chunk-start states hs and, for the delta rule, the corrected writes d, Tt, Wt and (per-channel decay) Kg,
    as :func:`chunk_forward` made them, into fresh buffers: the WY stage (delta rule) and the forward pass again. G
    is the forward's, read only (a scalar decay's WY stage, which wrote it in the forward, reads it here)."""
    delta = beta is not None
    hs, d, Tt, Wt, Kg = recomputed_buffers(q, v, delta, decay == Decay.CHANNEL, cu_seqlens)
    factors = None
    if delta:
        factors = wy_factors(plan, s, k=k, v=v, beta=beta, g=None, G=G, Tt=Tt, Wt=Wt, Kg=Kg, cu_seqlens=cu_seqlens,
                             decay=decay)
    forward_pass(plan, s, k=Kg if Kg is not None else k, vu=factors.U if delta else v,
                 W=factors.W if delta else None, G=G, hs=hs, d=d, h0=h0, hN=None, cu_seqlens=cu_seqlens,
                 factors=factors, decay=decay)
    return hs, d, Tt, Wt, Kg


@on_inputs_device
def chunk_forward(q, k, v, g, beta, u, h0, cu_seqlens, scale: float, decay: int, output_final: bool):
    """Forward of the chunked recurrence.

    q, k: [B, T, H, K], v: [B, T, H, V] (one dtype); g: None, [B, T, H] or [B, T, H, K] fp32; beta: [B, T, H] or
    None; u: [H, K] or None; h0: [N, H, K, V] fp32 or None; every tensor contiguous. Returns ``(o, hN, saved)`` with
    ``saved = (G, hs, A, d, Tt, Wt, Qg, Kg)`` for the backward (:func:`kept`: hs, d, Tt, Wt, Kg None unless
    ``configs.KEEP_STATES``; ``d``, ``Tt``, ``Wt`` only for the delta rule, else None;
    ``Tt``: T transposed per chunk [B, T, H, C], ``Wt``: W transposed per chunk [slots, H, K, C], in the states'
    dtype; ``Qg``, ``Kg``: the delta rule's queries and keys decayed by a per-channel decay, see
    :func:`saved_buffers`). Absent tensors reach the kernels as None.
    """
    plan = plan_for("forward", q, k, v, g, beta, u, h0, cu_seqlens, scale, decay, output_final)
    s = shapes_of(q, v, cu_seqlens)
    delta = beta is not None
    G, hs, A, d, Tt, Wt, Qg, Kg = saved_buffers(q, v, g, delta, cu_seqlens)
    if decay == Decay.CHANNEL or (decay == Decay.SCALAR and not delta):  # (the delta rule's prep stores a scalar G)
        cumulative_gates(plan, s, g=g, G=G, cu_seqlens=cu_seqlens, decay=decay)
    factors = None
    if delta:
        factors = wy_factors(plan, s, k=k, v=v, beta=beta, g=g if decay == Decay.SCALAR else None, G=G, Tt=Tt,
                             Wt=Wt, Kg=Kg, cu_seqlens=cu_seqlens, decay=decay)
    hN = torch.empty(s.N, s.H, s.K, s.V, device=q.device, dtype=torch.float32) if output_final else None
    forward_pass(plan, s, k=Kg if Kg is not None else k, vu=factors.U if delta else v,
                 W=factors.W if delta else None, G=G, hs=hs, d=d, h0=h0, hN=hN, cu_seqlens=cu_seqlens,
                 factors=factors, decay=decay)
    o = torch.empty_like(v)
    chunk_output(plan, s, q=q, k=k, d=d if delta else v, v=v, G=G, u=u, hs=hs, A=A, o=o, Qg=Qg,
                 cu_seqlens=cu_seqlens, scale=scale, decay=decay)
    return o, hN, kept((G, hs, A, d, Tt, Wt, Qg, Kg))


@on_inputs_device
def chunk_backward(q, k, v, beta, u, h0, cu_seqlens, saved, do, dhN, scale: float, decay: int):
    """Backward of :func:`chunk_forward`: returns ``(dq, dk, dv, dg, dbeta, du, dh0)``.

    The inputs as the forward took them but the log decay g, which the backward does not read: ``saved`` (the
    forward's) holds its cumulative sums G, of g's shape. do: [B, T, H, V]; dhN: [N, H, K, V] or None. dg is fp32
    shaped like g, dbeta fp32 [B, T, H], du fp32 [H, K], dh0 fp32; entries for absent inputs are None.
    """
    G, hs, A, d, Tt, Wt, Qg, Kg = saved
    s = shapes_of(q, v, cu_seqlens)
    dev = q.device
    delta, bonus = beta is not None, u is not None
    do = do.contiguous()
    dhN = dhN.contiguous() if dhN is not None else None
    # the saved buffers are the forward's own allocations (fresh, so aligned), their dtypes and shapes functions of
    # its inputs and the settings: the key names only which are present
    plan = plan_for("backward", q, k, v, beta, u, h0, cu_seqlens, do, dhN, scale, decay, *[x is None for x in saved])
    if hs is None:
        hs, d, Tt, Wt, Kg = recompute(plan, s, q, k, v, beta, h0, cu_seqlens, G, decay)
    dHs = torch.empty_like(hs)
    dd = torch.empty_like(d) if delta else None  # the delta rule's gradient of the corrected writes
    dh0 = torch.empty_like(h0) if h0 is not None else None  # (empty_like: a shape's parsing costs microseconds)
    backward_pass(plan, s, q=Qg if Qg is not None else q, k=Kg if Kg is not None else k, Wt=Wt, G=G, A=A, do=do,
                  dd=dd, dHs=dHs, dhN=dhN, dh0=dh0, cu_seqlens=cu_seqlens, scale=scale, decay=decay, delta=delta,
                  bonus=bonus)
    dv = torch.empty_like(v)
    if not delta:
        additive_dv(plan, s, q=q, k=k, G=G, u=u, A=A, do=do, dHs=dHs, dv=dv, cu_seqlens=cu_seqlens, scale=scale,
                    decay=decay)
    dbeta = torch.empty_like(beta, dtype=torch.float32) if delta else None
    # the score gradients dA and dL, and Y, in the states' dtype: the products that read them run in it. A
    # per-channel decay's dA and dL feed tf32 products instead, and stay fp32 for fp16 inputs (the products' right
    # factors, up to 2^CHUNK_SPAN, exceed fp16's range): docs/kernels.md, "Precision"
    state_dtype = precision_for(q.dtype).state
    score_dtype = torch.float32 if decay == Decay.CHANNEL and state_dtype == torch.float16 else state_dtype
    dA = torch.empty_like(A, dtype=score_dtype)  # [B, T, H, CHUNK]
    dL = torch.empty_like(A, dtype=score_dtype) if delta else None
    Y = torch.empty_like(d, dtype=state_dtype) if delta else None
    dov = torch.empty(q.shape[:3], device=dev, dtype=torch.float32) if bonus else None
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dg_parts = gate_grad_parts(s, G, decay, bonus, q.dtype) if decay != Decay.NONE else None
    dg = dg_parts[0] if decay != Decay.NONE else None
    du = torch.empty(s.slots, s.H, s.K, device=dev, dtype=torch.float32) if bonus else None
    wy_fused = delta and decay in configs.WY_FUSED and q.dtype == torch.bfloat16
    score_grads(plan, s, q=q, v=v, beta=beta, G=G, Tt=Tt, d=d if delta else v, do=do, dd=dd, dA=dA, dL=dL, Y=Y,
                dv=dv, dbeta=dbeta, dov=dov, k=k, hs=hs, dk=dk, dg=dg, cu_seqlens=cu_seqlens, scale=scale,
                decay=decay, delta=delta, bonus=bonus, wy_fused=wy_fused)
    if delta and not wy_fused:  # dk's and dg's parts through W and L first; the key-channel stage adds the rest
        wy_grads(plan, s, k=k, beta=beta, G=G, hs=hs, Y=Y, dL=dL, dk=dk, dbeta=dbeta, dg=dg, cu_seqlens=cu_seqlens,
                 decay=decay)
    dqi = dki = None  # per-channel decays: the intra-chunk parts of dq and dk
    if decay == Decay.CHANNEL:
        dqi, dki = intra_grads(plan, s, q=q, k=k, G=G, dA=dA, cu_seqlens=cu_seqlens, bonus=bonus)
    key_channel_grads(plan, s, q=q, k=k, G=G, u=u, d=d if delta else v, hs=hs, dHs=dHs, do=do, dA=dA, dov=dov,
                      dqi=dqi, dki=dki, dq=dq, dk=dk, dg=dg, du=du, cu_seqlens=cu_seqlens, scale=scale, decay=decay,
                      delta=delta, bonus=bonus)
    if decay == Decay.SCALAR and dg_parts.shape[0] > 1:
        dg = dg_parts.sum(0)
    return dq, dk, dv, dg, dbeta, (du.sum(0) if bonus else None), dh0
