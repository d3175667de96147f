"""The layers' glue as fused kernels: short convolution, L2 norm, RMSNorm (residual add, output gate), SwiGLU,
rotary position embedding, linear + cross-entropy.

Each op has a readable PyTorch form in :mod:`linmem.ops.fused.reference`, Triton kernels forward and backward
(under autograd in eager mode, as ``torch.library`` custom ops under ``torch.compile``) and ``backend=``:
``"auto"`` runs the kernels on CUDA and the PyTorch form elsewhere (see :mod:`linmem.ops.fused.backend`).
"""

from .backend import BACKENDS
from .conv import short_conv, short_conv_step
from .cross_entropy import linear_cross_entropy
from .norm import gated_rms_norm, l2_norm, rms_norm
from .glu import swiglu, swiglu_grads
from .rotary import rotary

__all__ = [
    "BACKENDS",
    "short_conv",
    "short_conv_step",
    "l2_norm",
    "rms_norm",
    "gated_rms_norm",
    "swiglu",
    "swiglu_grads",
    "rotary",
    "linear_cross_entropy",
]
