"""Forgetting attention on one GPU: correctness first, then fwd+bwd times beside the peers, in one run.

1. Correctness of every kernel variant that is timed (gated, plain, window, packed sequences, key mask, pruning,
   decoding; bf16 and fp32; head dims 32 to 256) against the reference at mid-size shapes. A variant that fails
   is reported and not timed (Triton 3.4 to 3.7.0 miscompile some backward kernels on Hopper).
2. Accuracy against fp64 (1 x 2048, H = 16, D = 128): the bf16 kernel (gated and plain) beside SDPA's own bf16
   result and beside the materialised bf16 bias handed to SDPA (what the op did before the kernel).
3. fwd+bwd times, H = 16, D = 128, bf16, (B, T) = (8, 2K) ... (1, 32K): gated FoX (ours), ours without a gate,
   SDPA flash causal, FlexAttention with the forget bias as a score_mod, fla's ``parallel_forgetting_attn`` (when
   fla is importable); sliding windows W = 512 ... 4096 (ours, gated) beside SDPA full causal; pruning on
   (tolerance 1e-3, half the heads forgetting strongly) with its measured error; peak memory of each.
4. Decoding: one token against caches of 2K ... 32K keys, batch 8 (ours beside SDPA).
5. ``variants`` (at (B, T) = (8, 2K), (2, 8K), (1, 32K), gated, bf16, D = 128 or ``--head-dim``): each kernel's
   own time (forward, dq pass, dkdv pass) for every candidate tile of ``TILE_CANDIDATES`` (each checked against the
   reference first); then fwd+bwd of SDPA flash causal, fla and ours (gated and plain) with the default tiles and
   with the fastest tiles of this shape.

One table is printed; everything is written as JSON to ``$OUT/fox_bench.json`` (or ``--out``). The checks of 1
always run; ``--only`` picks among the other sections, ``--shapes`` the (B, T) of 3 and 5, so that each call stays
within a time limit (the Triton and FlexAttention compilations of a fresh machine take minutes).

    python dev/gpu/tools/fox_bench.py [--quick] [--only accuracy,train,decode,variants] [--shapes 8x2048,1x32768]
                                      [--head-dim 256]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from linmem.bench.layers import cuda_time_ms  # noqa: E402
from linmem.bench.ops import fla_forgetting_fn, flex_attention_fn  # noqa: E402
from linmem.ops.attention import cached_attention, cumulative_forget, forgetting_attention  # noqa: E402
from linmem.ops.attention.triton import launch  # noqa: E402

H, D = 16, 128
SHAPES = [(8, 2048), (4, 4096), (2, 8192), (1, 16384), (1, 32768)]
WINDOWS = [512, 1024, 2048, 4096]
CACHES = [2048, 8192, 32768]
PRUNE_TOLERANCE = 1e-3
#: (block_m, block_n, warps, stages[, split]) timed by ``--only variants`` per head dim (``--head-dim``) and kernel
#: (the first: launch.TILES); the others compile for sm_90 with few or no spills (``fox_compile.py --candidates``).
#: D = 128: forward at 2 programs per SM and with 128 keys a tile; dq with 32 keys; dkdv with 64 queries a tile (2 or
#: 3 stages) and at 2 programs per SM. D = 256: forward 128 x 64 at 2 stages and 64 x 32 at 4 warps; dq at 2 stages;
#: dkdv split at 2 stages, and in one launch at 32 x 64 (spills in its loops)
TILE_CANDIDATES = {
    128: {
        "forward": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)],
        "dq": [(128, 64, 8, 3), (128, 32, 8, 3), (64, 32, 4, 3)],
        "dkdv": [(32, 128, 8, 3), (64, 128, 8, 2), (64, 128, 8, 3), (32, 64, 4, 3)],
    },
    256: {
        "forward": [(128, 32, 8, 3), (128, 64, 8, 2), (64, 32, 4, 3)],
        "dq": [(128, 32, 8, 3), (128, 32, 8, 2)],
        "dkdv": [(32, 128, 8, 3, True), (32, 128, 8, 2, True), (32, 64, 8, 3)],
    },
}
VARIANT_SHAPES = [(8, 2048), (2, 8192), (1, 32768)]


# ---------------------------------------------------------------- helpers


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """rms(x - ref) / rms(ref)."""
    x, ref = x.double(), ref.double()
    return float((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))


def gates(B: int, T: int, heads: int = H, strong_half: bool = False, seed: int = 0) -> torch.Tensor:
    """log forget gates [B, T, H] fp32: f = sigmoid(N(0, 1) + 3) (about 0.95), or with ``strong_half`` the first
    half of the heads forgetting strongly (sigmoid(N(0, 1) - 1), about 0.3) and the rest weakly (+5)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(B, T, heads, device="cuda", generator=gen)
    if strong_half:
        bias = torch.tensor([-1.0] * (heads // 2) + [5.0] * (heads - heads // 2), device="cuda")
        return F.logsigmoid(logits + bias)
    return F.logsigmoid(logits + 3.0)


def qkv(B: int, T: int, heads: int = H, kv_heads: int = H, dim: int = D, dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen).to(dtype)  # noqa: E731
    return rnd(B, T, heads, dim), rnd(B, T, kv_heads, dim), rnd(B, T, kv_heads, dim)


def outputs_and_grads(fn: Callable, leaves: list[torch.Tensor], do: torch.Tensor):
    """fn(*leaves) and the gradients of <o, do> (None for a leaf fn does not use)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in leaves]
    o = fn(*leaves)
    grads = torch.autograd.grad(o, leaves, do.to(o.dtype), allow_unused=True)
    return o.detach(), grads


def peak_gb(fn: Callable) -> float:
    """Peak memory of one call beyond what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def fwd_bwd(fn: Callable, leaves: list[torch.Tensor]) -> Callable:
    """A closure running fn(*leaves) and its backward against a fixed cotangent."""
    leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in leaves]
    with torch.no_grad():
        probe = fn(*[x.detach() for x in leaves])
    do = torch.randn_like(probe)
    grad_leaves = [x for x in leaves if x.requires_grad]

    def step():
        o = fn(*leaves)
        torch.autograd.grad(o, grad_leaves, do)

    return step


@dataclasses.dataclass
class Row:
    section: str
    case: str
    B: int
    T: int
    ms: Optional[float] = None
    peak_gb: Optional[float] = None
    vs_sdpa: Optional[float] = None
    note: str = ""


def run_row(row: Row, step: Callable, reps: int) -> Row:
    try:
        row.ms = cuda_time_ms(step, warmup=5, repeats=reps)
        row.peak_gb = peak_gb(step)
    except torch.cuda.OutOfMemoryError:
        row.note = "out of memory"
    except Exception as error:  # a peer that does not run at this shape is a finding, not a crash
        row.note = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------- 1. correctness


def check_case(name: str, dtype, dim: int, T: int = 1000, heads: int = 4, kv_heads: int = 2, **kw) -> dict:
    """One variant at B = 2, T = 1000 (not a multiple of any tile), H = 4, Hkv = 2 (or as given), against the
    reference in fp32 (fp64 for fp32 inputs): outputs and every gradient."""
    B = 1 if "cu_seqlens" in kw else 2
    q, k, v = qkv(B, T, heads, kv_heads, dim, dtype)
    log_f = gates(B, T, heads, strong_half=kw.pop("strong", False))
    ref_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    tol = 1e-4 if dtype == torch.float32 else 5e-3
    do = torch.randn(B, T, heads, dim, device="cuda").to(dtype)
    forget = kw.pop("forget", True)

    def op(backend, cast):
        def fn(q, k, v, log_f):
            return forgetting_attention(q, k, v, log_forget=log_f if forget else None, backend=backend, **kw)
        return outputs_and_grads(fn, [q.to(cast), k.to(cast), v.to(cast), log_f], do)

    o, grads = op("triton", dtype)
    o_ref, grads_ref = op("reference", ref_dtype)
    errors = {"o": rel_err(o, o_ref)}
    for n, g, g_ref in zip(("dq", "dk", "dv", "dlog_f"), grads, grads_ref):
        if n != "dlog_f" or forget:
            errors[n] = rel_err(g, g_ref)
    return {"case": name, "ok": all(e < tol for e in errors.values()) and bool(torch.isfinite(o).all()),
            "tol": tol, **errors}


def check_cached(name: str, Tq: int, window: Optional[int]) -> dict:
    """cached_attention (decoding kernel for Tq = 1, flash kernels with a key mask for Tq = 300) against the
    reference, no gradient."""
    B, Tk = 3, 5000
    q, k, v = qkv(B, Tk, 8, 2)
    c = cumulative_forget(gates(B, Tk, 8) * 0.1) + 3.0
    present = torch.rand(B, Tk, device="cuda") > 0.2
    present[1, :700] = False
    with torch.no_grad():
        o = cached_attention(q[:, -Tq:], k, v, key_mask=present, cum_forget=c, window=window, backend="triton")
        ref = cached_attention(q[:, -Tq:].float(), k.float(), v.float(), key_mask=present, cum_forget=c,
                               window=window, backend="reference")
    err = rel_err(o, ref)
    return {"case": name, "ok": err < 5e-3 and bool(torch.isfinite(o).all()), "tol": 5e-3, "o": err}


def correctness() -> list[dict]:
    lengths = [1, 300, 0, 555, 144]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    cases = [
        ("gated bf16 D128", torch.bfloat16, 128, {}),
        ("gated bf16 D64", torch.bfloat16, 64, {}),
        ("gated fp16 D128", torch.float16, 128, {}),
        ("gated fp32 D128", torch.float32, 128, {}),
        ("gated fp32 D64", torch.float32, 64, {}),
        ("plain bf16 D128", torch.bfloat16, 128, {"forget": False}),
        ("window 300 bf16 D128", torch.bfloat16, 128, {"window": 300}),
        ("window 64 fp32 D128", torch.float32, 128, {"window": 64}),
        ("varlen bf16 D128", torch.bfloat16, 128, {"cu_seqlens": cu}),
        ("varlen window fp32 D64", torch.float32, 64, {"cu_seqlens": cu, "window": 100}),
        ("pruned bf16 D128", torch.bfloat16, 128, {"prune_tolerance": PRUNE_TOLERANCE, "strong": True}),
        ("pruned fp32 D128", torch.float32, 128, {"prune_tolerance": PRUNE_TOLERANCE, "strong": True}),
        # the other head dims ("dims ...": a failure there does not stop the timings at D = 128)
        ("dims gated bf16 D32", torch.bfloat16, 32, {}),
        ("dims gated bf16 D96", torch.bfloat16, 96, {}),
        ("dims gated fp32 D96", torch.float32, 96, {}),
        ("dims gated bf16 D192", torch.bfloat16, 192, {}),
        ("dims gated bf16 D256", torch.bfloat16, 256, {}),
        ("dims window 300 fp16 D256", torch.float16, 256, {"window": 300}),
        ("dims varlen bf16 D192", torch.bfloat16, 192, {"cu_seqlens": cu}),
    ]
    results = []
    for name, dtype, dim, kw in cases:
        results.append(_guarded(name, lambda: check_case(name, dtype, dim, **kw)))
    for name, Tq, window in (("decode", 1, None), ("decode window 1000", 1, 1000), ("decode 4 tokens", 4, None),
                             ("prefill after cache", 300, None), ("prefill window", 300, 700)):
        results.append(_guarded(name, lambda: check_cached(name, Tq, window)))
    return results


def _guarded(name: str, fn: Callable) -> dict:
    try:
        return fn()
    except Exception as error:
        return {"case": name, "ok": False, "error": f"{type(error).__name__}: {error}",
                "trace": traceback.format_exc(limit=3)}


# ---------------------------------------------------------------- 2. accuracy against fp64


def accuracy() -> dict:
    """Error ratios against fp64 at 1 x 2048, H = 16, D = 128 (outputs and gradients)."""
    B, T = 1, 2048
    q, k, v = qkv(B, T)
    log_f = gates(B, T)
    do = torch.randn(B, T, H, D, device="cuda").to(torch.bfloat16)
    lo = [q, k, v]
    hi = [x.double() for x in lo]

    def ours(forget):
        return lambda q, k, v, f: forgetting_attention(q, k, v, log_forget=f if forget else None, backend="triton")

    def ref(forget):
        return lambda q, k, v, f: forgetting_attention(q, k, v, log_forget=f if forget else None,
                                                       backend="reference")

    def sdpa(q, k, v, f):
        return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True).transpose(1, 2)

    def sdpa_bias(q, k, v, f):  # the op before the kernel: fp32 bias cast to the activations' dtype
        c = f.float().cumsum(1).transpose(1, 2)  # [B, H, T]
        bias = (c[..., :, None] - c[..., None, :]).masked_fill(~torch.ones(T, T, dtype=torch.bool,
                                                                           device="cuda").tril(), float("-inf"))
        return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                              attn_mask=bias.to(q.dtype)).transpose(1, 2)

    out = {}
    for forget in (False, True):
        exact = outputs_and_grads(ref(forget), [*hi, log_f.double()], do.double())
        runs = {"ours": outputs_and_grads(ours(forget), [*lo, log_f], do)}
        if forget:
            runs["sdpa_bf16_bias"] = outputs_and_grads(sdpa_bias, [*lo, log_f], do)
        else:
            runs["sdpa"] = outputs_and_grads(sdpa, [*lo, log_f], do)
        for name, (o, grads) in runs.items():
            key = f"{'gated' if forget else 'plain'}/{name}"
            out[key] = {"o": rel_err(o, exact[0])}
            for n, g, g_ref in zip(("dq", "dk", "dv", "dlog_f"), grads, exact[1]):
                if n != "dlog_f" or forget:
                    out[key][n] = rel_err(g, g_ref)
    sdpa_err = out["plain/sdpa"]
    for key in ("plain/ours", "gated/ours"):
        out[key]["within_sdpa"] = all(out[key][n] <= 1.05 * sdpa_err[n] for n in ("o", "dq", "dk", "dv"))
    return out


