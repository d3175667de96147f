"""The Triton kernels of the Bayesian filter against the token-loop reference.

Outputs, variance, final state and every input gradient (q, k, v, log_decay, obs_noise, process_noise,
the initial mean and covariance), by the error ratio ``rms(x - ref) / rms(ref)``: fp32 inputs against
the fp64 reference (< 1e-4), bf16 inputs against the fp32 reference on the same rounded inputs and
cotangents (< 5e-3). On a machine without CUDA the kernels run through the Triton interpreter
(``TRITON_INTERPRET=1``, set by ``tests/conftest.py`` before triton is first imported) at small shapes.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import rel_err, triton_kernels_device

DEVICE = triton_kernels_device()

from linmem.ops import bayes_filter, bayes_filter_step  # noqa: E402

from linmem.ops.bayes import launch  # noqa: E402

F64 = torch.float64
FP32_TOL = 1e-4
LOW_TOL = 5e-3


def make(B, T, H, K, V, *, seed, process_noise=True, initial_state=True, N=None):
    """Inputs in fp64: unit keys, decays in (0, 1), r in (0.1, ~3), a well-conditioned non-symmetric P0."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    t = dict(q=rnd(B, T, H, K), k=F.normalize(rnd(B, T, H, K), dim=-1), v=rnd(B, T, H, V),
             log_decay=F.logsigmoid(rnd(B, T, H) + 2), obs_noise=F.softplus(rnd(B, T, H)) + 0.1)
    if process_noise:
        t["process_noise"] = 0.2 * torch.rand(B, T, H, generator=gen, dtype=F64)
    state = None
    if initial_state:
        N = B if N is None else N
        A = rnd(N, H, K, K) / K ** 0.5
        state = (rnd(N, H, K, V), A @ A.transpose(-1, -2) + 0.2 * torch.eye(K, dtype=F64) + 0.01 * rnd(N, H, K, K))
    return t, state


def run(fn, t, state, dtype, ref_dtype, cotangent_seed=7):
    """fn's (o, var, M, P) and the gradients of every input under random cotangents; q, k, v in ``dtype``,
    everything else in ``ref_dtype`` (cotangents rounded to bf16, so that every run sees the same ones)."""
    leaves = {n: x.to(dtype if n in "qkv" else ref_dtype).to(DEVICE).requires_grad_(True) for n, x in t.items()}
    st = None if state is None else tuple(x.to(ref_dtype).to(DEVICE).requires_grad_(True) for x in state)
    o, var, M, P = fn(leaves, st)
    gen = torch.Generator().manual_seed(cotangent_seed)
    outs = [x for x in (o, var, M, P) if x is not None]
    loss = sum((x.double() * torch.randn(x.shape, generator=gen).bfloat16().double().to(DEVICE)).sum() for x in outs)
    wrt = list(leaves.values()) + (list(st) if st is not None else [])
    grads = torch.autograd.grad(loss, wrt)
    names = ["o"] + (["var"] if var is not None else []) + ["M", "P"] + [f"d{n}" for n in leaves]
    names += ["dM0", "dP0"] if st is not None else []
    return dict(zip(names, [x.detach() for x in outs] + list(grads)))


def public(backend, variance=True, **kwargs):
    def fn(leaves, state):
        o, var, (M, P) = bayes_filter(**leaves, initial_state=state, output_final_state=True,
                                      return_variance=variance, backend=backend, **kwargs)
        return o, var, M, P
    return fn


def compare(got, ref, tol):
    assert got.keys() == ref.keys()
    for name in ref:
        err = rel_err(got[name].cpu(), ref[name].cpu())
        assert err < tol, f"{name}: error ratio {err:.2e} >= {tol}"


def test_fp32_every_gradient_with_initial_state_and_process_noise():
    t, state = make(1, 20, 2, 16, 16, seed=0)
    ref = run(public("reference", prior=0.7), t, state, F64, F64)
    got = run(public("triton", prior=0.7), t, state, torch.float32, torch.float32)
    compare(got, ref, FP32_TOL)


