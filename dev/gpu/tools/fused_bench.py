"""The fused glue ops on CUDA: correctness against their references, and forward+backward time and memory
beside the eager PyTorch code they replace and beside fla's fused modules (when ``fla`` is importable).

Shapes of a ~370M model at 16K tokens a step: B x T = 8 x 2048 (and one packed 16K sequence of 8 for the
varlen convolution), width D = 1024, H = 8 and 16 heads of K = V = 128, MLP width 2752, vocab 32000, bf16; the
rotary embedding of q and k at the softmax transformer's 16 heads of 64, and at one decoding step of 8 rows.

    OUT=/tmp/fused python dev/gpu/tools/fused_bench.py            # prints one table, writes $OUT/fused_bench.json

    git show main:linmem/ops/fused/triton/conv.py > dev/gpu/conv_base.py      # another revision's conv kernels
    OUT=/tmp/fused python dev/gpu/tools/fused_bench.py --conv-base dev/gpu/conv_base.py

With ``--conv-base``, the short convolution's launchers (forward + backward, silu, a bias, W = 4, bf16, at every
head count's shape) run beside that file's, with each conv kernel's GPU time per call (torch.profiler) and the
two revisions' gradients compared.

Correctness: the error ratio rms(a - ref) / rms(ref) of every output and gradient against the reference
(fp32 math on the same bf16 inputs; < 5e-3 for bf16, < 1e-4 for fp32 at the same shapes); the script exits
non-zero if one fails. Time: median of CUDA-event timings of forward + backward (gradients of every input).
Memory: "kept" = what the forward leaves allocated for the backward (outputs included), "peak" = the peak
above the inputs during forward + backward, both in MB.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from linmem.bench.layers import cuda_time_ms
from linmem.ops import fused
from linmem.ops.fused import reference

DEV = "cuda"
BF16 = torch.bfloat16
EPS = 1e-6


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))


# ---------------------------------------------------------------- today's eager code (what the ops replace)


def eager_short_conv(x, weight, bias, cu_seqlens=None):
    """ShortConvolution.forward as the layers run it: F.conv1d on [B, C, W-1+T] + SiLU; windows x weights for
    packed sequences."""
    B, T, C = x.shape
    W = weight.shape[1]
    w, b = weight.to(x.dtype), bias.to(x.dtype)
    if cu_seqlens is None:
        seen = torch.cat([x.new_zeros(B, W - 1, C), x], dim=1)
        y = F.conv1d(seen.transpose(1, 2), w[:, None, :], b, groups=C).transpose(1, 2)
    else:
        padded = torch.cat([x.new_zeros(B, W - 1, C), x], dim=1)
        window = padded.unfold(1, W, 1).movedim(-1, 2)  # [B, T, W, C]
        steps = torch.arange(T, device=x.device)
        seq = torch.searchsorted(cu_seqlens[1:].long(), steps, right=True)
        pos = steps - cu_seqlens.long()[seq]
        lag = torch.arange(W - 1, -1, -1, device=x.device)
        window = window * (lag[None, :] <= pos[:, None]).to(x.dtype)[None, :, :, None]
        y = torch.einsum("btwc,cw->btc", window, w) + b
    return F.silu(y)


def eager_rms_norm(x, weight):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()).to(x.dtype)


def eager_add_rms_norm(x, residual, weight):
    h = residual + x
    return eager_rms_norm(h, weight), h


def eager_gated_rms_norm(x, gate, weight):
    return (eager_rms_norm(x, weight).float() * F.silu(gate.float())).to(x.dtype)


def eager_l2_norm(x, head_dim):
    return F.normalize(x.unflatten(-1, (-1, head_dim)), dim=-1)


def eager_swiglu(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def eager_rotary(q, k, position_ids, theta=10000.0):
    """RotaryEmbedding.forward as the attention layers ran it, once for q and once for k."""
    def rope(x):
        D = x.shape[-1]
        inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32, device=x.device) / D))
        angles = position_ids.float()[..., None] * inv_freq
        cos, sin = angles.cos(), angles.sin()
        cos, sin = torch.cat([cos, cos], -1)[:, :, None, :], torch.cat([sin, sin], -1)[:, :, None, :]
        x32 = x.float()
        x1, x2 = x32.chunk(2, dim=-1)
        return (x32 * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)
    return rope(q), rope(k)


def eager_lm_loss(hidden, weight, labels):
    return F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=-100)


# ---------------------------------------------------------------- fla's fused modules


def fla_ops() -> tuple[dict, str]:
    """op -> a maker of fla's implementation (taking the case's sizes and weights), and fla's version (or why
    there is no fla)."""
    try:
        import fla
        import fla.modules as fm
    except Exception as e:  # noqa: BLE001 - any import failure means "no fla"
        return {}, f"not importable ({type(e).__name__}: {e})"

    def module(cls, *args, **kwargs):
        return cls(*args, **kwargs).to(device=DEV, dtype=BF16)

    def conv(C, weight, bias, cu=None):
        m = module(fm.ShortConvolution, C, weight.shape[1], bias=True, activation="silu")
        with torch.no_grad():
            m.weight.copy_(weight[:, None, :])
            m.bias.copy_(bias)

        def run(x, w, b):
            out = m(x, cu_seqlens=cu) if cu is not None else m(x)
            return out[0] if isinstance(out, tuple) else out
        return run

    def l2_norm(H, K):
        ops = importlib.import_module("fla.modules.l2norm")
        fn = getattr(ops, "l2norm", None) or getattr(ops, "l2_norm")
        return lambda x: fn(x.unflatten(-1, (H, K)))

    def gated_rms_norm(K):
        m = module(fm.FusedRMSNormGated, K, eps=EPS, activation="swish")
        return lambda x, g, w: with_weight(m, w)(x, g)

    def rms_norm(D):
        m = module(fm.RMSNorm, D, eps=EPS)
        return lambda x, r, w: with_weight(m, w)(x, residual=r, prenorm=True)

    def swiglu():
        fn = importlib.import_module("fla.modules.activations").swiglu
        return lambda gu: fn(*gu.chunk(2, dim=-1))

    def linear_cross_entropy(labels):
        loss = fm.FusedLinearCrossEntropyLoss()
        return lambda h, w: loss(h, labels, w)

    def rotary(D):
        m = importlib.import_module("fla.modules.rotary").RotaryEmbedding(D).to(DEV)  # fp32 frequencies
        return lambda q, k: m(q, k)  # positions 0 .. T - 1 in every row

    return ({"short_conv": conv, "l2_norm": l2_norm, "gated_rms_norm": gated_rms_norm, "rms_norm": rms_norm,
             "swiglu": swiglu, "linear_cross_entropy": linear_cross_entropy, "rotary": rotary}, getattr(fla, "__version__", "?"))


def with_weight(module, weight):
    """The module holding weight's values (fla's kernels take their weight from the module)."""
    with torch.no_grad():
        module.weight.copy_(weight)
    return module


def peer(fla: dict, op: str, *args):
    """fla's implementation of op, or the reason there is none."""
    if op not in fla:
        return "fla not available"
    try:
        return fla[op](*args)
    except Exception as e:  # noqa: BLE001 - a peer that cannot be built is reported, not fatal
        return f"{type(e).__name__}: {str(e)[:160]}"


