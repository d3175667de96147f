"""The chunked linear + cross-entropy (``linmem.ops.fused.linear_cross_entropy``) against
``F.cross_entropy(hidden @ weight.T)``: the loss and both gradients, with ignored rows, fp32 and bf16 (error
ratio < 1e-4 / < 5e-3 against the fp64 reference), and the memory bound: no tensor of N x vocab elements is
ever allocated. Without CUDA the softmax-gradient kernel runs through the Triton interpreter.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import rel_err, triton_kernels_device

DEVICE = triton_kernels_device()

from linmem.ops.fused import linear_cross_entropy  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-3}


@pytest.fixture(autouse=True)
def no_fallback(caplog):
    """A test of the kernels fails if they quietly handed its inputs to PyTorch."""
    caplog.set_level(logging.DEBUG, logger="linmem.ops")
    yield
    assert not [r for r in caplog.records if "cannot serve" in r.getMessage()]


def problem(N, D, V, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=gen).to(dtype)
    weight = (torch.randn(V, D, generator=gen) / D ** 0.5).to(dtype)
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[::4] = -100
    return hidden.to(DEVICE), weight.to(DEVICE), labels.to(DEVICE)


def loss_and_grads(hidden, weight, labels, **kwargs):
    h, w = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    loss = linear_cross_entropy(h, w, labels, **kwargs)
    return (loss, *torch.autograd.grad(loss, [h, w]))


@pytest.mark.parametrize("backend", ["triton", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_equals_cross_entropy_of_the_logits(dtype, backend):
    """Chunks of 8 rows over 13 (the last one partial), a quarter of the rows ignored."""
    hidden, weight, labels = problem(13, 16, 50, dtype)
    ref = loss_and_grads(hidden.double(), weight.double(), labels, backend="reference")
    got = loss_and_grads(hidden, weight, labels, chunk_size=8, backend=backend)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == dtype
    errors = [rel_err(g, r) for g, r in zip(got, ref)]
    assert max(errors) < TOL[dtype], errors


def test_sum_reduction_and_the_incoming_gradient():
    """reduction="sum", and a loss scaled before its backward (gradient accumulation) scales both gradients."""
    hidden, weight, labels = problem(10, 8, 30, torch.float32)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    (0.25 * linear_cross_entropy(h, w, labels, reduction="sum", chunk_size=4, backend="triton")).backward()
    h_ref, w_ref = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    (0.25 * F.cross_entropy(h_ref @ w_ref.T, labels, reduction="sum")).backward()
    assert rel_err(h.grad, h_ref.grad) < 1e-5 and rel_err(w.grad, w_ref.grad) < 1e-5


def test_every_row_ignored_as_f_cross_entropy():
    """No target: NaN loss (0 / 0, as F.cross_entropy), zero gradients."""
    hidden, weight, _ = problem(6, 8, 20, torch.float32)
    loss, dh, dw = loss_and_grads(hidden, weight, torch.full((6,), -100, device=DEVICE), backend="triton")
    assert torch.isnan(loss) and not dh.any() and not dw.any()


class LargestAllocation(TorchDispatchMode):
    """Records the most elements of any tensor an aten op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_the_logits_are_never_materialised():
    """N = 64 rows, vocab 200, chunks of 8: the largest tensor is one chunk of logits (8 x 200), never 64 x 200;
    F.cross_entropy of the full logits allocates 64 x 200. (The PyTorch chunks; the Triton kernel runs the same
    loop and overwrites the chunk in place, allocating only its [8] losses.)"""
    N, D, V, chunk = 64, 4, 200, 8
    hidden, weight, labels = problem(N, D, V, torch.float32)
    with LargestAllocation() as counter:
        loss_and_grads(hidden, weight, labels, chunk_size=chunk, backend="chunked")
    assert counter.largest == chunk * V
    with LargestAllocation() as counter:
        loss_and_grads(hidden, weight, labels, backend="reference")
    assert counter.largest == N * V


def test_without_grad_no_gradients_are_computed():
    hidden, weight, labels = problem(12, 8, 30, torch.float32)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=5, backend="triton")
    assert rel_err(loss, F.cross_entropy(hidden @ weight.T, labels)) < 1e-6


def test_bad_inputs_raise():
    hidden, weight, labels = problem(4, 8, 10, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(hidden, weight[:, :4], labels)
    with pytest.raises(TypeError, match="weight"):
        linear_cross_entropy(hidden, weight.double(), labels)
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(hidden, weight, labels[:3])
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, labels, reduction="none")
    with pytest.raises(ValueError, match="backend"):
        linear_cross_entropy(hidden, weight, labels, backend="fla")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_real_shapes(dtype):
    """16K tokens, width 1024, vocab 32000 (one chunk of 2048 rows), against the fp32 logits."""
    hidden, weight, labels = problem(16384, 1024, 32000, dtype)
    ref = loss_and_grads(hidden.float(), weight.float(), labels, backend="reference")
    got = loss_and_grads(hidden, weight, labels)
    errors = [rel_err(g, r) for g, r in zip(got, ref)]
    assert max(errors) < TOL[dtype], errors
