"""The fused rotary embedding against its reference: q's and k's outputs and gradients by the error ratio (fp32
< 1e-5; bf16 < 5e-3 against the fp64 reference on the same bf16 inputs and cotangents), grouped heads, views of
a projection, left-padded positions, decoding, the custom ops under ``torch.compile``, named errors. Without
CUDA the kernel runs through the Triton interpreter.
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

from tests.helpers import rel_err, triton_kernels_device

DEVICE = triton_kernels_device()

from linmem.ops.fused import reference, rotary  # noqa: E402

rotary_ops = importlib.import_module("linmem.ops.fused.rotary")  # the module (its function shadows the name)
TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-3}
BF16, FP32 = torch.bfloat16, torch.float32


@pytest.fixture(autouse=True)
def no_fallback(caplog):
    """A test of the kernel fails if it quietly handed its inputs to the reference."""
    caplog.set_level(logging.DEBUG, logger="linmem.ops")
    yield
    assert not [r for r in caplog.records if "cannot serve" in r.getMessage()]


def rnd(*shape, dtype=FP32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def left_padded(B: int, T: int, pads: list[int]) -> torch.Tensor:
    """[B, T] positions of rows left-padded by pads tokens: 0 over the padding, then 0, 1, 2, ..."""
    steps = torch.arange(T)
    return torch.stack([(steps - p).clamp_min(0) for p in pads]).to(DEVICE)


def compare(q, k, position_ids, dtype, theta=10000.0) -> dict:
    """rotary with the kernel against the fp64 reference: outputs and the gradients of sum(out * cotangent)."""
    def run(backend, q, k, cast):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k) if x is not None]
        outs = rotary(leaves[0], leaves[1] if k is not None else None, position_ids, theta=theta, backend=backend)
        outs = [o for o in outs if o is not None]
        loss = sum((o * rnd(*o.shape, seed=100 + i, dtype=dtype).to(cast)).sum() for i, o in enumerate(outs))
        return outs, torch.autograd.grad(loss, leaves)

    outs, grads = run("triton", q, k, dtype)
    ref_outs, ref_grads = run("reference", q.double(), None if k is None else k.double(), torch.float64)
    assert all(o.dtype == dtype and o.shape == x.shape for o, x in zip(outs, (q, k)))
    errors = {name: rel_err(a.detach(), b.detach()) for name, a, b in zip(("q", "k", "dq", "dk"), [*outs, *grads],
                                                         [*ref_outs, *ref_grads])}
    assert all(e < TOL[dtype] for e in errors.values()), errors
    return errors


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
def test_grouped_heads_views_of_a_projection_left_padded(dtype):
    """q [B, T, 4, D] and k [B, T, 2, D] are head splits of one fused qkv projection (read in place); rows
    left-padded by different counts."""
    B, T, H, Hkv, D = 2, 6, 4, 2, 16
    qkv = rnd(B, T, (H + 2 * Hkv) * D, dtype=dtype)
    q = qkv[..., :H * D].unflatten(-1, (H, D))
    k = qkv[..., H * D:(H + Hkv) * D].unflatten(-1, (Hkv, D))
    assert not q.is_contiguous() and not k.is_contiguous()
    compare(q, k, left_padded(B, T, [0, 3]), dtype)


def test_decode_step_q_only_and_narrow_positions():
    """T = 1 at each row's own position (int32), and q alone (k None), with a head dim not a power of 2."""
    B, H, D = 3, 2, 24
    positions = torch.tensor([[7], [0], [40]], dtype=torch.int32, device=DEVICE)
    compare(rnd(B, 1, H, D), rnd(B, 1, 1, D, seed=1), positions, FP32)
    compare(rnd(B, 4, H, D), None, torch.arange(4, dtype=torch.int16, device=DEVICE).expand(B, 4), FP32,
            theta=500000.0)


def test_far_positions_keep_their_accuracy():
    """At positions near 10^6 the angles reach 10^6 radians: the kernel forms them in fp64 and reduces them
    before cos / sin, so it stays within fp32's tolerance of the exact rotation, where fp32 angles (the
    reference's) are off by about p 2^-24 radians."""
    B, T, H, D = 1, 8, 1, 16
    pos = (1_000_000 + torch.arange(T) * 997).to(DEVICE)[None]
    q = rnd(B, T, H, D)
    exact = reference.rotary(q.double(), None, pos)[0]
    assert rel_err(rotary(q, None, pos, backend="triton")[0], exact) < TOL[FP32]
    assert rel_err(reference.rotary(q, None, pos)[0], exact) > 1e-3


