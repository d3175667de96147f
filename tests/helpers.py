"""Shared test helpers: random inputs of the unified recurrence, the error ratio of the backend tests
(docs/architecture.md, "What the tests guarantee"), and the device the Triton kernels' tests run on."""

from __future__ import annotations

import importlib.util
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

DECAY_KINDS = ("none", "constant", "scalar", "vector", "full")
RULES = ("additive", "delta", "dplr")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """rms(x - ref) / rms(ref), the error ratio of the backend tests."""
    x, ref = x.double(), ref.double()
    denom = ref.pow(2).mean().sqrt().clamp_min(1e-30)
    return float((x - ref).pow(2).mean().sqrt() / denom)


def triton_kernels_device() -> str:
    """The device the Triton kernels' tests run on: "cuda", or "cpu" through the Triton interpreter
    (``TRITON_INTERPRET=1``, which tests/conftest.py sets on machines without CUDA before triton is first
    imported). Where the kernels can run neither way, skips the calling test module (or test), saying why.

    Example (at the top of a test module, before the kernels are imported)::

        DEVICE = triton_kernels_device()
    """
    if importlib.util.find_spec("triton") is None:
        pytest.skip("the triton package is not installed", allow_module_level=True)
    if torch.cuda.is_available():
        return "cuda"
    from linmem.ops.recurrence.triton.numerics import INTERPRET

    if not INTERPRET:
        pytest.skip("no CUDA device, and the Triton interpreter is off (TRITON_INTERPRET=1 must be set before "
                    "triton is first imported)", allow_module_level=True)
    return "cpu"


def decay_shape(kind: str, B: int, T: int, H: int, K: int, V: int) -> Optional[tuple]:
    return {"none": None, "constant": (H,), "scalar": (B, T, H), "vector": (B, T, H, K),
            "full": (B, T, H, K, V)}[kind]


def make_inputs(
    kind: str,
    rule: str,
    bonus: bool,
    B: int,
    T: int,
    H: int,
    K: int,
    V: int,
    *,
    dtype: torch.dtype = torch.float32,
    initial_state: bool = True,
    decay_strength: float = 2.0,
    generator: Optional[torch.Generator] = None,
) -> dict:
    """Random, well-conditioned inputs of linear_recurrence, by argument name.

    Keys are L2-normalised and beta lies in (0, 1) for the delta rule; the DPLR
    transition is the RWKV-7 form diag(w) - kappa^T (kappa * c) with c in (0, 1),
    so every rule is contractive and long sequences stay bounded.
    """
    gen = generator
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    t = {"q": rnd(B, T, H, K), "k": F.normalize(rnd(B, T, H, K), dim=-1), "v": rnd(B, T, H, V)}
    shape = decay_shape(kind, B, T, H, K, V)
    if shape is not None:
        t["log_decay"] = F.logsigmoid(rnd(*shape) + decay_strength)
    if rule == "delta":
        t["beta"] = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    if rule == "dplr":
        kappa = F.normalize(rnd(B, T, H, K), dim=-1)
        t["a"] = -kappa
        t["b"] = kappa * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    if bonus:
        t["bonus"] = rnd(H, K)
    if initial_state:
        t["initial_state"] = rnd(B, H, K, V)
    t = {name: x.to(dtype if name != "log_decay" else max_float(dtype)) for name, x in t.items()}
    return t


def max_float(dtype: torch.dtype) -> torch.dtype:
    """Gates stay fp32 (or fp64) whatever the activation dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def run_with_grads(fn, tensors: dict, seed: int = 0, **kwargs):
    """Run fn(**tensors, output_final_state=True) and backprop random cotangents.

    Returns (o, final_state, {name: grad}) for every input tensor.
    """
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in tensors.items()}
    o, S = fn(**leaves, output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    dS = torch.randn(S.shape, generator=gen, dtype=torch.float64).to(S.dtype)
    loss = (o * do).sum() + (S * dS).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return o.detach(), S.detach(), dict(zip(leaves, grads))
