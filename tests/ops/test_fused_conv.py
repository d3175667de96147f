"""The fused short convolution (``linmem.ops.fused.short_conv`` / ``short_conv_step``) against its reference.

Outputs, final states and every gradient (x, weight, bias, initial state) by the error ratio
``rms(x - ref) / rms(ref)``: fp32 < 1e-4, bf16 < 5e-3 against the fp64 reference on the same bf16 inputs and
cotangents. Without CUDA the kernels run through the Triton interpreter at small shapes.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers import rel_err, triton_kernels_device

DEVICE = triton_kernels_device()

from linmem.ops.fused import short_conv, short_conv_step  # noqa: E402


@pytest.fixture(autouse=True)
def no_fallback(caplog):
    """A test of the kernels fails if they quietly handed its inputs to the reference."""
    caplog.set_level(logging.DEBUG, logger="linmem.ops")
    yield
    assert not [r for r in caplog.records if "cannot serve" in r.getMessage()]

TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-3}


def conv_inputs(B, T, C, W, N, dtype, *, bias=True, history=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    t = {"x": rnd(B, T, C).to(dtype), "weight": rnd(C, W) / W ** 0.5}
    if bias:
        t["bias"] = rnd(C)
    if history:
        t["initial_state"] = rnd(N, W - 1, C).to(dtype)
    cot = (rnd(B, T, C).to(dtype), rnd(N, W - 1, C).to(dtype))
    return {n: x.to(DEVICE) for n, x in t.items()}, tuple(c.to(DEVICE) for c in cot)


def run(backend, tensors, cotangents, **kwargs):
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in tensors.items()}
    y, final = short_conv(**leaves, output_final_state=True, backend=backend, **kwargs)
    dy, dfinal = (c.to(y.dtype) for c in cotangents)
    loss = (y * dy).sum() + (final * dfinal).sum()
    return (y, final), dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def compare(tensors, cotangents, **kwargs):
    dtype = tensors["x"].dtype
    outs, grads = run("triton", tensors, cotangents, **kwargs)
    ref_outs, ref_grads = run("reference", {n: x.double() for n, x in tensors.items()},
                              tuple(c.double() for c in cotangents), **kwargs)
    assert outs[0].dtype == dtype and outs[1].dtype == dtype
    errors = {"y": rel_err(outs[0], ref_outs[0]), "final_state": rel_err(outs[1], ref_outs[1])}
    errors.update({f"d{n}": rel_err(grads[n], ref_grads[n]) for n in tensors})
    assert all(e < TOL[dtype] for e in errors.values()), errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fixed_length(dtype):
    """A history, silu and a bias; T spans two token blocks."""
    tensors, cot = conv_inputs(1, 40 if DEVICE == "cpu" else 300, 24, 4, 1, dtype)
    compare(tensors, cot, activation="silu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen(dtype):
    """Packed sequences, one empty and one shorter than W - 1: no window crosses a boundary, the short one passes
    part of its history on to its final state."""
    lengths = [5, 0, 2, 14]
    cu = torch.tensor([0, 5, 5, 7, 21], dtype=torch.int32, device=DEVICE)
    tensors, cot = conv_inputs(1, sum(lengths), 12, 4, len(lengths), dtype)
    compare(tensors, cot, activation="silu", cu_seqlens=cu)


@pytest.mark.parametrize("case", ["batch", "varlen"])
def test_weight_gradient_over_several_programs(case, monkeypatch):
    """The dx/dw pass split into programs of 16 tokens, of two token tiles each (the last program partial,
    sequences straddling programs): dw and db are the sums of the programs' partial sums."""
    from linmem.ops.fused.triton import conv as kernels

    monkeypatch.setattr(kernels, "TOKENS_PER_PROGRAM", 16)
    if case == "batch":
        tensors, cot = conv_inputs(2, 40, 12, 4, 2, torch.float32)
        compare(tensors, cot, activation="silu")
    else:
        cu = torch.tensor([0, 3, 19, 21, 37], dtype=torch.int32, device=DEVICE)
        tensors, cot = conv_inputs(1, 37, 12, 4, 4, torch.float32)
        compare(tensors, cot, activation="silu", cu_seqlens=cu)


