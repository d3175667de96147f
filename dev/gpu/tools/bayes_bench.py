"""Check the Bayesian filter's Triton kernels on a GPU and time them beside the gated delta rule.

One run, one GPU; everything goes to ``$OUT/bayes_bench.json`` (and a summary to stdout):

1. correctness: ``bayes_filter(backend="triton")`` against the token-loop reference (fp64 for fp32 inputs,
   fp32 for bf16 inputs on the same rounded values) at K = V = 64 and 128: outputs, variance, final state and
   every gradient, as error ratios rms(x - ref) / rms(ref) (bounds: fp32 1e-4, bf16 5e-3);
2. a long run: P exactly symmetric with positive eigenvalues after 4096 bf16 tokens;
3. launch settings: forward+backward time for V blocks of 32/64/128 and 4/8/16 warps (the defaults are
   ``launch.Launch.default``);
4. timing: forward and forward+backward of ``bayes_filter`` beside ``linear_recurrence`` with the gated delta
   rule (scalar log decay and beta) at the same width, H = 16, K = V = 64 and 128, B x T = 16K tokens, bf16,
   with the peak memory of each forward+backward.

    OUT=/tmp/out python dev/gpu/tools/bayes_bench.py
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

from linmem.ops import bayes_filter, linear_recurrence
from linmem.ops.bayes import launch

DEV = "cuda"
HEADS = 16
SHAPES = [(8, 2048), (4, 4096), (1, 16384)]
DIMS = [64, 128]


def rel_err(x, ref) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))


def filter_inputs(B, T, H, K, V, dtype, seed=0, initial_state=False, mixer_noise=False):
    """Inputs of bayes_filter; the process noise uniform in [0, 0.05), or the mixer's 0.5 (1 - a^2)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=DEV)  # noqa: E731
    t = dict(q=rnd(B, T, H, K).to(dtype), k=F.normalize(rnd(B, T, H, K), dim=-1).to(dtype),
             v=rnd(B, T, H, V).to(dtype),
             log_decay=F.logsigmoid(rnd(B, T, H) + 3), obs_noise=F.softplus(rnd(B, T, H)) + 0.1)
    t["process_noise"] = 0.5 * (1 - torch.exp(2 * t["log_decay"])) if mixer_noise else \
        0.05 * torch.rand(B, T, H, generator=gen, device=DEV)
    state = None
    if initial_state:
        A = rnd(B, H, K, K) / K ** 0.5
        state = (rnd(B, H, K, V), A @ A.transpose(-1, -2) + 0.2 * torch.eye(K, device=DEV))
    return t, state


def grads_of(backend, t, state, qkv_dtype, other_dtype):
    leaves = {n: x.to(qkv_dtype if n in "qkv" else other_dtype).detach().requires_grad_(True) for n, x in t.items()}
    st = None if state is None else tuple(x.to(other_dtype).detach().requires_grad_(True) for x in state)
    o, var, (M, P) = bayes_filter(**leaves, initial_state=st, output_final_state=True, return_variance=True,
                                  backend=backend)
    gen = torch.Generator(device=DEV).manual_seed(1)
    outs = [o, var, M, P]
    loss = sum((x.double() * torch.randn(x.shape, generator=gen, device=DEV).bfloat16().double()).sum() for x in outs)
    wrt = list(leaves.values()) + (list(st) if st else [])
    grads = torch.autograd.grad(loss, wrt)
    names = ["o", "var", "M", "P"] + [f"d{n}" for n in leaves] + (["dM0", "dP0"] if st else [])
    return dict(zip(names, [x.detach() for x in outs] + list(grads)))


def check(K, dtype, backend="triton", T=256, mixer_noise=False) -> dict:
    """``backend`` against the token loop (fp64 for fp32 inputs, fp32 for bf16): every output and gradient."""
    t, state = filter_inputs(2, T, 4, K, K, torch.float32, seed=K, initial_state=True, mixer_noise=mixer_noise)
    if dtype == torch.bfloat16:
        t = {n: (x.bfloat16().float() if n in "qkv" else x) for n, x in t.items()}
    ref_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    ref = grads_of("reference", t, state, ref_dtype, ref_dtype)
    got = grads_of(backend, t, state, dtype, torch.float32)
    errors = {n: rel_err(got[n], ref[n]) for n in ref}
    bound = 1e-4 if dtype == torch.float32 else 5e-3
    return dict(K=K, dtype=str(dtype), worst=max(errors.values()), ok=max(errors.values()) < bound, errors=errors)


