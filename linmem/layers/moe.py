"""Feed-forward layers: the dense SwiGLU MLP and the mixture of SwiGLU experts (Linear-MoE, Sun et al.
2025, arXiv 2503.05447).

Every feed-forward takes ``(x [B, T, D], token_mask [B, T] or None)`` and returns ``[B, T, D]``; the
mixture also leaves ``router_stats`` after each call and reports ``inactive_parameter_count()``.

    y = sum_{e in top-k(x)} w_e(x) SwiGLU_e(x)  +  SwiGLU_shared(x)
    SwiGLU(x) = W_down (silu(W_gate x) * W_up x)

The router scores ``softmax(W_r x)`` (or ``sigmoid``), keeps the top k experts and renormalises
their weights. Expert weights are stacked (``gate_up: [E, 2F, D]``, ``down: [E, D, F]``); tokens are
sorted by expert and every expert runs once on its rows (:func:`linmem.ops.routing.grouped_linear`:
one ``torch._grouped_mm`` on Hopper-class GPUs, a loop over experts elsewhere). Dropless by default;
with ``capacity_factor`` an expert takes at most ``ceil(factor * N * k / E)`` tokens, the earliest
first, and the dropped assignments contribute nothing (the residual carries those tokens).
Shared experts are fused into one SwiGLU of width ``num_shared_experts * F``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.checks import as_dtype
from ..ops.fused import swiglu, swiglu_grads
from ..ops.routing import (
    GROUPED_BACKENDS,
    ROUTERS,
    RouterStats,
    capacity_of,
    combine,
    dispatch,
    grouped_linear,
    limit_capacity,
    router_logits,
    router_stats,
    top_k_routing,
)
from .base import check_choice, check_float, check_int
from .init import Linear, normal_init


class _SwiGLUDown(torch.autograd.Function):
    """``swiglu(gate, up) @ weight.T`` keeping gate and up (views of one projection) but not their product:
    the backward recomputes it for the weight's gradient. The matmuls run in the output's dtype (autocast's)."""

    @staticmethod
    def forward(ctx, gate, up, weight):
        ctx.save_for_backward(gate, up, weight)
        return F.linear(swiglu(gate, up), weight)

    @staticmethod
    def backward(ctx, dy):
        gate, up, weight = ctx.saved_tensors
        if torch.is_autocast_enabled(dy.device.type):  # (building the context manager costs microseconds)
            with torch.autocast(dy.device.type, enabled=False):
                return _swiglu_down_grads(gate, up, weight, dy, ctx.needs_input_grad[2])
        return _swiglu_down_grads(gate, up, weight, dy, ctx.needs_input_grad[2])


def _swiglu_down_grads(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor,
                       weight_grad: bool) -> tuple:
    """(dgate, dup, dweight or None) of :class:`_SwiGLUDown`, its matmuls in dy's dtype (autocast off)."""
    dweight = None
    if weight_grad:
        h = swiglu(gate, up)  # [..., F], recomputed
        dweight = as_dtype(dy.flatten(0, -2).T @ as_dtype(h.flatten(0, -2), dy.dtype), weight.dtype)  # [D, F]
    dh = as_dtype(dy @ as_dtype(weight, dy.dtype), gate.dtype)  # [..., F]
    dgate, dup = swiglu_grads(gate, up, dh)
    return dgate, dup, dweight


def swiglu_down(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The end of a SwiGLU MLP, ``W_down (silu(gate) * up)``: gate, up ``[..., F]``, weight ``[D, F]`` -> ``[..., D]``.

    The ``[..., F]`` product is not kept for the backward (which recomputes it); under ``torch.compile`` this is
    the plain expression and the compiler decides.

    Example:
        >>> gate, up = torch.randn(2, 5, 64).chunk(2, dim=-1)
        >>> swiglu_down(gate, up, torch.randn(16, 32)).shape
        torch.Size([2, 5, 16])
    """
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return F.linear(swiglu(gate, up), weight)
    return _SwiGLUDown.apply(gate, up, weight)


class SwiGLU(nn.Module):
    """down(silu(x W_gate) * x W_up): x ``[..., D]`` -> ``[..., D]``, weights N(0, std^2).

    Example:
        >>> SwiGLU(16, 32, std=0.02)(torch.randn(2, 5, 16)).shape
        torch.Size([2, 5, 16])
    """

    def __init__(self, hidden_size: int, intermediate_size: int, std: float) -> None:
        super().__init__()
        self.gate_up = Linear(hidden_size, 2 * intermediate_size, init=normal_init(std))
        self.down = Linear(intermediate_size, hidden_size, init=normal_init(std))

    def forward(self, x: torch.Tensor, token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: ``[..., D]``; ``token_mask`` is accepted for the feed-forward interface (a dense MLP needs none)."""
        return swiglu_down(*self.gate_up(x).chunk(2, dim=-1), self.down.weight)


@dataclass
class MoEArgs:
    """Hyper-parameters of :class:`MoEFeedForward`, and the weights of its routers' losses in a model's loss."""

    hidden_size: int  # model width D
    intermediate_size: int  # width F of every expert
    num_experts: int = 8  # routed experts E
    num_experts_per_tok: int = 2  # experts per token k
    num_shared_experts: int = 0  # always-on experts (fused into one SwiGLU of width num_shared_experts * F)
    router: str = "softmax"  # router scores: softmax or sigmoid
    capacity_factor: Optional[float] = None  # None = dropless; else tokens per expert <= ceil(factor * N * k / E)
    init_std: float = 0.02  # std of the normal init of router and experts
    expert_backend: str = "auto"  # grouped_linear backend: auto, grouped_mm or loop
    aux_loss_coef: float = 0.01  # weight of the balancing loss (mean over the layers) in a model's loss
    z_loss_coef: float = 0.001  # weight of the router z-loss (mean over the layers) in a model's loss

    def validate(self, owner: str = "MoEArgs") -> "MoEArgs":
        """Refuse a field of the wrong type or outside its range, naming it and the valid range."""
        for name in ("hidden_size", "intermediate_size", "num_experts"):
            check_int(owner, name, getattr(self, name), minimum=1)
        check_int(owner, "num_experts_per_tok", self.num_experts_per_tok, minimum=1)
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"{owner}: `num_experts_per_tok` = {self.num_experts_per_tok} must lie in [1, "
                             f"num_experts = {self.num_experts}]")
        check_int(owner, "num_shared_experts", self.num_shared_experts, minimum=0)
        check_choice(owner, "router", self.router, ROUTERS)
        check_float(owner, "capacity_factor", self.capacity_factor, minimum=0.0, optional=True)
        check_float(owner, "init_std", self.init_std, minimum=0.0, inclusive=True)
        check_choice(owner, "expert_backend", self.expert_backend, GROUPED_BACKENDS)
        check_float(owner, "aux_loss_coef", self.aux_loss_coef, minimum=0.0, inclusive=True)
        check_float(owner, "z_loss_coef", self.z_loss_coef, minimum=0.0, inclusive=True)
        return self


class MoEFeedForward(nn.Module):
    """A mixture of SwiGLU experts with optional shared experts: x ``[B, T, D]`` -> ``[B, T, D]``.

    After each call ``router_stats`` holds the layer's :class:`~linmem.ops.routing.RouterStats`
    (balancing loss, z-loss, expert load), which the model collects.

    Example:
        >>> moe = MoEFeedForward(MoEArgs(hidden_size=16, intermediate_size=32, num_experts=4))
        >>> moe(torch.randn(2, 5, 16)).shape, moe.router_stats.load.shape
        (torch.Size([2, 5, 16]), torch.Size([4]))
    """

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.args = args.validate()
        E, D, Fw = args.num_experts, args.hidden_size, args.intermediate_size
        self.router = Linear(D, E, init=normal_init(args.init_std))
        self.gate_up = nn.Parameter(torch.empty(E, 2 * Fw, D))  # per expert: [gate; up] rows, nn.Linear layout
        self.down = nn.Parameter(torch.empty(E, D, Fw))
        shared = args.num_shared_experts * Fw
        self.shared = SwiGLU(D, shared, args.init_std) if shared else None
        self.router_stats: Optional[RouterStats] = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for weight in (self.gate_up, self.down):
            nn.init.normal_(weight, std=self.args.init_std)

    def forward(self, x: torch.Tensor, token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: ``[B, T, D]``; token_mask: ``[B, T]`` bool, False at padding (routed nowhere, left out of the stats)."""
        a = self.args
        flat = x.reshape(-1, x.shape[-1])
        logits = router_logits(flat, self.router.weight)
        weights, experts, probs = top_k_routing(logits, a.num_experts_per_tok, a.router)
        valid = None if token_mask is None else token_mask.reshape(-1)
        self.router_stats = router_stats("moe", logits, probs, experts, valid)
        keep = None if valid is None else valid[:, None].expand_as(experts)
        d = dispatch(experts, num_groups=a.num_experts, keep=keep)
        if a.capacity_factor is not None:
            tokens = flat.shape[0] if valid is None else int(valid.sum())
            d = limit_capacity(d, capacity_of(tokens, a.num_experts_per_tok, a.num_experts, a.capacity_factor))
        y = combine(self.experts(flat[d.token], d.group_sizes), d, weights).to(x.dtype)
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.view_as(x)

    def experts(self, rows: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        """SwiGLU of every expert on its rows: rows ``[A, D]`` sorted by expert -> ``[A, D]``."""
        backend = self.args.expert_backend
        gate, up = grouped_linear(rows, self.gate_up, group_sizes, backend).chunk(2, dim=-1)
        return grouped_linear(swiglu(gate, up), self.down, group_sizes, backend)

    def inactive_parameter_count(self) -> int:
        """Parameters of the experts a token does not use: ``(E - k) * (gate_up + down of one expert)``."""
        per_expert = self.gate_up[0].numel() + self.down[0].numel()
        return (self.args.num_experts - self.args.num_experts_per_tok) * per_expert
