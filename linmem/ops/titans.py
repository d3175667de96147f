"""Titans' linear memory with momentum (Behrouz et al. 2025, "Titans: Learning to Memorize at Test Time",
arXiv 2501.00663, eqs. 13-14), one gradient step per token on the loss ``l(M; k, v) = |k M - v|^2 / 2``.

Per head, with the memory ``M: [K, V]``, its momentum ``S: [K, V]`` and ``grad_t = k_t^T (k_t M_{t-1} - v_t)``::

    S_t = eta_t S_{t-1} - theta_t grad_t           momentum (surprise), eta_t = exp(log_momentum_t)
    M_t = a_t M_{t-1} + rho_t S_t                  forgetting, a_t = 1 - alpha_t = exp(log_decay_t)
    o_t = scale * q_t M_t

``rho_t`` is 1 for a token and 0 for a padded one (with ``a = eta = 1``, ``theta = 0`` a padded token then
leaves both M and S as they are; without ``rho`` the momentum would still move M). The pair ``(M, S)`` is
not the one matrix of :func:`linmem.ops.linear_recurrence`: the momentum enters M through a full-rank
block, which no diagonal-plus-low-rank transition expresses; with ``eta = 0`` the rule is the recurrence's
(``linmem.layers.titans`` runs it there).

Two forms compute it: :func:`titans_momentum` (``backend="reference"``: the token loop, the ground truth;
``"chunk"``: the chunked form below) and :func:`titans_momentum_step` (one decoding step).

The chunked form. Within a chunk the predictions ``u_t = k_t M_{t-1}`` are the only non-linearity in the
data; with ``e_t = theta_t (v_t - u_t)`` every state is linear in ``(M_0, S_0, e)``::

    S_i = H_i S_0 + sum_{j<=i} (H_i / H_j) k_j^T e_j                         H_i = prod_{l<=i} eta_l
    M_t = A_t M_0 + c_t S_0 + sum_{j<=t} D_tj k_j^T e_j                      A_t = prod_{l<=t} a_l
    c_t = sum_{i<=t} (A_t / A_i) rho_i H_i,   D_tj = sum_{j<=i<=t} (A_t / A_i) rho_i (H_i / H_j)

so ``e`` solves the unit lower-triangular system ``(I + diag(theta) (D_{t-1,j} k_t.k_j)_{j<t}) e =
theta (v - A_{t-1} k M_0 - c_{t-1} k S_0)``. Everything but ``(M_0, S_0)`` is computed for all chunks at
once; a loop over the chunks carries the pair (four small matmuls per chunk). All ratios are exponentials
of differences of cumulative log gates over ``i <= t``, so they stay in ``[0, 1]``. Packed sequences
(``cu_seqlens``, read on the host) run one after the other. It is plain PyTorch: no Triton kernel, and no
custom op (``torch.compile`` breaks its graph at the host reads and traces the chunk loop unrolled).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

#: the chunk length of the chunked form
CHUNK_SIZE = 32
#: ``backend`` values of :func:`titans_momentum`
BACKENDS = ("chunk", "reference")

State = tuple[torch.Tensor, torch.Tensor]


def titans_momentum(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: torch.Tensor,
    theta: torch.Tensor,
    log_momentum: torch.Tensor,
    rho: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    backend: str = "chunk",
) -> tuple[torch.Tensor, Optional[State]]:
    """Titans' linear memory with momentum over a sequence (see the module docstring).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``, one floating dtype.
        log_decay: ``[B, T, H]`` ``log a_t = log(1 - alpha_t)`` in ``(-inf, 0]``.
        theta: ``[B, T, H]`` the inner learning rate ``theta_t >= 0``.
        log_momentum: ``[B, T, H]`` ``log eta_t`` in ``(-inf, 0]``.
        rho: ``[B, T, H]`` 1 at tokens, 0 at padding (default all 1).
        scale: read-out scale, default ``K ** -0.5``.
        initial_state: ``(M [N, H, K, V], S [N, H, K, V])``; None: zeros.
        output_final_state: also return the final ``(M, S)`` (fp32; fp64 for fp64 inputs).
        cu_seqlens: ``[N + 1]`` boundaries of N sequences packed along T (B == 1).
        backend: ``"chunk"`` or ``"reference"``.

    Returns:
        ``(o [B, T, H, V] in q's dtype, (M, S) or None)``.

    Example:
        >>> q = k = torch.nn.functional.normalize(torch.randn(1, 6, 2, 4), dim=-1)
        >>> gate = torch.full((1, 6, 2), -0.1)
        >>> o, (M, S) = titans_momentum(q, k, torch.randn(1, 6, 2, 4), log_decay=gate, theta=gate.exp() / 2,
        ...                             log_momentum=gate, output_final_state=True)
        >>> o.shape, M.shape, S.shape
        (torch.Size([1, 6, 2, 4]), torch.Size([1, 2, 4, 4]), torch.Size([1, 2, 4, 4]))
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if backend not in BACKENDS:
        raise ValueError(f"titans_momentum: unknown `backend` {backend!r}; valid: {', '.join(BACKENDS)}")
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"titans_momentum: `k` {list(k.shape)} must match `q` {list(q.shape)} and `v` "
                         f"{list(v.shape)} its [B, T, H]")
    for name, x in (("log_decay", log_decay), ("theta", theta), ("log_momentum", log_momentum), ("rho", rho)):
        if x is not None and x.shape != (B, T, H):
            raise ValueError(f"titans_momentum: `{name}` must be [B, T, H] = {[B, T, H]}, got {list(x.shape)}")
    if not q.is_floating_point() or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"titans_momentum: `q`, `k`, `v` must share one floating dtype, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        if B != 1 or not bounds or bounds[0] != 0 or bounds[-1] != T or any(a > b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"titans_momentum: `cu_seqlens` must rise from 0 to T = {T} and pack sequences along T "
                             f"(B == 1), got {bounds} with B = {B}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    acc = torch.promote_types(q.dtype, torch.float32)
    if initial_state is None:
        initial_state = (q.new_zeros(N, H, K, V, dtype=acc), q.new_zeros(N, H, K, V, dtype=acc))
    elif any(x.shape != (N, H, K, V) for x in initial_state):
        raise ValueError(f"titans_momentum: `initial_state` must be two [N, H, K, V] = {[N, H, K, V]} tensors, got "
                         f"{[list(x.shape) for x in initial_state]}")
    rho = torch.ones_like(theta) if rho is None else rho
    scale = K**-0.5 if scale is None else scale
    run = _reference if backend == "reference" else _chunked
    cast = lambda x: x.to(acc)  # noqa: E731
    inputs = tuple(map(cast, (q, k, v, log_decay, theta, log_momentum, rho)))
    state = tuple(map(cast, initial_state))
    if cu_seqlens is None:
        o, final = run(*inputs, scale, state)
    else:
        outputs, finals = [], []
        for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            o, final = run(*(x[:, start:end] for x in inputs), scale, (state[0][n : n + 1], state[1][n : n + 1]))
            outputs.append(o)
            finals.append(final)
        o = torch.cat(outputs, dim=1)
        final = (torch.cat([f[0] for f in finals]), torch.cat([f[1] for f in finals]))
    return o.to(q.dtype), (final if output_final_state else None)