def test_bf16_varlen_value_blocks():
    """Three packed sequences (one empty) from the prior, no process noise, no variance, V = 32 in two blocks."""
    t, _ = make(1, 30, 1, 16, 32, seed=1, process_noise=False, initial_state=False)
    cu = torch.tensor([0, 11, 11, 30], device=DEVICE)
    t = {n: (x.bfloat16().double() if n in "qkv" else x) for n, x in t.items()}

    def blocks_of_16(leaves, state):
        o, var, M, P = launch.BayesFilterFunction.apply(
            *(leaves[n] for n in ("q", "k", "v", "log_decay", "obs_noise")), None, None, None, cu, 16 ** -0.5, 1.0,
            False, launch.Launch(16, 4))
        return o, None, M, P

    ref = run(public("reference", variance=False, cu_seqlens=cu), t, None, torch.float32, torch.float32)
    got = run(blocks_of_16, t, None, torch.bfloat16, torch.float32)
    compare(got, ref, LOW_TOL)
    assert torch.equal(got["P"][1, 0].cpu(), torch.eye(16)), "the empty sequence keeps its prior"


def test_decoding_step_runs_the_kernel_in_place(caplog):
    caplog.set_level(logging.DEBUG, logger="linmem.ops")
    t, state = make(2, 3, 2, 16, 16, seed=2)
    t = {n: x.float().to(DEVICE) for n, x in t.items()}
    M, P = (x.float().to(DEVICE).contiguous() for x in state)
    o, var, (M_ref, P_ref) = bayes_filter(**t, initial_state=(M, P), output_final_state=True, return_variance=True,
                                          backend="reference")
    ptrs = (M.data_ptr(), P.data_ptr())
    for i in range(3):
        step = {n: x[:, i] for n, x in t.items()}
        o_i, var_i, (M, P) = bayes_filter_step(step.pop("q"), step.pop("k"), step.pop("v"), (M, P), **step,
                                               return_variance=True, backend="triton")
        assert rel_err(o_i, o[:, i]) < FP32_TOL and rel_err(var_i, var[:, i]) < FP32_TOL
    assert (M.data_ptr(), P.data_ptr()) == ptrs
    assert "stepping in PyTorch" not in caplog.text
    assert rel_err(M, M_ref) < FP32_TOL and rel_err(P, P_ref) < FP32_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_real_shapes(dtype):
    """K = V = 128, two sequences of 256 tokens, 4 heads: every gradient against the reference."""
    t, state = make(2, 256, 4, 128, 128, seed=3)
    if dtype == torch.bfloat16:
        t = {n: (x.bfloat16().double() if n in "qkv" else x) for n, x in t.items()}
    ref_dtype = F64 if dtype == torch.float32 else torch.float32
    ref = run(public("reference"), t, state, ref_dtype, ref_dtype)
    got = run(public("triton"), t, state, dtype, torch.float32)
    compare(got, ref, FP32_TOL if dtype == torch.float32 else LOW_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("obs_noise,process_noise", [(1e-2, 1e-4), (2e-5, 1e-6)])
def test_gpu_covariance_stays_symmetric_positive_over_4096_bf16_tokens(obs_noise, process_noise):
    """Confident observations (kappa ~ 1e2) and near the fp32 bound (kappa ~ 5e4: docs/bayes.md, "Conditioning")."""
    gen = torch.Generator().manual_seed(4)
    B, T, H, K = 2, 4096, 4, 128
    q, k, v = (torch.randn(B, T, H, K, generator=gen).bfloat16().to(DEVICE) for _ in range(3))
    k = F.normalize(k.float(), dim=-1).bfloat16()
    _, var, (M, P) = bayes_filter(q, k, v, log_decay=F.logsigmoid(torch.randn(B, T, H, generator=gen) + 4).to(DEVICE),
                                  obs_noise=torch.full((B, T, H), obs_noise, device=DEVICE),
                                  process_noise=torch.full((B, T, H), process_noise, device=DEVICE),
                                  output_final_state=True, return_variance=True, backend="triton")
    assert torch.equal(P, P.transpose(-1, -2))
    assert torch.linalg.eigvalsh(P.double()).min() > 0 and bool((var >= obs_noise).all()) and torch.isfinite(M).all()
