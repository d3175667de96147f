"""Minimal reproduction: inductor's CPU backend miscompiles an accumulating scatter whose source is
read through a transpose (torch 2.13.0+cpu, x86-64 with AVX-512/AVX2, 2 or more threads).

The 2-D tiled kernel adds the inner tile offset twice to the scatter's destination index
(``x2 + 2*x2_inner`` instead of ``x2 + x2_inner`` in the generated ``atomic_add_vec`` call), so the
result is wrong and the writes run past the buffer: glibc aborts later with "double free or
corruption", "malloc_consolidate(): invalid chunk size" or "corrupted double-linked list", or
an unrelated op fails ("Unknown device: -33"). With one thread inductor takes the non-atomic path
and the result is right.

Upstream: pytorch/pytorch#191837 ("Permute + reshape + F.fold generates an out-of-bounds write"),
fixed by pytorch/pytorch#191861 ("Fix Inductor CPU tile2d atomic_add double-applying the inner
itervar offset"). The same pattern arises in the backward of a gather that packs tokens
(``x[index]``): linmem's chunk backend moves packed tokens by injective scatters instead (see
``_scatter_rows`` in linmem/ops/recurrence/chunk.py).

Run: ``python dev/upstream/inductor_tile2d_atomic_add.py`` -> prints the error of the compiled
result (about 10 instead of 0) or aborts.
"""

import torch

N, L, H, K, T = 2, 13, 2, 8, 20


def scatter_add(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """a, b: [N, H, K, L] (L contiguous); d: [N, H, L, K] (K contiguous); index: [N, L] rows of the result."""
    x = a + b + d.transpose(-1, -2)  # [N, H, K, L]
    return torch.zeros(T, H, K).index_put((index,), x.permute(0, 3, 1, 2), accumulate=True)


if __name__ == "__main__":
    torch.set_num_threads(max(2, torch.get_num_threads()))
    a, b, d = torch.randn(N, H, K, L), torch.randn(N, H, K, L), torch.randn(N, H, L, K)
    index = torch.stack([torch.arange(L), torch.arange(L) + T - L])
    expected = scatter_add(a, b, d, index)
    compiled = torch.compile(scatter_add)(a, b, d, index)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads: "
          f"max |compiled - eager| = {(compiled - expected).abs().max().item():.3g} (0 expected)")
