"""Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs", arXiv 2006.16236) with the
feature maps of Based (Arora et al. 2024, "Simple linear attention language models balance the
recall-throughput tradeoff", arXiv 2402.18668) and ReBased (Aksenov et al. 2024, "Linear Transformers
with Learnable Kernel Functions are Better In-Context Models", arXiv 2402.10644).

    S_t = S_{t-1} + phi(k_t)^T v_t,      z_t = z_{t-1} + phi(k_t)
    o_t = phi(q_t) S_t / (phi(q_t) . z_t + eps)

The normaliser z_t rides in the same recurrence as a column of ones appended to v. Feature maps
(``MixerArgs.feature_map``, default ``"elu"`` as in Katharopoulos et al.):

    identity  x; no normaliser (phi(q) . z may vanish or change sign): o_t = RMSNorm(K^-1/2 q_t S_t)
    elu       elu(x) + 1
    relu      max(x, 0)
    softmax   softmax(x) over the head dim
    based     [1, x / d^(1/4), (x ⊗ x) / sqrt(2 d)] on a d = 16 projection, so that
              phi(q) . phi(k) = 1 + s + s^2 / 2 with s = q . k / sqrt(d) (2nd-order Taylor of exp(s))
    rebased   y = gamma * LayerNorm(x) + beta, then (y ⊗ y) / sqrt(d) on a d = 16 projection,
              so that phi(q) . phi(k) = (y_q . y_k)^2 / d
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .base import LayerState, MixerArgs, register_mixer
from .conv import ShortConvs
from .norms import RMSNorm
from .recurrent import MemoryMixer, RecurrenceArgs

#: Based / ReBased: per-head dimension of the q, k projections the quadratic features expand
FEATURE_DIM = 16
#: added to the normaliser phi(q_t) . z_t
DENOMINATOR_EPS = 1e-6


def outer_features(x: torch.Tensor) -> torch.Tensor:
    """x ⊗ x flattened: [..., d] -> [..., d * d], so that outer(x) . outer(y) = (x . y)^2."""
    return rearrange(x[..., :, None] * x[..., None, :], "... i j -> ... (i j)")


def taylor_features(x: torch.Tensor) -> torch.Tensor:
    """Based's feature map [..., d] -> [..., 1 + d + d^2]: phi(q) . phi(k) = 1 + s + s^2 / 2, s = q . k / sqrt(d)."""
    d = x.shape[-1]
    return torch.cat([torch.ones_like(x[..., :1]), x * d ** -0.25, outer_features(x) * (2 * d) ** -0.5], dim=-1)


_PARAMETER_FREE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda x: x,
    "elu": lambda x: F.elu(x) + 1,
    "relu": F.relu,
    "softmax": lambda x: x.softmax(dim=-1),
    "based": taylor_features,
}
#: valid values of ``MixerArgs.feature_map`` for ``linear_attention``
FEATURE_MAPS = (*_PARAMETER_FREE, "rebased")


class FeatureMap(nn.Module):
    """The feature map phi applied to q and k: ``[B, T, H, dim] -> [B, T, H, feature_dim]``."""

    def __init__(self, name: str, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        if name not in FEATURE_MAPS:
            raise ValueError(f"unknown feature_map {name!r}; valid: {', '.join(FEATURE_MAPS)}")
        self.name, self.dim = name, dim
        # ReBased's learnable affine (gamma, beta) on the normalised input, initialised to the identity
        self.norm = nn.LayerNorm(dim, eps=eps) if name == "rebased" else None

    @property
    def feature_dim(self) -> int:
        """Size of phi(x), the key dim K of the recurrence."""
        d = self.dim
        return {"based": 1 + d + d * d, "rebased": d * d}.get(self.name, d)

    @property
    def normalised(self) -> bool:
        """Whether the read-out is divided by phi(q_t) . sum_s phi(k_s) (every non-negative map)."""
        return self.name != "identity"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] -> phi(x): [..., feature_dim]."""
        if self.norm is not None:
            return outer_features(self.norm(x)) * self.dim ** -0.5
        return _PARAMETER_FREE[self.name](x)


@register_mixer("linear_attention")
class LinearAttention(MemoryMixer):
    """Linear attention with a feature map on q, k, normalised by phi(q_t) . sum_s phi(k_s)."""

    memory_projections = ("k_proj", "v_proj")

    @classmethod
    def validate_args(cls, args: MixerArgs) -> None:
        super().validate_args(args)
        if args.feature_map is not None and args.feature_map not in FEATURE_MAPS:
            raise ValueError(f"linear_attention: unknown `feature_map` {args.feature_map!r}; "
                             f"valid: {', '.join(FEATURE_MAPS)}")

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        name = args.feature_map or "elu"
        D, H, V = args.hidden_size, args.num_heads, args.value_dim
        d = FEATURE_DIM if name in ("based", "rebased") else args.key_dim
        self.feature_map = FeatureMap(name, d, eps=args.norm_eps)
        self.q_proj = nn.Linear(D, H * d, bias=False)
        self.k_proj = nn.Linear(D, H * d, bias=False)
        self.v_proj = nn.Linear(D, H * V, bias=False)
        self.convs = ShortConvs({"q": H * d, "k": H * d, "v": H * V}, args)
        self.o_norm = nn.Identity() if self.feature_map.normalised else RMSNorm(V, eps=args.norm_eps)
        self.o_proj = nn.Linear(H * V, D, bias=False)

    def recurrence_inputs(
        self,
        hidden: torch.Tensor,
        *,
        cache: Optional[LayerState],
        cu_seqlens: Optional[torch.Tensor],
        projected: Optional[dict[str, torch.Tensor]] = None,
    ) -> RecurrenceArgs:
        q, k, v = self.convolved_qkv(hidden, cache=cache, cu_seqlens=cu_seqlens, projected=projected)
        q, k = self.feature_map(q), self.feature_map(k)
        if not self.feature_map.normalised:
            return RecurrenceArgs(q=q, k=k, v=v)
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # the last column accumulates z_t
        return RecurrenceArgs(q=q, k=k, v=v, scale=1.0)

    def output(self, o: torch.Tensor, hidden: torch.Tensor, args: RecurrenceArgs) -> torch.Tensor:
        if self.feature_map.normalised:
            o = (o[..., :-1] / (o[..., -1:].float() + DENOMINATOR_EPS)).to(o.dtype)  # divided in fp32
        o = self.o_norm(o)
        return self.o_proj(rearrange(o, "b t h d -> b t (h d)"))