# ---------------------------------------------------------------- 3. timings


def timings(shapes, windows, reps: int, skip: set[str]) -> list[Row]:
    rows = []
    for B, T in shapes:
        q, k, v = qkv(B, T)
        log_f = gates(B, T)
        qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        sdpa = run_row(Row("fwd+bwd", "sdpa flash causal", B, T),
                       fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), [qh, kh, vh]),
                       reps)
        rows.append(sdpa)
        cases: list[tuple[str, Callable, list]] = []
        if "gated" not in skip:
            cases.append(("ours gated", lambda q, k, v, f: forgetting_attention(q, k, v, log_forget=f),
                          [q, k, v, log_f]))
        if "plain" not in skip:
            cases.append(("ours log_forget=None", lambda q, k, v: forgetting_attention(q, k, v), [q, k, v]))
        cases.append(("flex score_mod", None, [q, k, v, log_f]))
        cases.append(("fla parallel_forgetting_attn", None, [q, k, v, log_f]))
        if "pruned" not in skip:
            strong = gates(B, T, strong_half=True)
            cases.append((f"ours pruned tol={PRUNE_TOLERANCE:g}",
                          lambda q, k, v, f: forgetting_attention(q, k, v, log_forget=f,
                                                                  prune_tolerance=PRUNE_TOLERANCE),
                          [q, k, v, strong]))
        if "window" not in skip:
            for W in windows:
                cases.append((f"ours gated window={W}",
                              lambda q, k, v, f, W=W: forgetting_attention(q, k, v, log_forget=f, window=W),
                              [q, k, v, log_f]))
        for name, fn, leaves in cases:
            row = Row("fwd+bwd", name, B, T)
            if name.startswith("ours pruned"):
                row.note = prune_error(*leaves) + "; "
            try:
                if fn is None:
                    fn = flex_attention_fn(B, T) if name.startswith("flex") else fla_forgetting_fn()
            except Exception as error:
                row.note = f"not run: {type(error).__name__}: {str(error).splitlines()[0][:100]}"
                rows.append(row)
                continue
            run_row(row, fwd_bwd(fn, leaves), reps)
            if row.ms is not None and sdpa.ms is not None:
                row.vs_sdpa = row.ms / sdpa.ms
            rows.append(row)
        del q, k, v, qh, kh, vh
        torch.cuda.empty_cache()
    return rows


