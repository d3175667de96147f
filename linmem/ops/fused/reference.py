"""The layers' glue in plain PyTorch: the ground truth of the fused kernels.

Every function computes in fp32 (fp64 for fp64 inputs) and returns the input's dtype, as the
kernels do; autograd gives the gradients. Shapes::

    short_conv        y_t = act(b + sum_i w[:, i] * x_(t - W + 1 + i))     x, y: [B, T, C], w: [C, W]
    l2_norm           y = x / sqrt(sum(x^2) + eps)                        over the last dim
    rms_norm          y = x / sqrt(mean(x^2) + eps) * w                   over the last dim
    gated_rms_norm    y = rms_norm(x) * act(gate)
    swiglu            y = silu(gate) * up
    rotary            y = x * cos(p f_i) + rotate_half(x) * sin(p f_i)     x: [B, T, H, D], p: [B, T]
                      f_i = theta^(-2i/D), rescaled by a Llama 3 / linear scaling (rope_frequencies)
    linear_cross_entropy  mean_n (logsumexp(h_n W^T) - (h_n W^T)[label_n])

Keep this file short and literal; it is the oracle of ``linmem.ops.fused``.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor


def compute_dtype(x: Tensor) -> torch.dtype:
    """fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def activate(z: Tensor, activation: Optional[str]) -> Tensor:
    """None (identity), "silu" or "sigmoid" applied to z."""
    if activation is None:
        return z
    return F.silu(z) if activation == "silu" else torch.sigmoid(z)


def sequences(x: Tensor, cu_seqlens: Optional[Tensor]) -> list[Tensor]:
    """The sequences of x [B, T, C]: each batch row, or each ``cu_seqlens`` span of row 0 (B == 1)."""
    if cu_seqlens is None:
        return list(x.unbind(0))
    bounds = cu_seqlens.tolist()
    return [x[0, bos:eos] for bos, eos in zip(bounds[:-1], bounds[1:])]


