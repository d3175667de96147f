"""Find kernels of the recurrence that do not give the same bits twice: every launch of one forward+backward is
run again, several times, on its inputs as they were, and each rerun's outputs are compared bit for bit.

A race that Triton compiles into a kernel (as it does for the per-channel gradient kernel at 4 warps and 2 or 3
stages on Hopper when its chunk-end term reads the tiles of its products) can change a few columns of a few chunks
in most runs while every error-ratio test passes, since they hardly move a tensor's norm. This check sees such a
race at the launch it happens in. On a GPU::

    python dev/kernels/kernel_reruns.py --ops gla,kda --shapes 4x4096
    python dev/kernels/kernel_reruns.py --ops gla --launch grads_vector=4,3     # a config to vet before landing it
    python dev/kernels/kernel_reruns.py --dtype fp16 --varlen 7                 # fp16 inputs, 7 packed sequences

Each launch goes through ``launch.run_kernel``: the check copies every tensor argument before the launch, runs it,
keeps the results, then ``--reruns`` times restores the copies, runs it again and compares. It prints, per op,
the launches that differed: (kernel, warps, stages, argument index) -> (reruns that differed, largest difference).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from kernel_ab import add_case_args, call, cases  # noqa: E402  (its folder is on sys.path when run as a script)
from linmem.ops.recurrence.triton import configs, launch, pipeline


def checking(run, reruns: int, found: dict):
    """``launch.run_kernel`` with every launch rerun ``reruns`` times on its inputs as they were; differences go to
    ``found``. Returns what the first run returned (the launch plans keep it)."""

    def checked(kernel, grid, args, constexprs, warps, stages, maxnreg=None, compiled=None):
        seen, tensors = set(), []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.numel() and a.data_ptr() not in seen:
                seen.add(a.data_ptr())
                tensors.append((i, a))
        before = [a.clone() for _, a in tensors]
        launched = run(kernel, grid, args, constexprs, warps, stages, maxnreg, compiled)
        after = [a.clone() for _, a in tensors]
        for _ in range(reruns):
            for (_, a), b in zip(tensors, before):
                a.copy_(b)
            run(kernel, grid, args, constexprs, warps, stages, maxnreg, compiled)
            for (i, a), r in zip(tensors, after):
                differs = a != r
                if a.dtype.is_floating_point:
                    differs &= ~(torch.isnan(a) & torch.isnan(r))
                if differs.any():
                    key = (kernel.__name__, warps, stages, i)
                    count, largest = found.get(key, (0, 0.0))
                    found[key] = (count + 1, max(largest, (a.float() - r.float()).abs()[differs].max().item()))
        for (_, a), r in zip(tensors, after):
            a.copy_(r)
        return launched

    return checked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_args(parser, "linear_attention,mamba2,gla,rwkv6,deltanet,gated_deltanet,kda")
    parser.add_argument("--reruns", type=int, default=6, help="reruns of every launch")
    parser.add_argument("--calls", type=int, default=2, help="forward+backward calls per op")
    parser.add_argument("--launch", action="append", default=[], help="LAUNCH entry to set, e.g. grads_vector=4,3")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu with TRITON_INTERPRET=1 (small shapes)")
    args = parser.parse_args()
    changes = {}
    for entry in args.launch:
        name, _, value = entry.partition("=")
        changes[name] = tuple(int(x) for x in value.split(","))
    found: dict = {}
    launch.run_kernel = checking(launch.run_kernel, args.reruns, found)
    where = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"{where}, torch {torch.__version__}, {args.dtype}; launch {args.launch or 'as set'}")
    with configs.override(LAUNCH=changes):
        for label, op_args, decay, do, cu in cases(args, args.device):
            report(label, op_args, decay, do, cu, args, found)


def report(label: str, op_args: dict, decay: int, do: torch.Tensor, cu, args: argparse.Namespace,
           found: dict) -> None:
    """Run one case's calls and print the launches whose reruns differed."""
    found.clear()
    for _ in range(args.calls):
        call(pipeline, op_args, decay, do, cu)
    if args.device == "cuda":
        torch.cuda.synchronize()
    per_launch = defaultdict(dict)
    for (name, warps, stages, i), value in found.items():
        per_launch[f"{name} ({warps} warps, {stages} stages)"][f"arg {i}"] = value
    verdict = dict(per_launch) if per_launch else "every launch gave the same bits"
    print(f"{label}: {verdict}", flush=True)


if __name__ == "__main__":
    main()
