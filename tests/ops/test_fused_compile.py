"""The fused ops under ``torch.compile(fullgraph=True)``: every op traces as its ``linmem::`` custom op (no
graph break), gives the eager outputs and gradients, and every custom op's fake implementation gives the shapes
and dtypes of its kernels.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers import triton_kernels_device

DEVICE = triton_kernels_device()

from linmem.ops.fused import (  # noqa: E402
    conv,
    cross_entropy,
    gated_rms_norm,
    glu,
    l2_norm,
    linear_cross_entropy,
    norm,
    rms_norm,
    short_conv,
    short_conv_step,
    swiglu,
)


@pytest.fixture(autouse=True)
def no_fallback(caplog):
    """A test of the kernels fails if they quietly handed its inputs to the reference."""
    caplog.set_level(logging.DEBUG, logger="linmem.ops")
    yield
    assert not [r for r in caplog.records if "cannot serve" in r.getMessage()]

B, T, H, K, V = 1, 12, 2, 8, 20
C = H * K


def block(x, conv_w, conv_b, gate, norm_w, stream_w, head, labels, state):
    """A mixer's glue and a loss: conv -> head-split L2 norm -> gated norm -> residual norm -> SwiGLU -> loss,
    and a decoding step against the conv's final state."""
    y, final = short_conv(x, conv_w, conv_b, activation="silu", output_final_state=True, backend="triton")
    q = l2_norm(y, head_dim=K, backend="triton")
    o = gated_rms_norm(q, gate, norm_w, backend="triton")
    normed, stream = rms_norm(o.flatten(-2), stream_w, residual=x, residual_out=True, backend="triton")
    mlp = swiglu(normed, stream, backend="triton")
    loss = linear_cross_entropy(mlp.flatten(0, 1), head, labels, chunk_size=5, backend="triton")
    step = short_conv_step(x[:, -1].detach(), state, conv_w.detach(), conv_b.detach(), "silu", backend="triton")
    return loss + final.float().square().sum(), step


def test_one_graph_equals_eager():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(*s, generator=gen).to(DEVICE) for s in
               [(B, T, C), (C, 4), (C,), (B, T, H, K), (K,), (C,), (V, C)]]
    labels = torch.randint(0, V, (B * T,), generator=gen).to(DEVICE)
    history = torch.randn(B, 3, C, generator=gen).to(DEVICE)
    ops_seen = set()

    def recording_backend(gm, example_inputs):
        ops_seen.update(str(n.target) for n in gm.graph.nodes if str(n.target).startswith("linmem."))
        return torch._dynamo.lookup_backend("aot_eager" if DEVICE == "cpu" else "inductor")(gm, example_inputs)

    results = []
    for fn in (torch.compile(block, fullgraph=True, backend=recording_backend), block):
        leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
        state = history.clone()
        loss, step = fn(*leaves, labels, state)
        results.append((loss, step, state, *torch.autograd.grad(loss, leaves)))
    for compiled, eager in zip(*results):
        assert torch.allclose(compiled, eager, rtol=1e-5, atol=1e-6)
    assert ops_seen == {f"linmem.{op}.default" for op in (
        "short_conv_fwd", "l2_norm_fwd", "rms_norm_fwd", "swiglu_fwd", "linear_cross_entropy", "short_conv_step")}


def fake_checks():
    """(custom op, arguments) for every custom op of the fused ops, at tiny shapes."""
    gen = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    bf = lambda *s: r(*s).to(torch.bfloat16)  # noqa: E731
    x, w, h0, cu = bf(1, 9, C), r(C, 4), bf(2, 3, C), torch.tensor([0, 4, 9], device=DEVICE)
    rows = bf(6, H, K)
    return [
        (conv.short_conv_fwd_op, (x, w, r(C), h0, cu, 1, True)),
        (conv.short_conv_bwd_op, (x, w, r(C), h0, cu, bf(1, 9, C), bf(2, 3, C), 1)),
        (conv.short_conv_step_op, (bf(2, C), bf(2, 3, C), w, None, 1)),
        (norm.rms_norm_fwd_op, (rows, r(H, K), r(6, H, K), None, 1e-6, 0, torch.bfloat16)),  # an fp32 stream
        (norm.rms_norm_bwd_op, (rows, bf(6, H, K), r(K), bf(6, H, K), None, 1e-6, 1)),
        (norm.l2_norm_fwd_op, (rows, 1e-6)),
        (norm.l2_norm_bwd_op, (rows, r(6, H), bf(6, H, K))),
        (glu.swiglu_fwd_op, (bf(5, 7), bf(5, 7))),
        (glu.swiglu_bwd_op, (bf(5, 7), bf(5, 7), bf(5, 7))),
        (cross_entropy.linear_cross_entropy_op, (bf(5, C), bf(V, C), torch.arange(5, device=DEVICE), -100, 3,
                                                 False, True, True)),
    ]


@pytest.mark.parametrize("check", range(10))
def test_fake_outputs_match_the_kernels(check):
    op, args = fake_checks()[check]
    torch.library.opcheck(op, args, test_utils=("test_faketensor",))
