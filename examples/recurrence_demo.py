"""A tour of the unified recurrence: every rule family, chunked vs token-by-token, on CPU.

Run: python examples/recurrence_demo.py
"""

import time

import torch
import torch.nn.functional as F

from linmem.ops import linear_recurrence


def main() -> None:
    torch.manual_seed(0)
    B, T, H, K, V = 2, 512, 4, 32, 32
    q, v = torch.randn(B, T, H, K), torch.randn(B, T, H, V)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1)
    families = {
        "linear attention": {},
        "RetNet (constant decay)": dict(log_decay=torch.log(1 - 2.0 ** (-5 - torch.arange(H, dtype=torch.float32)))),
        "Mamba-2 (scalar decay)": dict(log_decay=F.logsigmoid(torch.randn(B, T, H) + 3)),
        "GLA (per-channel decay)": dict(log_decay=F.logsigmoid(torch.randn(B, T, H, K)) / 16),
        "RWKV-6 (decay + bonus)": dict(log_decay=-torch.exp(torch.randn(B, T, H, K) - 2), bonus=torch.randn(H, K)),
        "DeltaNet": dict(beta=torch.rand(B, T, H)),
        "Gated DeltaNet": dict(beta=torch.rand(B, T, H), log_decay=F.logsigmoid(torch.randn(B, T, H) + 3)),
    }
    for backend in ("chunk", "reference"):  # warm-up: the first call of each backend pays one-off costs
        linear_recurrence(q[:, :64], k[:, :64], v[:, :64], backend=backend)
    print(f"B={B} T={T} H={H} K={K} V={V}, fp32 on CPU, wall-clock ms of one call")
    print(f"{'rule':<26}{'chunk ms':>10}{'loop ms':>10}{'rel. error':>12}")
    for name, extra in families.items():
        timings, outputs = {}, {}
        for backend in ("chunk", "reference"):
            start = time.perf_counter()
            outputs[backend], _ = linear_recurrence(q, k, v, backend=backend, **extra)
            timings[backend] = 1e3 * (time.perf_counter() - start)
        ref = outputs["reference"]
        err = ((outputs["chunk"] - ref).norm() / ref.norm()).item()
        print(f"{name:<26}{timings['chunk']:>10.1f}{timings['reference']:>10.1f}{err:>12.1e}")


if __name__ == "__main__":
    main()
