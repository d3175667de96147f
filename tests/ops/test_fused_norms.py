"""The fused row ops (``rms_norm`` with the residual add, ``gated_rms_norm``, ``l2_norm``, ``swiglu``) against
their references: outputs and every gradient by the error ratio (fp32 < 1e-4; bf16 < 5e-3 against the fp64
reference on the same bf16 inputs and cotangents). Without CUDA the kernels run through the Triton interpreter.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import rel_err, triton_kernels_device

DEVICE = triton_kernels_device()

from linmem.ops.fused import gated_rms_norm, l2_norm, rms_norm, swiglu, swiglu_grads  # noqa: E402


@pytest.fixture(autouse=True)
def no_fallback(caplog):
    """A test of the kernels fails if they quietly handed its inputs to the reference."""
    caplog.set_level(logging.DEBUG, logger="linmem.ops")
    yield
    assert not [r for r in caplog.records if "cannot serve" in r.getMessage()]

TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-3}
BF16 = torch.bfloat16
FP32 = torch.float32


def rnd(*shape, dtype=FP32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def compare(op, tensors: dict, dtype: torch.dtype, **kwargs) -> dict:
    """op(**tensors) (one output or a tuple) with backend "triton" against "reference" in fp64: outputs and the
    gradients of sum(out * cotangent) for every tensor."""
    def run(backend, inputs, cast):
        leaves = {n: x.detach().clone().requires_grad_(True) for n, x in inputs.items()}
        outs = op(**leaves, backend=backend, **kwargs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        loss = sum((o * rnd(*o.shape, seed=100 + i, dtype=dtype).to(cast)).sum() for i, o in enumerate(outs))
        return outs, torch.autograd.grad(loss, list(leaves.values()))

    outs, grads = run("triton", tensors, dtype)
    ref_outs, ref_grads = run("reference", {n: x.double() for n, x in tensors.items()}, torch.float64)
    assert all(o.dtype == next(iter(tensors.values())).dtype for o in outs)
    errors = {f"out{i}": rel_err(o, r) for i, (o, r) in enumerate(zip(outs, ref_outs))}
    errors.update({f"d{n}": rel_err(g, r) for n, g, r in zip(tensors, grads, ref_grads)})
    assert all(e < TOL[dtype] for e in errors.values()), errors
    return errors


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
def test_rms_norm_with_residual(dtype):
    """y and the returned stream h = x + residual; gradients reach x, residual and weight through both."""
    compare(rms_norm, {"x": rnd(2, 5, 48, dtype=dtype), "weight": rnd(48, seed=1) + 1,
                       "residual": rnd(2, 5, 48, dtype=dtype, seed=2)}, dtype, residual_out=True)


def test_rms_norm_bf16_input_on_an_fp32_stream():
    """Autocast's pre-norm step: a bf16 block output added to an fp32 stream; h stays fp32, y comes in bf16 (one
    rounding of the fp32 result), gradients reach x and the residual in their own dtypes."""
    x, residual, weight = rnd(2, 5, 48, dtype=BF16), rnd(2, 5, 48, seed=2), rnd(48, seed=1) + 1
    outs = {}
    for backend in ("triton", "reference"):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, residual, weight)]
        y, h = rms_norm(leaves[0], leaves[2], residual=leaves[1], residual_out=True, out_dtype=BF16,
                        backend=backend)
        assert (y.dtype, h.dtype) == (BF16, FP32)
        grads = torch.autograd.grad((y.float() * rnd(2, 5, 48, seed=3)).sum() + (h * rnd(2, 5, 48, seed=4)).sum(),
                                    leaves)
        assert [g.dtype for g in grads] == [BF16, FP32, FP32]
        outs[backend] = (y, h, *grads)
    errors = [rel_err(a.float(), b.float()) for a, b in zip(outs["triton"], outs["reference"])]
    assert errors[1] < 1e-6 and max(errors) < 5e-3, errors


def test_rms_norm_per_head_weight():
    """x [B, T, H, D] with a weight per head [H, D] (the attention's q/k/o norms)."""
    compare(rms_norm, {"x": rnd(2, 5, 3, 16, dtype=BF16), "weight": rnd(3, 16, seed=1) + 1}, BF16)


@pytest.mark.parametrize("dtype,activation", [(FP32, "silu"), (BF16, "sigmoid")], ids=str)
def test_gated_rms_norm(dtype, activation):
    """Per head over [B, T, H, V]; the gate is a head split of a wider projection (read in place)."""
    wide = rnd(2, 5, 2 * 3 * 16, dtype=dtype, seed=3)
    compare(lambda x, wide, weight, backend: gated_rms_norm(x, wide[..., 48:].unflatten(-1, (3, 16)), weight,
                                                            activation=activation, backend=backend),
            {"x": rnd(2, 5, 3, 16, dtype=dtype), "wide": wide, "weight": rnd(16, seed=1) + 1}, dtype)


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
def test_l2_norm_head_split_of_a_slice(dtype):
    """q, the first third of a fused qkv projection [B, T, 3 H K], split into heads on the fly."""
    compare(lambda qkv, backend: l2_norm(qkv[..., :48], head_dim=16, backend=backend),
            {"qkv": rnd(2, 5, 144, dtype=dtype)}, dtype)


def test_l2_norm_equals_f_normalize():
    x = rnd(3, 7, 2, 32)
    assert rel_err(l2_norm(x, backend="triton"), F.normalize(x, dim=-1)) < 1e-6


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
def test_swiglu_halves_of_a_fused_projection(dtype):
    compare(lambda gate_up, backend: swiglu(*gate_up.chunk(2, dim=-1), backend=backend),
            {"gate_up": rnd(3, 5, 2 * 40, dtype=dtype)}, dtype)



@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
def test_swiglu_grads_equal_the_autograd_of_swiglu(dtype, backend):
    """``swiglu_grads`` (no autograd graph) gives swiglu's gradients: the kernels' bit for bit, the reference's
    analytic form to rounding."""
    gate, up = rnd(3, 5, 2 * 40, dtype=dtype).chunk(2, dim=-1)
    dy = rnd(3, 5, 40, dtype=dtype, seed=3)
    leaves = gate.detach().requires_grad_(True), up.detach().requires_grad_(True)
    want = torch.autograd.grad(swiglu(*leaves, backend=backend), leaves, dy)
    got = swiglu_grads(gate, up, dy, backend=backend)
    assert [g.dtype for g in got] == [dtype, dtype] and all(g.is_contiguous() for g in got)
    if backend == "triton":
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    else:
        assert max(rel_err(g, w) for g, w in zip(got, want)) < (1e-6 if dtype == FP32 else 5e-3)
    with pytest.raises(ValueError, match="dy"):
        swiglu_grads(gate, up, dy[:, :4], backend=backend)

def test_extreme_inputs_stay_finite():
    big = rnd(2, 64) * 1e4
    for out in (rms_norm(big, torch.ones(64, device=DEVICE), backend="triton"),
                gated_rms_norm(big, big, torch.ones(64, device=DEVICE), backend="triton"),
                l2_norm(big * 0, backend="triton"), swiglu(big, big, backend="triton")):
        assert torch.isfinite(out).all()


def test_bad_inputs_raise():
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(6))
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(8), residual=torch.randn(2, 8))
    with pytest.raises(TypeError, match="out_dtype"):
        rms_norm(x, torch.ones(8), out_dtype=torch.int32)
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm(x, torch.randn(2, 5, 4), torch.ones(8))
    with pytest.raises(ValueError, match="activation"):
        gated_rms_norm(x, x, torch.ones(8), activation="relu")
    with pytest.raises(ValueError, match="head_dim"):
        l2_norm(x, head_dim=3)
    with pytest.raises(ValueError, match="up"):
        swiglu(x, x[..., :4])
    with pytest.raises(TypeError, match="gate"):
        swiglu(x.long(), x)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
def test_gpu_real_shapes(dtype):
    """16K tokens: the model's norms (D = 1024), the heads' norms (H = 16, K = 128), the MLP's SwiGLU."""
    compare(rms_norm, {"x": rnd(8, 2048, 1024, dtype=dtype), "weight": rnd(1024) + 1,
                       "residual": rnd(8, 2048, 1024, dtype=dtype, seed=2)}, dtype, residual_out=True)
    compare(gated_rms_norm, {"x": rnd(8, 2048, 16, 128, dtype=dtype), "gate": rnd(8, 2048, 16, 128, dtype=dtype),
                             "weight": rnd(128) + 1}, dtype)
    compare(lambda qkv, backend: l2_norm(qkv[..., :2048], head_dim=128, backend=backend),
            {"qkv": rnd(8, 2048, 3 * 2048, dtype=dtype)}, dtype)
    compare(lambda gate_up, backend: swiglu(*gate_up.chunk(2, dim=-1), backend=backend),
            {"gate_up": rnd(8, 2048, 2 * 2816, dtype=dtype)}, dtype)