def long_run() -> dict:
    t, _ = filter_inputs(2, 4096, 4, 128, 128, torch.bfloat16, seed=5)
    t["obs_noise"] = torch.full_like(t["obs_noise"], 1e-2)
    _, var, (M, P) = bayes_filter(**t, output_final_state=True, return_variance=True, backend="triton")
    eig = torch.linalg.eigvalsh(P.double())
    return dict(symmetric=bool(torch.equal(P, P.transpose(-1, -2))), min_eigenvalue=float(eig.min()),
                min_var=float(var.min()), finite=bool(torch.isfinite(M).all()))


def ms(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def fwd_bwd(fn, leaves):
    def step():
        out = fn()
        out.float().square().mean().backward()
        for x in leaves:
            x.grad = None
    return step


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def bayes_call(t, cfg=None):
    if cfg is None:
        return lambda: bayes_filter(**t, backend="triton")[0]
    args = (t["q"], t["k"], t["v"], t["log_decay"], t["obs_noise"], t["process_noise"], None, None, None,
            t["q"].shape[-1] ** -0.5, 1.0, False, cfg)
    return lambda: launch.BayesFilterFunction.apply(*args)[0]


def timing(B, T, K) -> dict:
    t, _ = filter_inputs(B, T, HEADS, K, K, torch.bfloat16)
    leaves = [t[n].requires_grad_(True) for n in ("q", "k", "v", "log_decay", "obs_noise", "process_noise")]
    beta = torch.sigmoid(torch.randn(B, T, HEADS, device=DEV)).requires_grad_(True)
    gdn = lambda: linear_recurrence(t["q"], t["k"], t["v"], log_decay=t["log_decay"], beta=beta)[0]  # noqa: E731
    row = dict(B=B, T=T, H=HEADS, K=K, V=K)
    with torch.no_grad():
        row["bayes_fwd_ms"] = ms(bayes_call(t))
        row["gated_delta_fwd_ms"] = ms(gdn)
    row["bayes_fwd_bwd_ms"] = ms(fwd_bwd(bayes_call(t), leaves))
    row["gated_delta_fwd_bwd_ms"] = ms(fwd_bwd(gdn, leaves[:4] + [beta]))
    row["bayes_peak_mib"] = peak_mib(fwd_bwd(bayes_call(t), leaves))
    row["gated_delta_peak_mib"] = peak_mib(fwd_bwd(gdn, leaves[:4] + [beta]))
    row["ratio_fwd_bwd"] = row["bayes_fwd_bwd_ms"] / row["gated_delta_fwd_bwd_ms"]
    return row


def launch_sweep(B, T, K) -> list[dict]:
    t, _ = filter_inputs(B, T, HEADS, K, K, torch.bfloat16)
    leaves = [t[n].requires_grad_(True) for n in ("q", "k", "v", "log_decay", "obs_noise", "process_noise")]
    rows = []
    for block_v in (32, 64, 128):
        for warps in (4, 8, 16):
            cfg = launch.Launch(block_v, warps)
            try:
                rows.append(dict(B=B, T=T, K=K, block_v=block_v, num_warps=warps,
                                 fwd_bwd_ms=ms(fwd_bwd(bayes_call(t, cfg), leaves)),
                                 default=cfg == launch.Launch.default(K, K)))
            except Exception as error:  # a config that does not compile is a result of the sweep, not a failure
                rows.append(dict(B=B, T=T, K=K, block_v=block_v, num_warps=warps, error=repr(error)[:200]))
    return rows


def main() -> None:
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    start = time.time()
    report["checks"] = [check(K, dtype) for K in DIMS for dtype in (torch.float32, torch.bfloat16)]
    for c in report["checks"]:
        print(f"check K={c['K']} {c['dtype']}: worst error ratio {c['worst']:.2e} {'ok' if c['ok'] else 'FAIL'}")
    report["long_run"] = long_run()
    print("long run:", report["long_run"])
    if os.environ.get("BAYES_SWEEP") == "1":  # every (V block, warps) config compiles: minutes
        report["launch_sweep"] = [row for K in DIMS for row in launch_sweep(8, 2048, K)]
        for row in report["launch_sweep"]:
            print("sweep", row)
    report["timing"] = []
    for K in DIMS:
        for B, T in SHAPES:
            row = timing(B, T, K)
            report["timing"].append(row)
            print(f"K=V={K} {B}x{T}: bayes {row['bayes_fwd_bwd_ms']:.2f} ms (fwd {row['bayes_fwd_ms']:.2f}), "
                  f"gated delta {row['gated_delta_fwd_bwd_ms']:.2f} ms (fwd {row['gated_delta_fwd_ms']:.2f}), "
                  f"x{row['ratio_fwd_bwd']:.1f}; peak {row['bayes_peak_mib']:.0f} vs "
                  f"{row['gated_delta_peak_mib']:.0f} MiB")
    report["seconds"] = time.time() - start
    (out / "bayes_bench.json").write_text(json.dumps(report, indent=1))
    print("wrote", out / "bayes_bench.json")


if __name__ == "__main__":
    main()