def prune_error(q, k, v, log_f) -> str:
    """The pruned output's error against the unpruned kernel: max |diff| / (2 max |v|) (the stated bound is the
    tolerance; bf16 rounding of the two outputs adds about 2^-9 |o|), and the error ratio."""
    try:
        with torch.no_grad():
            exact = forgetting_attention(q, k, v, log_forget=log_f)
            pruned = forgetting_attention(q, k, v, log_forget=log_f, prune_tolerance=PRUNE_TOLERANCE)
        worst = float((pruned.float() - exact.float()).abs().max() / (2 * v.float().abs().max()))
        return f"max|diff|/(2max|v|) = {worst:.1e} (bound {PRUNE_TOLERANCE:g}), ratio {rel_err(pruned, exact):.1e}"
    except torch.cuda.OutOfMemoryError:
        return "error not measured (out of memory)"


def decoding(reps: int) -> list[Row]:
    rows = []
    B = 8
    for Tk in CACHES:
        q, k, v = qkv(B, Tk)
        c = cumulative_forget(gates(B, Tk))
        present = torch.ones(B, Tk, dtype=torch.bool, device="cuda")
        q1 = q[:, -1:].contiguous()
        qh, kh, vh = q1.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        with torch.no_grad():
            sdpa = run_row(Row("decode", "sdpa (no gate)", B, Tk),
                           lambda: F.scaled_dot_product_attention(qh, kh, vh), reps)
            ours = run_row(Row("decode", "ours gated, key mask", B, Tk),
                           lambda: cached_attention(q1, k, v, key_mask=present, cum_forget=c), reps)
        if ours.ms is not None and sdpa.ms is not None:
            ours.vs_sdpa = ours.ms / sdpa.ms
        rows += [sdpa, ours]
    return rows