def titans_momentum_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: State,
    *,
    log_decay: torch.Tensor,
    theta: torch.Tensor,
    log_momentum: torch.Tensor,
    rho: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, State]:
    """One token of N sequences: q, k ``[N, H, K]``, v ``[N, H, V]``, gates ``[N, H]``, state ``(M, S)``
    ``[N, H, K, V]`` -> ``(o [N, H, V], (M, S))``; the state tensors are updated in place when no gradient
    is recorded.

    Example:
        >>> M, S = torch.zeros(3, 2, 4, 4), torch.zeros(3, 2, 4, 4)
        >>> gate = torch.full((3, 2), -0.1)
        >>> with torch.no_grad():
        ...     o, _ = titans_momentum_step(torch.randn(3, 2, 4), torch.randn(3, 2, 4), torch.randn(3, 2, 4), (M, S),
        ...                                 log_decay=gate, theta=gate.exp(), log_momentum=gate)
        >>> o.shape, bool(M.abs().sum() > 0)
        (torch.Size([3, 2, 4]), True)
    """
    M, S = state
    acc = M.dtype
    rho = torch.ones_like(theta) if rho is None else rho
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, (M_new, S_new) = _token(*(x.to(acc) for x in (q, k, v, log_decay, theta, log_momentum, rho)), scale, (M, S))
    if not torch.is_grad_enabled():
        M.copy_(M_new)
        S.copy_(S_new)
        M_new, S_new = M, S
    return o.to(q.dtype), (M_new, S_new)


