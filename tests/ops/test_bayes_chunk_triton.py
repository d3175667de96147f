"""The chunked Triton kernels of the Bayesian filter (backend "chunk_triton") and their hand-written gradient.

* The PyTorch VJP of :mod:`linmem.ops.bayes.chunk_grad` against autograd through chunk.py, fp64, to 1e-10.
* The kernels against the token-loop reference: outputs, variance, final state and every input gradient (q, k, v,
  log_decay, obs_noise, process_noise, the initial mean and covariance) by the error ratio ``rms(x - ref) /
  rms(ref)``: fp32 inputs against the fp64 reference (< 1e-4) and against "chunk" in fp32, bf16 and fp16 inputs
  against the fp32 reference on the same rounded inputs (< 5e-3); chunks of 16 and 32 tokens so that every
  sequence crosses chunk boundaries, a partial last chunk, packed sequences with an empty one.
* Refusals by name, the custom ops' fake implementations, and on a GPU real shapes and "auto"'s choice.

On a machine without CUDA the kernels run through the Triton interpreter at small shapes.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from tests.helpers import rel_err, triton_kernels_device

DEVICE = triton_kernels_device()

from linmem.ops import bayes  # noqa: E402
from linmem.ops.bayes import set_auto_cuda_backends  # noqa: E402
from linmem.ops.bayes.chunk import chunk_step  # noqa: E402
from linmem.ops.bayes.chunk_fwd import ChunkLaunch  # noqa: E402
from linmem.ops.bayes.chunk_grad import chunk_backward  # noqa: E402
from linmem.ops.bayes.chunk_triton import chunk_triton_filter  # noqa: E402
from linmem.ops.bayes.inputs import validate  # noqa: E402
from tests.ops.test_bayes_triton import FP32_TOL, LOW_TOL, compare, make, public, run  # noqa: E402

F64 = torch.float64


def kernels(chunk, cu_seqlens=None, variance=True, prior=0.7, scale=None):
    """bayes_filter's inputs through the chunked kernels at a chunk size, checking that bayes_filter would pick
    them for backend="chunk_triton"."""
    def fn(leaves, state):
        inputs = validate(**{"process_noise": None, **leaves}, prior=prior, reset=False, scale=scale,
                          initial_state=state, output_final_state=True, cu_seqlens=cu_seqlens,
                          return_variance=variance)
        assert bayes._chunk_triton_refusal(inputs) is None
        o, var, (M, P) = chunk_triton_filter(inputs, ChunkLaunch(chunk, 4))
        return o, var, M, P
    return fn


@pytest.mark.parametrize("process_noise,variance", [(True, True), (False, False)])
def test_the_hand_written_gradient_equals_autograd_through_chunk_py(process_noise, variance):
    """chunk_grad.chunk_backward over four chunks (the last one short) against autograd of chunk_step, fp64."""
    t, state = make(2, 27, 2, 5, 4, seed=5, process_noise=process_noise)
    names = ("q", "k", "v", "log_decay", "obs_noise", "process_noise")
    xs = [t.get(n) for n in names]
    leaves = [None if x is None else x.clone().requires_grad_(True) for x in xs]
    M0, P0 = (x.clone().requires_grad_(True) for x in state)
    C, scale = 8, 0.3
    m, P = M0, 0.5 * (P0 + P0.transpose(-1, -2))
    heads = [None if x is None else x.transpose(1, 2) for x in leaves]
    starts, outputs, variances = [], [], []
    for s in range(0, 27, C):
        starts.append((m.detach(), P.detach()))
        o, var, m, P = chunk_step(m, P, *(None if x is None else x[:, :, s:s + C] for x in heads), scale, variance)
        outputs.append(o)
        variances.append(var)
    o = torch.cat(outputs, 2).transpose(1, 2)
    var = torch.cat(variances, 2).transpose(1, 2) if variance else None
    gen = torch.Generator().manual_seed(1)
    cot = [torch.randn(x.shape, generator=gen, dtype=F64) for x in (o, m, P)]
    dvar = torch.randn(2, 27, 2, generator=gen, dtype=F64) if variance else None
    loss = (o * cot[0]).sum() + (m * cot[1]).sum() + (P * cot[2]).sum() + ((var * dvar).sum() if variance else 0)
    present = [x for x in leaves if x is not None] + [M0, P0]
    expected = torch.autograd.grad(loss, present)
    got = chunk_backward(starts, xs, scale, C, cot[0], dvar, cot[1], cot[2])
    got = [x for x in got if x is not None]
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert rel_err(a, b) < 1e-10


@pytest.mark.parametrize("B,T,K,V,chunk,variance", [(2, 40, 16, 16, 16, True), (1, 130, 32, 16, 32, False)])
def test_fp32_every_gradient_against_the_reference_and_chunk(B, T, K, V, chunk, variance):
    """An initial state (non-symmetric P0) and process noise; T crosses chunk boundaries with a short last chunk
    (130 tokens: five chunks of 32, two groups of saved states)."""
    t, state = make(B, T, 2, K, V, seed=0)
    ref = run(public("reference", prior=0.7, variance=variance), t, state, F64, F64)
    got = run(kernels(chunk, variance=variance), t, state, torch.float32, torch.float32)
    compare(got, ref, FP32_TOL)
    compare(got, run(public("chunk", prior=0.7, variance=variance), t, state, torch.float32, torch.float32), FP32_TOL)


def test_fp32_varlen_with_an_empty_sequence_from_the_prior():
    """Three packed sequences (the middle one empty, keeping its prior; the last one of five chunks, two groups of
    saved states), no initial state, no process noise, a read-out scale of 0.3."""
    t, _ = make(1, 90, 2, 16, 16, seed=1, process_noise=False, initial_state=False)
    cu = torch.tensor([0, 20, 20, 90], device=DEVICE)
    ref = run(public("reference", prior=0.7, cu_seqlens=cu, scale=0.3), t, None, F64, F64)
    got = run(kernels(16, cu_seqlens=cu, scale=0.3), t, None, torch.float32, torch.float32)
    compare(got, ref, FP32_TOL)
    assert torch.equal(got["P"][1, 0].cpu(), 0.7 * torch.eye(16)), "the empty sequence keeps its prior"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_varlen_with_an_initial_state(dtype):
    """bf16 / fp16 q, k, v against the fp32 reference on the same rounded values; packed sequences (one empty,
    keeping its initial state) each from its own initial belief, with process noise."""
    t, state = make(1, 40, 1, 16, 32, seed=2, N=3)
    t = {n: (x.to(dtype).double() if n in "qkv" else x) for n, x in t.items()}
    cu = torch.tensor([0, 17, 40, 40], device=DEVICE)
    ref = run(public("reference", prior=0.7, cu_seqlens=cu), t, state, torch.float32, torch.float32)
    got = run(kernels(16, cu_seqlens=cu), t, state, dtype, torch.float32)
    compare(got, ref, LOW_TOL)
    P0 = state[1][2].float()
    assert rel_err(got["P"][2].cpu(), 0.5 * (P0 + P0.transpose(-1, -2))) < 1e-7


def _inputs(K=16, dtype=torch.float32, reset=False):
    t, _ = make(1, 8, 1, K, 16, seed=3, initial_state=False)
    t = {n: x.to(dtype).to(DEVICE) for n, x in t.items()}
    return validate(**t, prior=1.0, reset=reset, scale=None, initial_state=None,
                    output_final_state=False, cu_seqlens=None, return_variance=False)


@pytest.mark.parametrize("case,reason", [
    (dict(reset=True), "reset=True is the delta rule"),
    (dict(K=160), "head dims K = 160, V = 16"),
    (dict(K=96), "float32 inputs at head dims K = 96, V = 16"),
    (dict(dtype=F64), "dtype torch.float64"),
])
def test_refusals_are_named_and_fall_back(case, reason, caplog):
    inputs = _inputs(**case)
    assert reason in bayes._chunk_triton_refusal(inputs)
    with caplog.at_level(logging.DEBUG, logger="linmem.ops"):
        bayes._choose("chunk_triton", inputs)
    assert f"backend 'chunk_triton' cannot serve these inputs ({reason}" in caplog.text


def test_beyond_the_chunked_conditioning_the_token_loop_serves():
    """The chunked form's bound (conditioning.chunk_refusal): C kappa eps beyond TOLERANCE."""
    inputs = replace(_inputs(), condition=0.02 / (8 * 2.0 ** -24))
    assert "times the chunk length 8" in bayes._chunk_triton_refusal(inputs)
    assert bayes._choose("chunk_triton", inputs) is bayes.reference_filter
    assert bayes._chunk_triton_refusal(replace(inputs, condition=0.005 / (8 * 2.0 ** -24))) is None


