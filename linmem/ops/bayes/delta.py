"""The covariance-reset filter is the delta rule: an exact parallel form through ``linear_recurrence``.

With ``reset=True`` every step starts from ``P^- = p I``, so ``u = p k`` and ``s = p |k|^2 + r``;
the mean update becomes

    M_t = a M_{t-1} + beta_t k (v_t - (a M_{t-1})^T k)^T,   beta_t = p / (p |k_t|^2 + r_t),

the gated delta rule with the same decay, which the chunked backends of ``linear_recurrence`` compute
exactly (no approximation: the same recursion, reassociated). The covariance after step t is
``P_t = p I - p^2 k k^T / s_t``, so ``var_t = p |q|^2 - p^2 (q . k)^2 / s_t + r_t`` in closed form.
The given initial covariance is not read (each step resets it); a sequence with no tokens keeps it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..recurrence import linear_recurrence
from .inputs import FilterInputs, State, compute_dtype
from .reference import initial_belief


def _last_tokens(inputs: FilterInputs, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, H, ...] at each sequence's last token -> [N, H, ...], and whether the sequence has tokens [N]."""
    if inputs.cu_seqlens is None:
        T = x.shape[1]
        present = torch.full((x.shape[0],), T > 0, device=x.device)
        return x[:, max(T - 1, 0)] if T else x.new_zeros(x.shape[0], *x.shape[2:]), present
    cu = inputs.cu_seqlens.long()
    present = cu[1:] > cu[:-1]
    return x[0, (cu[1:] - 1).clamp_min(0)], present


def delta_filter(
    inputs: FilterInputs, recurrence: Callable[..., tuple[torch.Tensor, Optional[torch.Tensor]]] = linear_recurrence
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[State]]:
    """The "delta" backend of :func:`linmem.ops.bayes_filter` for ``reset=True`` (inputs already validated).

    ``recurrence`` computes the mean, with the arguments of ``linear_recurrence`` (sequence parallelism passes
    its own); the covariance and the variance are per token."""
    acc = compute_dtype(inputs.q)
    p = inputs.prior
    k = inputs.k.to(acc)
    r = inputs.obs_noise.to(acc)
    s = p * (k * k).sum(-1) + r  # [B, T, H]
    M0 = None if inputs.initial_state is None else inputs.initial_state[0].to(acc)
    o, M = recurrence(
        inputs.q, inputs.k, inputs.v, log_decay=inputs.log_decay.to(acc), beta=p / s, scale=inputs.scale,
        initial_state=M0, output_final_state=inputs.output_final_state, cu_seqlens=inputs.cu_seqlens,
    )
    var = None
    if inputs.return_variance:
        q = inputs.q.to(acc)
        var = p * (q * q).sum(-1) - p * p * (q * k).sum(-1) ** 2 / s + r
    if not inputs.output_final_state:
        return o, var, None
    k_last, present = _last_tokens(inputs, k)  # [N, H, K], [N]
    s_last, _ = _last_tokens(inputs, s)  # [N, H]
    s_last = torch.where(present[:, None], s_last, torch.ones_like(s_last))  # finite for a sequence with no tokens
    eye = torch.eye(k.shape[-1], dtype=acc, device=k.device)
    P_last = p * eye - p * p * k_last[..., :, None] * k_last[..., None, :] / s_last[..., None, None]
    _, P0 = initial_belief(inputs, 0, inputs.num_sequences, acc)
    P = torch.where(present[:, None, None, None], P_last, P0)
    return o, var, (M, P)