def _token(q, k, v, log_decay, theta, log_momentum, rho, scale, state):
    """One step of the rule, literally: every input ``[N, H, ...]`` in the accumulation dtype."""
    M, S = state
    grad = k[..., :, None] * (torch.einsum("nhk,nhkv->nhv", k, M) - v)[..., None, :]
    S = log_momentum.exp()[..., None, None] * S - theta[..., None, None] * grad
    M = log_decay.exp()[..., None, None] * M + rho[..., None, None] * S
    return scale * torch.einsum("nhk,nhkv->nhv", q, M), (M, S)


def _reference(q, k, v, log_decay, theta, log_momentum, rho, scale, state):
    """The token loop over ``[B, T, ...]``: ``(o [B, T, H, V], (M, S))``."""
    outputs = []
    for t in range(q.shape[1]):
        o, state = _token(q[:, t], k[:, t], v[:, t], log_decay[:, t], theta[:, t], log_momentum[:, t], rho[:, t],
                          scale, state)
        outputs.append(o)
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    return o, state


def _ratios(log: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """exp(log_t - log_s) for s <= t, exactly 0 elsewhere (exp is never taken of the other pairs): [.., C, C]."""
    return torch.exp(torch.where(causal, log[..., :, None] - log[..., None, :], float("-inf")))


def _chunked(q, k, v, log_decay, theta, log_momentum, rho, scale, state):
    """The chunked form over ``[B, T, ...]`` (see the module docstring): ``(o [B, T, H, V], (M, S))``."""
    T = q.shape[1]
    C = CHUNK_SIZE
    pad = -T % C
    n = (T + pad) // C

    def chunks(x):  # [B, T, H, ...] -> [B, H, n, C, ...], padded with neutral steps (no decay, no write)
        x = x.movedim(2, 1)
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
        return x.unflatten(2, (n, C))

    q, k, v = chunks(q), chunks(k), chunks(v)
    lA, lH = chunks(log_decay).cumsum(-1), chunks(log_momentum).cumsum(-1)  # [B, H, n, C]
    theta, rho = chunks(theta), chunks(rho)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    E = _ratios(lA, causal) * rho[..., None, :]  # A_t / A_i rho_i, i <= t
    Fm = _ratios(lH, causal)  # H_i / H_j, j <= i
    D = E @ Fm  # [.., C, C], lower triangular
    c = (E @ lH.exp()[..., None])[..., 0]  # [.., C]
    A = lA.exp()
    # the same at t - 1: the state a token's gradient reads
    D_prev = F.pad(D[..., :-1, :], (0, 0, 1, 0))
    A_prev, c_prev = F.pad(A[..., :-1], (1, 0), value=1.0), F.pad(c[..., :-1], (1, 0))
    system = torch.eye(C, dtype=q.dtype, device=q.device) + theta[..., None] * D_prev * (k @ k.transpose(-1, -2))
    W = torch.linalg.solve_triangular(system, torch.diag_embed(theta), upper=False, unitriangular=True)
    U, Wm, Ws = W @ v, W @ (A_prev[..., None] * k), W @ (c_prev[..., None] * k)  # e = U - Wm M_0 - Ws S_0
    P = D * (q @ k.transpose(-1, -2))  # o = A q M_0 + c q S_0 + P e
    Qa, Qc = A[..., None] * q, c[..., None] * q
    Kd = (D[..., -1, :, None] * k).transpose(-1, -2)  # M_C = A_C M_0 + c_C S_0 + Kd e
    Kf = (Fm[..., -1, :, None] * k).transpose(-1, -2)  # S_C = H_C S_0 + Kf e
    A_end, c_end, H_end = A[..., -1, None, None], c[..., -1, None, None], lH[..., -1, None, None].exp()
    M, S = state
    outputs = []
    for i in range(n):
        e = U[:, :, i] - Wm[:, :, i] @ M - Ws[:, :, i] @ S
        outputs.append(Qa[:, :, i] @ M + Qc[:, :, i] @ S + P[:, :, i] @ e)
        M, S = A_end[:, :, i] * M + c_end[:, :, i] * S + Kd[:, :, i] @ e, H_end[:, :, i] * S + Kf[:, :, i] @ e
    o = torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :T] if n else v.flatten(2, 3)
    return scale * o.movedim(1, 2), (M, S)