def test_auto_order_on_cuda_is_switchable():
    with pytest.raises(ValueError, match="unknown `backend` 'delta'"):
        set_auto_cuda_backends("delta")
    with pytest.raises(ValueError, match="name at least one backend"):
        set_auto_cuda_backends()
    assert bayes._auto_cuda == ("triton",)  # the default: the sequential kernels
    try:
        set_auto_cuda_backends("chunk_triton", "triton")
        assert bayes._auto_cuda == ("chunk_triton", "triton")
    finally:
        set_auto_cuda_backends("triton")


@pytest.mark.parametrize("with_state", [True, False])
def test_fake_outputs_match_the_kernels(with_state):
    from linmem.ops.bayes import ops

    t, state = make(1, 20, 1, 16, 16, seed=4, initial_state=with_state)
    t = {n: x.float().to(DEVICE) for n, x in t.items()}
    gates = torch.stack([t["log_decay"], t["obs_noise"], t["process_noise"]], -1)
    M0, P0 = (None, None) if state is None else (x.float().to(DEVICE) for x in state)
    cu = torch.tensor([0, 7, 20], device=DEVICE) if with_state else None
    if with_state:
        M0, P0 = (x.expand(2, *x.shape[1:]).contiguous() for x in (M0, P0))
    args = (t["q"], t["k"], t["v"], gates, M0, P0, cu, 0.25, 1.0, with_state, True, 16, 4)
    torch.library.opcheck(ops.chunk_fwd_op, args, test_utils=("test_faketensor",))
    states, factors = ops.chunk_fwd_op(*args)[4:]
    N = 2 if with_state else 1
    gen = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    bwd = (t["q"], t["k"], t["v"], gates, states, factors, cu, 0.25, rnd(1, 20, 1, 16),
           rnd(1, 20, 1) if with_state else None, rnd(N, 1, 16, 16), rnd(N, 1, 16, 16), 16, 4)
    torch.library.opcheck(ops.chunk_bwd_op, bwd, test_utils=("test_faketensor",))