# ---------------------------------------------------------------- 5. variants: per-kernel times of candidate tiles


def kernel_inputs(B: int, T: int, dim: int) -> dict:
    """Gated bf16 inputs at (B, T), H = 16, head dim ``dim``, and what each kernel reads: c head-major, o and lse of
    the forward, a cotangent do."""
    q, k, v = qkv(B, T, dim=dim)
    c = gates(B, T).cumsum(1)
    x = dict(q=q, k=k, v=v, c=c.transpose(1, 2).contiguous(), scale=dim ** -0.5,
             do=torch.randn(B, T, H, dim, device="cuda").to(torch.bfloat16))
    x["o"], x["lse"] = launch.attention_forward(q, k, v, x["c"], None, None, None, x["scale"], None, None)
    return x


def kernel_steps(x: dict) -> dict[str, Callable]:
    """One closure per kernel (current launch.TILES). The dkdv pass reads the u of a dq pass with the same tiles
    (its query tiles), made here."""
    q, k, v, c, do, scale = x["q"], x["k"], x["v"], x["c"], x["do"], x["scale"]
    common = (q, k, v, c, None, None, None)
    _, delta, u = launch.backward_dq(*common, x["o"], x["lse"], do, scale, None, None)
    return {
        "forward": lambda: launch.attention_forward(*common, scale, None, None),
        "dq": lambda: launch.backward_dq(*common, x["o"], x["lse"], do, scale, None, None),
        "dkdv": lambda: launch.backward_dkdv(*common, x["lse"], delta, u, do, scale, None, None),
    }