# ---------------------------------------------------------------- measuring


class Workload:
    """impl on fresh leaf copies of the inputs: forward alone, or forward + backward into every input's .grad."""

    def __init__(self, impl: Callable, inputs: list, cotangents: Optional[list] = None) -> None:
        self.impl, self.cotangents = impl, cotangents
        self.leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]

    def forward(self) -> list:
        outs = self.impl(*self.leaves)
        return list(outs) if isinstance(outs, (tuple, list)) else [outs]

    def step(self) -> tuple[list, list]:
        for x in self.leaves:
            x.grad = None
        outs = self.forward()
        grads = self.cotangents or [torch.ones_like(o) for o in outs]
        torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(grads, outs)])
        return outs, [x.grad for x in self.leaves if x.requires_grad]


def memory(work: Workload) -> tuple[float, float]:
    """(MB the forward keeps for the backward, outputs included; peak MB of forward + backward), above what was
    allocated before."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    work.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for x in work.leaves:
        x.grad = None
    base = torch.cuda.memory_allocated()
    outs = work.forward()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base
    del outs
    return kept / 2 ** 20, peak / 2 ** 20


@dataclass
class Row:
    op: str
    shape: str
    ms: dict = field(default_factory=dict)  # implementation -> ms (fwd + bwd)
    kept_mb: dict = field(default_factory=dict)
    peak_mb: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)  # "linmem bf16", "linmem fp32", "eager bf16" -> max error ratio
    notes: list = field(default_factory=list)


def check(row: Row, label: str, impl, ref_impl, inputs, tol: float) -> bool:
    """Max error ratio of impl's outputs and gradients against ref_impl on fp32 copies of the inputs (the same
    cotangents, rounded to the outputs' dtype)."""
    gen = torch.Generator(device=DEV).manual_seed(1234)  # not an input's seed: a cotangent equal to x hides terms
    with torch.no_grad():
        shapes = [o.shape for o in Workload(impl, inputs).forward()]
    cots = [torch.randn(s, device=DEV, generator=gen) if len(s) else torch.ones((), device=DEV) for s in shapes]
    outs, grads = Workload(impl, inputs, cots).step()
    ref_inputs = [x.float() if x.is_floating_point() else x for x in inputs]
    ref_outs, ref_grads = Workload(ref_impl, ref_inputs, [c.to(o.dtype).float() for c, o in zip(cots, outs)]).step()
    err = max(rel_err(a, b) for a, b in zip([*outs, *grads], [*ref_outs, *ref_grads]))
    row.errors[label] = err
    if err >= tol:
        row.notes.append(f"FAIL {label}: error ratio {err:.2e} >= {tol:.0e}")
    return err < tol


