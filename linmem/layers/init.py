"""Weight initialisers and the linear maps that carry them, and the Mamba-2 gate init.

Every module with parameters has ``reset_parameters()``. Its constructor calls it, and the model calls
it again for parameters a checkpoint does not hold, so a loaded model and a new one start alike. A
``reset_parameters`` sets what the constructor sets: the module's own parameters and those of children
that have no ``reset_parameters`` of their own (a :class:`~linmem.layers.lora.LoRA`); never a child that has one
(a child ``nn.Linear`` initialises itself: give it its scheme as :class:`Linear` ``init``).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Optional

import torch
from torch import nn

#: a weight initialiser: fills the tensor in place
Init = Callable[[torch.Tensor], object]


def _torch_init(name: str, tensor: torch.Tensor, **kwargs: float) -> object:
    # looked up at call time, so that callers who patch torch.nn.init (transformers' loading) see it
    return getattr(nn.init, name)(tensor, **kwargs)


def normal_init(std: float) -> Init:
    """N(0, std^2) weights."""
    return partial(_torch_init, "normal_", std=std)


def xavier_init(gain: float = 1.0) -> Init:
    """Xavier-uniform weights with ``gain``."""
    return partial(_torch_init, "xavier_uniform_", gain=gain)


def orthogonal_init(gain: float = 1.0) -> Init:
    """(Semi-)orthogonal weights scaled by ``gain``."""
    return partial(_torch_init, "orthogonal_", gain=gain)


def zeros_init() -> Init:
    """All-zero weights."""
    return partial(_torch_init, "zeros_")


class Linear(nn.Linear):
    """``nn.Linear`` whose weight starts as ``init`` says (its bias at zero); ``init=None`` keeps
    torch's default (Kaiming-uniform weight, uniform bias). x ``[..., d_in]`` -> ``[..., d_out]``.

    Example:
        >>> Linear(16, 8, init=normal_init(0.02))(torch.randn(3, 16)).shape
        torch.Size([3, 8])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, init: Optional[Init] = None) -> None:
        self.init = init  # set before nn.Linear.__init__, which calls reset_parameters
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        if self.init is None:
            super().reset_parameters()
            return
        self.init(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


def low_rank(d_in: int, rank: int, d_out: int, *, bias: bool = False, init: Optional[Init] = None) -> nn.Sequential:
    """``W_up W_down x`` as two linear maps ``[d_in -> rank -> d_out]`` (the up map may have a bias)."""
    return nn.Sequential(Linear(d_in, rank, init=init), Linear(rank, d_out, bias=bias, init=init))


def mamba2_dt_bias(shape: tuple[int, ...] | int, dt_min: float = 1e-3, dt_max: float = 0.1,
                   device: Optional[torch.device] = None) -> torch.Tensor:
    """Inverse-softplus of dt drawn log-uniformly in [dt_min, dt_max] (Mamba-2's initialisation)."""
    u = torch.rand(shape, device=device)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=1e-4)
    return dt + torch.log(-torch.expm1(-dt))


#: range of the initial A = exp(A_log) of Mamba-2-style decays, drawn uniformly per head (A_init_range)
A_INIT_RANGE = (1.0, 16.0)


def mamba2_a_log(shape: tuple[int, ...] | int, device: Optional[torch.device] = None) -> torch.Tensor:
    """log A with A uniform in :data:`A_INIT_RANGE` (Mamba-2, Gated DeltaNet, KDA)."""
    return torch.empty(shape, device=device).uniform_(*A_INIT_RANGE).log()


@torch.no_grad()
def init_mamba2_gate_(A_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
    """Mamba-2's init of a decay ``-exp(A_log) * softplus(. + dt_bias)`` (Mamba-2, Gated DeltaNet, KDA)."""
    A_log.copy_(mamba2_a_log(A_log.shape, device=A_log.device))
    dt_bias.copy_(mamba2_dt_bias(dt_bias.shape, device=dt_bias.device))