def test_weights_in_the_input_dtype():
    """bf16 weight and bias, as FSDP2 gathers them (the other tests keep fp32 weights, as autocast does)."""
    tensors, cot = conv_inputs(2, 40, 12, 4, 2, torch.bfloat16)
    tensors = {n: (x.to(torch.bfloat16) if n in ("weight", "bias") else x) for n, x in tensors.items()}
    compare(tensors, cot, activation="silu")


def test_no_activation_no_bias_no_history():
    tensors, cot = conv_inputs(2, 9, 8, 3, 2, torch.float32, bias=False, history=False)
    compare(tensors, cot)


def test_two_pieces_equal_one_pass():
    """The final state of the first piece, as the second's initial state, gives the one-pass output and state."""
    x = torch.randn(2, 13, 8, device=DEVICE)
    w, b = torch.randn(8, 4, device=DEVICE), torch.randn(8, device=DEVICE)
    y, final = short_conv(x, w, b, activation="silu", output_final_state=True, backend="triton")
    y1, s1 = short_conv(x[:, :6], w, b, activation="silu", output_final_state=True, backend="triton")
    y2, s2 = short_conv(x[:, 6:], w, b, activation="silu", initial_state=s1, output_final_state=True,
                        backend="triton")
    assert rel_err(torch.cat([y1, y2], 1), y) < 1e-6 and torch.equal(s2, final)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decoding_steps_equal_the_full_pass(dtype):
    """Prefill 3 tokens, then one step at a time against the cache, updated in place: the outputs and the cache
    equal the full pass (the steps' inputs arrive as a strided slice)."""
    B, T, C, W = 2, 7, 16, 4
    x = torch.randn(B, T, C, device=DEVICE).to(dtype)
    w, b = torch.randn(C, W, device=DEVICE), torch.randn(C, device=DEVICE)
    y, final = short_conv(x, w, b, activation="silu", output_final_state=True, backend="reference")
    y_pre, cache = short_conv(x[:, :3], w, b, activation="silu", output_final_state=True, backend="triton")
    storage = cache.data_ptr()
    steps = [short_conv_step(x[:, t], cache, w, b, "silu", backend="triton") for t in range(3, T)]
    assert cache.data_ptr() == storage
    assert rel_err(torch.cat([y_pre, torch.stack(steps, 1)], 1), y) < TOL[dtype]
    assert torch.equal(cache, final)


def test_bad_inputs_raise():
    x, w = torch.randn(2, 5, 8), torch.randn(8, 4)
    with pytest.raises(ValueError, match="weight"):
        short_conv(x, torch.randn(6, 4))
    with pytest.raises(ValueError, match="bias"):
        short_conv(x, w, torch.randn(4))
    with pytest.raises(ValueError, match="activation"):
        short_conv(x, w, activation="relu")
    with pytest.raises(ValueError, match="initial_state"):
        short_conv(x, w, initial_state=torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="B == 1"):
        short_conv(x, w, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(TypeError, match="cu_seqlens"):
        short_conv(x[:1], w, cu_seqlens=torch.tensor([0.0, 5.0]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        short_conv(x[:1], w, cu_seqlens=torch.tensor([0, 3, 2, 5]))
    with pytest.raises(ValueError, match="state"):
        short_conv_step(x[:, 0], torch.zeros(2, 4, 8), w)
    with pytest.raises(ValueError, match="backend"):
        short_conv(x, w, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_real_shapes(dtype):
    """8 x 2048 tokens, 2048 channels, and a varlen batch of the same tokens."""
    tensors, cot = conv_inputs(8, 2048, 2048, 4, 8, dtype)
    compare(tensors, cot, activation="silu")
    cu = torch.tensor([0, 1, 700, 703, 4096, 16384], device=DEVICE)
    tensors, cot = conv_inputs(1, 16384, 512, 4, 5, dtype)
    compare(tensors, cot, activation="silu", cu_seqlens=cu)