def short_conv(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    *,
    activation: Optional[str] = None,
    cu_seqlens: Optional[Tensor] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """Causal depthwise convolution: x [B, T, C], weight [C, W], bias [C] -> (y [B, T, C], final [N, W-1, C]).

    Sequence n starts from its history ``initial_state[n]`` ([N, W-1, C], oldest first; zeros if None)
    and its final state is its last W-1 inputs (history included when it is shorter than W-1).
    """
    dt = compute_dtype(x)
    C, W = weight.shape
    outputs, finals = [], []
    for n, xs in enumerate(sequences(x, cu_seqlens)):  # xs: [L, C]
        past = xs.new_zeros(W - 1, C) if initial_state is None else initial_state[n].to(x.dtype)
        seen = torch.cat([past, xs]).to(dt)  # [W - 1 + L, C]
        L = xs.shape[0]
        z = sum(weight[:, i].to(dt) * seen[i:i + L] for i in range(W))  # tap i reads x_(t - (W - 1 - i))
        if bias is not None:
            z = z + bias.to(dt)
        outputs.append(activate(z, activation).to(x.dtype))
        finals.append(seen[seen.shape[0] - (W - 1):].to(x.dtype))
    y = torch.stack(outputs) if cu_seqlens is None else torch.cat(outputs)[None]
    return y, (torch.stack(finals) if output_final_state else None)


def short_conv_step(
    x: Tensor, state: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None
) -> Tensor:
    """One token x [B, C] against the history ``state`` [B, W-1, C] (updated in place) -> y [B, C]."""
    dt = compute_dtype(x)
    seen = torch.cat([state.to(dt), x[:, None].to(dt)], dim=1)  # [B, W, C]
    z = torch.einsum("bwc,cw->bc", seen, weight.to(dt))
    if bias is not None:
        z = z + bias.to(dt)
    state.copy_(seen[:, 1:])
    return activate(z, activation).to(x.dtype)


def l2_norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim."""
    x32 = x.to(compute_dtype(x))
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm(
    x: Tensor, weight: Tensor, eps: float = 1e-6, residual: Optional[Tensor] = None, residual_out: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """h = x (+ residual); y = h / sqrt(mean(h^2) + eps) * weight over the last dim, in out_dtype (x's when None);
    -> y, or (y, h)."""
    if residual is None:
        h = x
    else:  # the pre-norm stream, summed in fp32 (at least) and kept in the residual's dtype
        dt = torch.promote_types(compute_dtype(x), residual.dtype)
        h = (x.to(dt) + residual.to(dt)).to(residual.dtype)
    h32 = h.to(compute_dtype(h))
    y = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps) * weight.to(h32.dtype)
    y = y.to(x.dtype if out_dtype is None else out_dtype)
    return (y, h) if residual_out else y


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float = 1e-6, activation: str = "silu") -> Tensor:
    """rms_norm(x) * act(gate), all in fp32: x, gate [..., D], weight [D] (or the trailing dims of x)."""
    dt = compute_dtype(x)
    x32 = x.to(dt)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.to(dt)
    return (normed * activate(gate.to(dt), activation)).to(x.dtype)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up."""
    dt = compute_dtype(gate)
    return (F.silu(gate.to(dt)) * up.to(dt)).to(gate.dtype)


def swiglu_grads(gate: Tensor, up: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    """(dgate, dup) of :func:`swiglu` for its output's gradient dy: ``dup = dy silu(gate)``,
    ``dgate = dy up sigmoid(gate) (1 + gate (1 - sigmoid(gate)))``, in the dtypes of gate and up."""
    dt = compute_dtype(gate)
    g, u, d = gate.to(dt), up.to(dt), dy.to(dt)
    s = torch.sigmoid(g)
    return ((d * u) * s * (1 + g * (1 - s))).to(gate.dtype), (d * F.silu(g)).to(up.dtype)


def rope_frequencies(dim: int, theta: float, scaling: Optional[dict] = None, *,
                     device: Optional[torch.device] = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """[dim / 2] rotation frequencies theta^(-2i / dim), rescaled as ``scaling`` says (None: none).

    ``scaling`` is a checkpoint's ``rope_scaling`` dict: ``rope_type`` "default" (none), "linear" (every
    frequency divided by ``factor``: position interpolation) or "llama3" (Llama 3.1: the short wavelengths,
    below L / high_freq_factor with L = original_max_position_embeddings, kept; the long ones, above
    L / low_freq_factor, divided by ``factor``; a linear blend in L / wavelength between).

    Example:
        >>> rope_frequencies(4, 10000.0, {"rope_type": "linear", "factor": 2.0}).tolist()
        [0.5, 0.004999999888241291]
    """
    steps = torch.arange(0, dim, 2, dtype=dtype, device=device)  # 2i
    freq = 1.0 / (theta ** (steps / dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "linear":
        return freq / scaling["factor"]
    if kind == "llama3":
        factor, context = scaling["factor"], scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        periods_in_context = context * freq / (2 * math.pi)  # L / wavelength
        blend = ((periods_in_context - low) / (high - low)).clamp(0.0, 1.0)  # 0: long wavelength, 1: short
        return (1 - blend) * freq / factor + blend * freq
    return freq


def rotary(q: Tensor, k: Optional[Tensor], position_ids: Tensor, theta: float = 10000.0,
           scaling: Optional[dict] = None) -> tuple[Tensor, Optional[Tensor]]:
    """Rotary position embedding, rotate-half form, of q [B, T, H, D] and k [B, T, Hkv, D] (or None) at the
    integer positions [B, T]: each head's halves (x1, x2) turn by the angles p f_i, i < D/2, with the frequencies
    f of :func:`rope_frequencies`."""
    D, dt = q.shape[-1], compute_dtype(q)
    inv_freq = rope_frequencies(D, theta, scaling, device=q.device, dtype=dt)  # [D/2]
    angles = position_ids.to(dt)[..., None] * inv_freq  # [B, T, D/2]
    cos, sin = angles.cos(), angles.sin()
    cos, sin = torch.cat([cos, cos], -1)[:, :, None, :], torch.cat([sin, sin], -1)[:, :, None, :]  # [B, T, 1, D]

    def rotate(x: Tensor) -> Tensor:
        x_ = x.to(dt)
        x1, x2 = x_.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)  # rotate_half(x)
        return (x_ * cos + rotated * sin).to(x.dtype)

    return rotate(q), (None if k is None else rotate(k))


def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, *, ignore_index: int = -100, reduction: str = "mean"
) -> Tensor:
    """Cross-entropy of the logits hidden [N, D] @ weight [V, D]^T (in the activation dtype) against labels [N]."""
    logits = hidden @ weight.T  # [N, V]
    return F.cross_entropy(logits.to(compute_dtype(hidden)), labels, ignore_index=ignore_index, reduction=reduction)