def candidate_ok(kernel: str, tiles: tuple, dim: int) -> dict:
    """The gated bf16 check with ``tiles`` for ``kernel`` at head dim ``dim``, compiled as it is timed (B = 2,
    T = 1024, H = Hkv = 16: the sizes' divisibility by 16 and B > 1 select the same specialisation)."""
    saved = launch.TILES[kernel][dim]
    launch.TILES[kernel][dim] = launch.Tiles(*tiles)
    try:
        return _guarded(f"{kernel} {tiles}", lambda: check_case(f"{kernel} {tiles}", torch.bfloat16, dim, T=1024,
                                                                heads=H, kv_heads=H))
    finally:
        launch.TILES[kernel][dim] = saved


def variants(shapes, reps: int, dim: int) -> tuple[list[Row], dict]:
    """Per shape: each kernel's time at each checked candidate tile (the others at their defaults) and the
    default's again (how far repeated timings drift); then fwd+bwd of the peers and ours at the default and the
    fastest tiles, all at head dim ``dim``."""
    candidates = TILE_CANDIDATES[dim]
    checks = {(kern, t): candidate_ok(kern, t, dim) for kern, cands in candidates.items() for t in cands}
    for (kern, t), check in checks.items():
        errs = " ".join(f"{n}={e:.1e}" for n, e in check.items() if isinstance(e, float) and n != "tol")
        print(f"check {kern} {t}: {'ok' if check.get('ok') else 'FAILED'} {errs} {check.get('error', '')}", flush=True)
    defaults = {kern: launch.TILES[kern][dim] for kern in candidates}
    rows, best = [], {}
    for B, T in shapes:
        x = kernel_inputs(B, T, dim)
        fastest = {}
        for kern, cands in candidates.items():
            for t in cands:
                name = f"{kern} {'x'.join(map(str, t))}" + (" (default)" if launch.Tiles(*t) == defaults[kern] else "")
                if not checks[(kern, t)].get("ok"):
                    rows.append(Row("kernel", name, B, T, note="failed its check"))
                    continue
                launch.TILES[kern][dim] = launch.Tiles(*t)
                row = run_row(Row("kernel", name, B, T), kernel_steps(x)[kern], reps)
                launch.TILES[kern][dim] = defaults[kern]
                rows.append(row)
                if row.ms is not None and (kern not in fastest or row.ms < fastest[kern][1]):
                    fastest[kern] = (t, row.ms)
            again = f"{kern} {'x'.join(map(str, dataclasses.astuple(defaults[kern])))} (default, again)"
            rows.append(run_row(Row("kernel", again, B, T), kernel_steps(x)[kern], reps))
        best[f"{B}x{T}"] = {kern: t for kern, (t, _) in fastest.items()}
        del x
        q, k, v = qkv(B, T, dim=dim)
        log_f = gates(B, T)
        qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        sdpa = run_row(Row("fwd+bwd", "sdpa flash causal", B, T),
                       fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), [qh, kh, vh]),
                       reps)
        cases = [("fla parallel_forgetting_attn", None, [q, k, v, log_f]),
                 ("ours gated (default tiles)", lambda q, k, v, f: forgetting_attention(q, k, v, log_forget=f),
                  [q, k, v, log_f]),
                 ("ours log_forget=None (default tiles)", lambda q, k, v: forgetting_attention(q, k, v), [q, k, v])]
        tuned = {kern: launch.Tiles(*t) for kern, t in best[f"{B}x{T}"].items()}
        label = " ".join(f"{kern} {'x'.join(map(str, dataclasses.astuple(t)))}" for kern, t in tuned.items())
        if any(tuned[kern] != defaults[kern] for kern in tuned):
            cases += [("ours gated (fastest tiles)", "tuned gated", [q, k, v, log_f]),
                      ("ours log_forget=None (fastest tiles)", "tuned plain", [q, k, v])]
        rows.append(sdpa)
        for name, fn, leaves in cases:
            row = Row("fwd+bwd", name, B, T, note=label if "fastest" in name else "")
            if fn is None:
                try:
                    fn = fla_forgetting_fn()
                except Exception as error:
                    row.note = f"not run: {type(error).__name__}: {str(error).splitlines()[0][:100]}"
                    rows.append(row)
                    continue
            if isinstance(fn, str):
                gated = fn == "tuned gated"
                fn = (lambda q, k, v, f: forgetting_attention(q, k, v, log_forget=f)) if gated else \
                    (lambda q, k, v: forgetting_attention(q, k, v))
                for kern, t in tuned.items():
                    launch.TILES[kern][dim] = t
            run_row(row, fwd_bwd(fn, leaves), reps)
            for kern in candidates:
                launch.TILES[kern][dim] = defaults[kern]
            if row.ms is not None and sdpa.ms is not None:
                row.vs_sdpa = row.ms / sdpa.ms
            rows.append(row)
        del q, k, v, qh, kh, vh
        torch.cuda.empty_cache()
    return rows, {"checks": {f"{kern} {t}": c for (kern, t), c in checks.items()}, "fastest": best}