def measure(row: Row, impls: dict, inputs: list) -> None:
    for name, impl in impls.items():
        if isinstance(impl, str):
            row.notes.append(f"{name}: {impl}")
            continue
        try:
            work = Workload(impl, inputs)
            row.ms[name] = cuda_time_ms(work.step, repeats=15)
            row.kept_mb[name], row.peak_mb[name] = memory(work)
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
            row.notes.append(f"{name}: {type(e).__name__}: {str(e)[:160]}")
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- the cases


def rand(*shape, dtype=BF16, scale=1.0, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=gen) * scale).to(dtype)


def cases(fla: dict, B: int, T: int, D: int, heads: list[int], K: int, mlp: int, vocab: int):
    """(Row, {"linmem", "eager", "fla": implementation or why none}, inputs, reference) for every op. Weights
    are bf16, as in a bf16 model."""
    for H in heads:
        C = H * K
        w, b = rand(C, 4, scale=0.5, seed=1), rand(C, seed=2)
        impls = {"linmem": lambda x, w, b: fused.short_conv(x, w, b, activation="silu")[0],
                 "eager": eager_short_conv, "fla": peer(fla, "short_conv", C, w, b)}
        yield (Row("short_conv (silu, W=4)", f"{B}x{T}x{C}"), impls, [rand(B, T, C), w, b],
               lambda x, w, b: reference.short_conv(x, w, b, activation="silu")[0])

        cu = torch.linspace(0, B * T, B + 1, device=DEV).round().int()
        impls = {"linmem": lambda x, w, b: fused.short_conv(x, w, b, activation="silu", cu_seqlens=cu)[0],
                 "eager": lambda x, w, b: eager_short_conv(x, w, b, cu), "fla": peer(fla, "short_conv", C, w, b, cu)}
        yield (Row("short_conv varlen", f"1x{B * T}x{C}, {B} seqs"), impls, [rand(1, B * T, C), w, b],
               lambda x, w, b: reference.short_conv(x, w, b, activation="silu", cu_seqlens=cu)[0])

        impls = {"linmem": lambda x: fused.l2_norm(x, head_dim=K), "eager": lambda x: eager_l2_norm(x, K),
                 "fla": peer(fla, "l2_norm", H, K)}
        yield (Row("l2_norm (head split)", f"{B}x{T}x{H}x{K}"), impls, [rand(B, T, C)],
               lambda x: reference.l2_norm(x.unflatten(-1, (H, K))))

        impls = {"linmem": lambda x, g, w: fused.gated_rms_norm(x, g, w, EPS), "eager": eager_gated_rms_norm,
                 "fla": peer(fla, "gated_rms_norm", K)}
        yield (Row("gated_rms_norm (silu)", f"{B}x{T}x{H}x{K}"), impls,
               [rand(B, T, H, K), rand(B, T, H, K, seed=3), rand(K, seed=4) + 1],
               lambda x, g, w: reference.gated_rms_norm(x, g, w, EPS))

    impls = {"linmem": lambda x, r, w: fused.rms_norm(x, w, EPS, residual=r, residual_out=True),
             "eager": eager_add_rms_norm, "fla": peer(fla, "rms_norm", D)}
    yield (Row("rms_norm + residual add", f"{B}x{T}x{D}"), impls,
           [rand(B, T, D), rand(B, T, D, seed=5), rand(D, seed=6) + 1],
           lambda x, r, w: reference.rms_norm(x, w, EPS, residual=r, residual_out=True))

    impls = {"linmem": lambda gu: fused.swiglu(*gu.chunk(2, dim=-1)), "eager": eager_swiglu,
             "fla": peer(fla, "swiglu")}
    yield (Row("swiglu", f"{B}x{T}x{mlp}"), impls, [rand(B, T, 2 * mlp)],
           lambda gu: reference.swiglu(*gu.chunk(2, dim=-1)))

    # the static decoding profile's attention: 16 heads of 64
    pos = torch.arange(T, device=DEV).expand(B, T)
    impls = {"linmem": lambda q, k: fused.rotary(q, k, pos), "eager": lambda q, k: eager_rotary(q, k, pos),
             "fla": peer(fla, "rotary", 64)}
    yield (Row("rotary (q and k)", f"{B}x{T}x16x64 each"), impls, [rand(B, T, 16, 64), rand(B, T, 16, 64, seed=9)],
           lambda q, k: reference.rotary(q, k, pos))

    labels = torch.randint(0, vocab, (B * T,), device=DEV, generator=torch.Generator(device=DEV).manual_seed(8))
    labels[::T] = -100
    impls = {"linmem": lambda h, w: fused.linear_cross_entropy(h, w, labels),
             "eager": lambda h, w: eager_lm_loss(h, w, labels), "fla": peer(fla, "linear_cross_entropy", labels)}
    yield (Row("linear_cross_entropy", f"{B * T}x{D} -> {vocab}"), impls,
           [rand(B * T, D), rand(vocab, D, scale=D ** -0.5, seed=7)],
           lambda h, w: reference.linear_cross_entropy(h, w, labels))


