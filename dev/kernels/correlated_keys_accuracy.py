"""bf16 error ratios of the delta rules on keys near one direction, ours beside flash-linear-attention's.

Keys ``normalize(c_t d + s n_t)`` around one random direction d per head (s = 0.05: nearly parallel,
s = 1.0: random), beta uniform in (0, 1) or in (1.9, 2) (the delta rule with negative eigenvalues). Each
kernel runs on the same bf16-rounded inputs (gates fp32); the reference is our chunk backend in float64
on those inputs. Prints, per case, the error ratio ``rms(x - ref) / rms(ref)`` of the output and of every
input's gradient. Needs a CUDA device and fla (its gated backward with the Hopper guard off, as in
``fla_unguarded_bench.py``); BENCHMARKS.md ("Accuracy") holds a run::

    python dev/kernels/correlated_keys_accuracy.py --cases 0.05:delta,1.0:gated --T 2048
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from linmem.ops import linear_recurrence


def error_ratio(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def case_inputs(B: int, T: int, H: int, D: int, spread: float, beta_low: float, gen: torch.Generator) -> dict:
    """bf16 q, k, v, beta and fp32 gates on the GPU (keys around one direction per head)."""
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    direction = rand(H, D)
    k = F.normalize(rand(B, T, H, 1) * direction + spread * rand(B, T, H, D), dim=-1)
    beta = beta_low + (2.0 - beta_low if beta_low else 1.0) * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    x = {"q": rand(B, T, H, D), "k": k, "v": rand(B, T, H, D), "beta": beta}
    x = {n: t.to(torch.bfloat16).cuda() for n, t in x.items()}
    x["g"] = (F.logsigmoid(rand(B, T, H)) * 0.1).float().cuda()
    return x


def run_case(x: dict, gated: bool, impl: str, do: torch.Tensor) -> list[torch.Tensor]:
    """o and the gradients of q, k, v, beta (and g) of one implementation, as float64."""
    names = ["q", "k", "v", "beta"] + (["g"] if gated else [])
    dtype = torch.float64 if impl == "reference" else None
    leaves = {n: (x[n].to(dtype) if dtype else x[n]).detach().requires_grad_(True) for n in names}
    scale = x["q"].shape[-1] ** -0.5
    g = leaves.get("g")
    if impl == "fla":
        import fla.ops.common.chunk_o as chunk_o
        from fla.ops.delta_rule import chunk_delta_rule
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        chunk_o.TRITON_ABOVE_3_7_1 = True  # fla issue 640's guard off (see fla_unguarded_bench.py)
        q, k, v, beta = (leaves[n] for n in ("q", "k", "v", "beta"))
        o = (chunk_gated_delta_rule(q, k, v, g, beta, scale=scale) if gated else
             chunk_delta_rule(q, k, v, beta, scale=scale))[0]
    else:
        o, _ = linear_recurrence(leaves["q"], leaves["k"], leaves["v"], beta=leaves["beta"], log_decay=g,
                                 scale=scale, backend="chunk" if impl == "reference" else "triton")
    grads = torch.autograd.grad((o.double() * do).sum(), list(leaves.values()))
    return [o.detach().double()] + [t.double() for t in grads]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="0.05:delta,0.05:gated,1.0:delta,1.0:gated",
                        help="spread:rule pairs, rule delta or gated; each runs beta in (0, 1) and in (1.9, 2)")
    parser.add_argument("--B", type=int, default=2)
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--D", type=int, default=128)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    for case in args.cases.split(","):
        spread, rule = case.split(":")
        gated = rule == "gated"
        for beta_low in (0.0, 1.9):
            x = case_inputs(args.B, args.T, args.H, args.D, float(spread), beta_low, gen)
            do = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64).cuda()
            ref = run_case(x, gated, "reference", do)
            cells = []
            for impl in ("triton", "fla"):
                errs = [error_ratio(a, b) for a, b in zip(run_case(x, gated, impl, do), ref)]
                names = ["o", "dq", "dk", "dv", "dbeta", "dg"][:len(errs)]
                cells.append(f"{'ours' if impl == 'triton' else 'fla'}: " +
                             " ".join(f"{n} {e:.1e}" for n, e in zip(names, errs)))
            label = f"beta in {'(1.9, 2)' if beta_low else '(0, 1)'}"
            print(f"s = {spread}, {'gated delta' if gated else 'delta'}, {label}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