# ---------------------------------------------------------------- main


def table(rows: list[Row]) -> str:
    lines = [f"{'section':8s} {'case':40s} {'B':>2s} {'T':>6s} {'ms':>9s} {'x sdpa':>7s} {'Mtok/s':>7s} "
             f"{'peak GB':>8s}  note"]
    for r in rows:
        tok = r.B * r.T / (r.ms * 1e3) if r.ms and r.section == "fwd+bwd" else None
        lines.append(f"{r.section:8s} {r.case:40s} {r.B:>2d} {r.T:>6d} "
                     f"{(f'{r.ms:.3f}' if r.ms is not None else '-'):>9s} "
                     f"{(f'{r.vs_sdpa:.2f}' if r.vs_sdpa is not None else '-'):>7s} "
                     f"{(f'{tok:.2f}' if tok else '-'):>7s} "
                     f"{(f'{r.peak_gb:.2f}' if r.peak_gb is not None else '-'):>8s}  {r.note}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two shapes, two windows, fewer repetitions")
    parser.add_argument("--only", default="accuracy,train,decode",
                        help="sections after the checks: accuracy, train, decode, variants (comma-separated)")
    parser.add_argument("--shapes", help="(B, T) of the training and variant times, e.g. 8x2048,1x32768")
    parser.add_argument("--head-dim", type=int, default=D, choices=sorted(TILE_CANDIDATES),
                        help="head dim of the variants section (its candidate tiles: TILE_CANDIDATES)")
    parser.add_argument("--reps", type=int, help="timed repetitions per row (default 20, 5 with --quick)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "fox_bench.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fox_bench needs a CUDA device")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "tiles": {k: {d: dataclasses.astuple(t) for d, t in v.items()} for k, v in launch.TILES.items()}}
    print(f"{report['device']}  torch {report['torch']}  triton {report['triton']}", flush=True)

    report["correctness"] = correctness()
    for c in report["correctness"]:
        errs = " ".join(f"{k}={v:.1e}" for k, v in c.items() if isinstance(v, float) and k != "tol")
        print(f"check {c['case']:28s} {'ok' if c['ok'] else 'FAILED'}  {errs} {c.get('error', '')}", flush=True)
    failed = {c["case"] for c in report["correctness"] if not c["ok"]}
    skip = set()
    if any(name.startswith(("gated", "varlen")) for name in failed):
        skip |= {"gated", "window", "pruned"}
    if "plain bf16 D128" in failed:
        skip.add("plain")
    if any(name.startswith("window") for name in failed):
        skip.add("window")
    if any(name.startswith("pruned") for name in failed):
        skip.add("pruned")
    if skip:
        print(f"not timed (failed checks): {sorted(skip)}", flush=True)

    sections = set(args.only.split(","))
    if "accuracy" in sections:
        report["accuracy_vs_fp64"] = _guarded("accuracy", accuracy)
        for key, errs in report["accuracy_vs_fp64"].items():
            text = " ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in errs.items()) \
                if isinstance(errs, dict) else str(errs)
            print(f"accuracy {key:22s} {text}", flush=True)

    shapes = SHAPES[:2] if args.quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    windows = WINDOWS[::3] if args.quick else WINDOWS
    reps = args.reps or (5 if args.quick else 20)
    rows = timings(shapes, windows, reps, skip) if "train" in sections else []
    if "decode" in sections:
        rows += decoding(reps * 5)
    if "variants" in sections:
        if {"gated", "plain"} & skip:
            print("variants not timed: the gated or plain checks failed", flush=True)
        else:
            variant_rows, report["variants"] = variants(VARIANT_SHAPES if not args.shapes else shapes, reps,
                                                        args.head_dim)
            rows += variant_rows
    report["rows"] = [dataclasses.asdict(r) for r in rows]
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {args.out}")
    if failed:
        sys.exit(f"FAILED checks: {sorted(failed)}")


if __name__ == "__main__":
    main()