def decode_row(B: int, C: int) -> Row:
    """One decoding step of the short convolution against the cache: fused (in place) vs the eager cat+conv."""
    row = Row("short_conv_step (decode)", f"B={B}, C={C}")
    x, w, b = rand(B, C), rand(C, 4, seed=1), rand(C, seed=2)
    state = rand(B, 3, C, seed=3)
    ref_state = state.clone()
    y = fused.short_conv_step(x, state, w, b, "silu")
    y_ref = reference.short_conv_step(x.float(), ref_state, w, b, "silu")
    row.errors["linmem bf16"] = max(rel_err(y, y_ref), rel_err(state, ref_state))

    def eager():
        seen = torch.cat([state, x[:, None]], dim=1)
        out = F.silu(F.conv1d(seen.transpose(1, 2), w.to(x.dtype)[:, None, :], b.to(x.dtype), groups=C))
        state.copy_(seen[:, 1:])
        return out

    with torch.no_grad():
        row.ms["linmem"] = cuda_time_ms(lambda: fused.short_conv_step(x, state, w, b, "silu"), repeats=50)
        row.ms["eager"] = cuda_time_ms(eager, repeats=50)
    return row


def rotary_decode_row(B: int, H: int, D: int, position: int) -> Row:
    """One decoding step's rotary of q and k [B, 1, H, D] (forward only): the one fused launch vs the eager
    kernels of q and of k."""
    row = Row("rotary (decode)", f"B={B}, H={H}, D={D}, p~{position}")
    q, k = rand(B, 1, H, D), rand(B, 1, H, D, seed=1)
    pos = position - torch.arange(B, device=DEV)[:, None]
    ref = reference.rotary(q.float(), k.float(), pos)
    row.errors["linmem bf16"] = max(rel_err(a, b) for a, b in zip(fused.rotary(q, k, pos), ref))
    with torch.no_grad():
        row.ms["linmem"] = cuda_time_ms(lambda: fused.rotary(q, k, pos), repeats=50)
        row.ms["eager"] = cuda_time_ms(lambda: eager_rotary(q, k, pos), repeats=50)
    return row