def test_reference_is_the_rotate_half_maths():
    """The reference gives bit for bit what the layers computed before the fused op: fp32 frequencies, angles,
    cos / sin of [angles, angles], x cos + rotate_half(x) sin in fp32."""
    x, pos, D, theta = rnd(2, 5, 3, 8, dtype=BF16), left_padded(2, 5, [1, 0]), 8, 500000.0
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32, device=DEVICE) / D))
    angles = pos.float()[..., None] * inv_freq
    cos, sin = (torch.cat([f, f], -1)[:, :, None, :] for f in (angles.cos(), angles.sin()))
    x1, x2 = x.float().chunk(2, dim=-1)
    expected = (x.float() * cos + torch.cat([-x2, x1], dim=-1) * sin).to(BF16)
    q, k = reference.rotary(x, x[:, :, :1], pos, theta)
    assert torch.equal(q, expected) and torch.equal(k, expected[:, :, :1])


def test_custom_op_in_one_compiled_graph():
    """Under torch.compile(fullgraph=True) the op traces as linmem::rotary and gives the eager outputs and
    gradients; the fake implementations give the kernels' shapes."""
    q, k, pos = rnd(1, 3, 2, 8), rnd(1, 3, 1, 8, seed=1), torch.arange(3, device=DEVICE)[None]
    seen = set()

    def recording_backend(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if str(n.target).startswith("linmem."))
        return torch._dynamo.lookup_backend("aot_eager" if DEVICE == "cpu" else "inductor")(gm, example_inputs)

    def loss(q, k):
        q_rot, k_rot = rotary(q, k, pos, backend="triton")
        return (q_rot.sum(2) * k_rot[:, :, 0].square()).sum()

    results = []
    for fn in (torch.compile(loss, fullgraph=True, backend=recording_backend), loss):
        leaves = [q.clone().requires_grad_(True), k.clone().requires_grad_(True)]
        value = fn(*leaves)
        results.append((value, *torch.autograd.grad(value, leaves)))
    assert seen == {"linmem.rotary.default"}
    for compiled, eager in zip(*results):
        assert torch.allclose(compiled, eager, rtol=1e-5, atol=1e-6)
    for args in ((q, None, pos, 10000.0, False), (q, k, pos, 10000.0, True)):
        torch.library.opcheck(rotary_ops.rotary_op, args, test_utils=("test_faketensor",))


def test_bad_inputs_raise():
    q, k, pos = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8), torch.arange(5).expand(2, 5)
    with pytest.raises(ValueError, match="even D"):
        rotary(torch.randn(2, 5, 4, 7), None, pos)
    with pytest.raises(ValueError, match="`q`"):
        rotary(q[0], None, pos)
    with pytest.raises(TypeError, match="`q`"):
        rotary(q.long(), None, pos)
    with pytest.raises(ValueError, match="`k`"):
        rotary(q, k[:, :4], pos)
    with pytest.raises(TypeError, match="`k`"):
        rotary(q, k.double(), pos)
    with pytest.raises(TypeError, match="position_ids"):
        rotary(q, k, pos.float())
    with pytest.raises(ValueError, match="position_ids"):
        rotary(q, k, pos[:1])
    with pytest.raises(ValueError, match="theta"):
        rotary(q, k, pos, theta=0.0)
    with pytest.raises(ValueError, match="backend"):
        rotary(q, k, pos, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
def test_gpu_real_shapes(dtype):
    """16K tokens of a ~370M model's 16 heads of 64 (q and k head splits of one projection, left-padded rows),
    and a batch of 8 decoding steps at positions near 2K."""
    B, T, H, D = 8, 2048, 16, 64
    qkv = rnd(B, T, 3 * H * D, dtype=dtype)
    q, k = (qkv[..., i * H * D:(i + 1) * H * D].unflatten(-1, (H, D)) for i in range(2))
    compare(q, k, left_padded(B, T, list(range(0, 8 * 100, 100))), dtype)
    compare(rnd(B, 1, H, D, dtype=dtype), rnd(B, 1, 4, D, dtype=dtype, seed=1),
            torch.randint(1900, 2048, (B, 1), device=DEVICE), dtype)