def test_under_torch_compile_the_custom_op_gives_the_eager_gradients():
    t, state = make(1, 20, 1, 16, 16, seed=6)
    seen: set = set()

    def backend(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if str(n.target).startswith("linmem."))
        return torch._dynamo.lookup_backend("aot_eager" if DEVICE == "cpu" else "inductor")(gm, example_inputs)

    compiled = torch.compile(public("chunk_triton", prior=0.7), fullgraph=True, backend=backend)
    got = run(compiled, t, state, torch.float32, torch.float32)
    compare(got, run(public("chunk_triton", prior=0.7), t, state, torch.float32, torch.float32), 1e-6)
    assert {op for op in seen if "bayes" in op} == {"linmem.bayes_chunk_fwd.default"}


@pytest.mark.gpu
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_real_shapes_and_auto_takes_the_chunked_kernels(K, dtype, monkeypatch):
    """Two sequences of 300 tokens (a short last chunk of 64), 4 heads, every gradient against the reference, with
    "auto" set to take the chunked kernels first (float32 at K = 128: they refuse, the sequential ones serve)."""
    monkeypatch.setattr(bayes, "_auto_cuda", ("chunk_triton", "triton"))
    calls = []
    fn, refusal = bayes._BACKENDS["chunk_triton"]
    monkeypatch.setitem(bayes._BACKENDS, "chunk_triton", (lambda inputs: calls.append(1) or fn(inputs), refusal))
    t, state = make(2, 300, 4, K, K, seed=3)
    if dtype == torch.bfloat16:
        t = {n: (x.bfloat16().double() if n in "qkv" else x) for n, x in t.items()}
    ref_dtype = F64 if dtype == torch.float32 else torch.float32
    ref = run(public("reference"), t, state, ref_dtype, ref_dtype)
    got = run(public("auto"), t, state, dtype, torch.float32)
    compare(got, ref, FP32_TOL if dtype == torch.float32 else LOW_TOL)
    assert calls == ([] if dtype == torch.float32 and K > 64 else [1])