def load_conv_kernels(path: str):
    """Another revision's ``linmem/ops/fused/triton/conv.py`` as a module of the package (its relative imports
    resolve there)."""
    spec = importlib.util.spec_from_file_location("linmem.ops.fused.triton.conv_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def conv_kernel_ms(fn: Callable[[], object], repeats: int = 10) -> dict:
    """GPU milliseconds per call of fn of each kernel whose name starts with ``conv_`` (torch.profiler)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    return {e.key: getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0)) / 1e3 / repeats
            for e in prof.key_averages() if e.key.startswith("conv_")}


def conv_revisions(base_path: str, B: int, T: int, C: int) -> tuple[dict, bool]:
    """conv_forward + conv_backward (silu, a bias, W = 4, bf16) of the working tree and of base_path's conv.py:
    the whole launch's CUDA-event ms, each kernel's ms, and the gradients' error ratios between the two."""
    from linmem.ops.fused.triton import conv as head

    revisions = {"head": head, "base": load_conv_kernels(base_path)}
    x, w, b, dy = rand(B, T, C), rand(C, 4, scale=0.5, seed=1), rand(C, seed=2), rand(B, T, C, seed=3)

    def step(kernels):
        kernels.conv_forward(x, w, b, None, None, 1, False)
        return kernels.conv_backward(x, w, b, None, None, dy, None, 1)

    grads = {name: step(kernels)[:3] for name, kernels in revisions.items()}
    errors = {n: rel_err(g, ref) for n, g, ref in zip(("dx", "dw", "db"), grads["head"], grads["base"])}
    result = {"shape": f"{B}x{T}x{C}", "errors head vs base": errors}
    for name, kernels in revisions.items():
        run = lambda kernels=kernels: step(kernels)  # noqa: E731
        result[name] = {"ms": cuda_time_ms(run, repeats=20), "kernels ms": conv_kernel_ms(run)}
    return result, all(e < 5e-3 for e in errors.values())


def table(rows: list[Row]) -> str:
    names = ["linmem", "eager", "fla"]
    head = ("| op | shape | " + " | ".join(f"{n} ms" for n in names) + " | vs eager | vs fla | kept MB l/e/f | "
            "peak MB l/e/f | max err |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ms = [f"{r.ms[n]:.3f}" if n in r.ms else "-" for n in names]
        ratio = lambda n: f"{r.ms[n] / r.ms['linmem']:.2f}x" if n in r.ms and "linmem" in r.ms else "-"  # noqa: E731
        mb = lambda d: "/".join(f"{d[n]:.0f}" if n in d else "-" for n in names)  # noqa: E731
        err = max(r.errors.values()) if r.errors else float("nan")
        lines.append(f"| {r.op} | {r.shape} | " + " | ".join(ms) + f" | {ratio('eager')} | {ratio('fla')} | "
                     f"{mb(r.kept_mb)} | {mb(r.peak_mb)} | {err:.1e} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per step (B x T)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--heads", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--conv-base", help="another revision's linmem/ops/fused/triton/conv.py to time beside")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    B, T = args.tokens // args.seq_len, args.seq_len
    D, K, mlp, vocab = 1024, 128, 2752, 32000
    fla, fla_version = fla_ops()
    rows, failed = [], False
    for row, impls, inputs, ref in cases(fla, B, T, D, args.heads, K, mlp, vocab):
        failed |= not check(row, "linmem bf16", impls["linmem"], ref, inputs, 5e-3)
        check(row, "eager bf16", impls["eager"], ref, inputs, 5e-2)  # today's code, for comparison
        fp32_inputs = [x.float() if x.is_floating_point() else x for x in inputs]
        failed |= not check(row, "linmem fp32", impls["linmem"], ref, fp32_inputs, 1e-4)
        measure(row, {n: impl for n, impl in impls.items()}, inputs)
        rows.append(row)
        print(f"{row.op} {row.shape}: {row.ms} {row.errors} {row.notes}", flush=True)
    rows.append(decode_row(64, 2048))
    rows.append(rotary_decode_row(8, 16, 64, 2048))
    revisions = []
    for H in args.heads if args.conv_base else []:
        result, agree = conv_revisions(args.conv_base, B, T, H * K)
        failed |= not agree
        revisions.append(result)
    env = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "fla": fla_version}
    print(f"\n{env}\n\n{table(rows)}")
    for r in rows:
        for note in r.notes:
            print(f"  {r.op} ({r.shape}): {note}")
    for result in revisions:
        print(f"\nshort_conv fwd+bwd launchers {result['shape']}, head vs {args.conv_base}: errors "
              f"{result['errors head vs base']}")
        for name in ("head", "base"):
            kernels = ", ".join(f"{k} {v * 1e3:.0f} us" for k, v in sorted(result[name]["kernels ms"].items()))
            print(f"  {name}: {result[name]['ms']:.3f} ms ({kernels})")
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "fused_bench.json"), "w") as f:
        json.dump({"env": env, "rows": [asdict(r) for r in rows], "conv_revisions": revisions}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
