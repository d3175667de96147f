"""How accurately ways of computing the delta rule's chunk inverse ``T = (I + L)^-1`` give ``T x``.

``L = strict_lower(diag(beta) K K^T)`` for one chunk of 64 unit keys, the prep kernel's 16 x 16 blocks
(``wy_prep.unit_lower_inverse``), simulated on the CPU in float64 with each product's operands
and result rounded as the GPU would round them. Printed: the relative error ``|T x - T_exact x| /
|T_exact x|`` for random x [64, 128], for

- ``series``: the diagonal blocks from ``(I - L)(I + L^2)(I + L^4)(I + L^8)`` in fp32 (what doubling replaces);
- ``doubling``: the diagonal blocks by doubling, ``D - D Lo D``, in fp32 (the kernel's way for fp32 inputs);
- ``doubling tf32``: the same with every product's operands rounded to tf32;
- ``doubling tf32x3``: the same with each product as three tf32 products, ``a_hi b_hi + a_hi b_lo +
  a_lo b_hi`` with ``a = a_hi + a_lo`` (Triton's ``input_precision="tf32x3"``, on the tensor cores);
- ``doubling bf16x3``: the same with three bf16 products on operands split into bf16 parts
  (``numerics.mm_split`` with both operands fp32: the kernel's way for bf16 and fp16 inputs);
- ``merges tf32``: the diagonal blocks by doubling in fp32, the blocks below the diagonal in tf32;
- ``exact -> bf16``: the exact inverse rounded to bf16 (fla stores its inverse in the input dtype).

Keys near a few directions and beta near 2 (the delta rule with negative eigenvalues) make the powers
of L grow while T stays of order 1::

    python dev/kernels/wy_inverse_accuracy.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

C, SB, K = 64, 16, 128


def tf32(x: torch.Tensor) -> torch.Tensor:
    """x rounded to tf32 (10 mantissa bits, round to nearest even), as fp32."""
    bits = x.float().view(torch.int32)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
    return bits.view(torch.float32)


def bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 (round to nearest even), as fp32."""
    return x.float().to(torch.bfloat16).float()


def product(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    """a @ b with fp32 operands and an fp32 result; precision "ieee", "tf32", "tf32x3" or "bf16x3"."""
    if precision == "tf32":
        a, b = tf32(a), tf32(b)
    elif precision in ("tf32x3", "bf16x3"):
        part = tf32 if precision == "tf32x3" else bf16
        a_hi, b_hi = part(a), part(b)
        a_lo, b_lo = part(a.float() - a_hi), part(b.float() - b_hi)
        small = (a_hi.double() @ b_lo.double()).float() + (a_lo.double() @ b_hi.double()).float()
        return (a_hi.double() @ b_hi.double()).float() + small
    return (a.double() @ b.double()).float()


def diagonal_blocks(L: torch.Tensor, method: str, precision: str) -> torch.Tensor:
    """(I + L_bb)^-1 of the four diagonal blocks, [4, SB, SB] fp32."""
    Ld = torch.stack([L[b * SB:(b + 1) * SB, b * SB:(b + 1) * SB] for b in range(C // SB)])
    eye = torch.eye(SB).expand(C // SB, SB, SB)
    if method == "series":
        D, P = eye - Ld, Ld
        for _ in range(3):
            P = product(P, P, precision)
            D = D + product(D, P, precision)
        return D
    a = torch.arange(SB)
    D = eye.clone()
    s = 1
    while s < SB:
        off = (a[:, None] // (2 * s) == a[None, :] // (2 * s)) & ((a[:, None] // s) % 2 == 1) & ((a[None, :] // s) % 2 == 0)
        D = D - product(product(D, torch.where(off, Ld, 0.0), precision), D, precision)
        s *= 2
    return D


def inverse(L: torch.Tensor, method: str, precision: str = "ieee", merges: str = "") -> torch.Tensor:
    """T = (I + L)^-1 [C, C] by blocks: diagonal blocks by ``method``, then T_ij = -D_i sum_m L_im T_mj (in
    ``merges`` precision, ``precision`` if not given)."""
    D = diagonal_blocks(L.float(), method, precision)
    precision = merges or precision
    blk = lambda x, i, j: x[i * SB:(i + 1) * SB, j * SB:(j + 1) * SB]  # noqa: E731
    T = torch.zeros(C, C)
    for i in range(C // SB):
        blk(T, i, i)[:] = D[i]
        for j in range(i - 1, -1, -1):
            acc = sum(product(blk(L.float(), i, m), blk(T, m, j), precision) for m in range(j, i))
            blk(T, i, j)[:] = -product(D[i], acc, precision)
    return T


def errors(k: torch.Tensor, beta: torch.Tensor, gen: torch.Generator) -> dict:
    L = torch.tril((k @ k.T) * beta[:, None], -1)
    exact = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + L)
    x = torch.randn(C, K, generator=gen, dtype=torch.float64)
    ref = exact @ x
    err = lambda T: ((T.double() @ x - ref).norm() / ref.norm()).item()  # noqa: E731
    return {"series": err(inverse(L, "series")), "doubling": err(inverse(L, "doubling")),
            "doubling tf32": err(inverse(L, "doubling", "tf32")),
            "doubling tf32x3": err(inverse(L, "doubling", "tf32x3")),
            "doubling bf16x3": err(inverse(L, "doubling", "bf16x3")),
            "merges tf32": err(inverse(L, "doubling", "ieee", "tf32")),
            "exact -> bf16": err(exact.to(torch.bfloat16))}


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    cases = [("random keys, beta U(0, 1)", F.normalize(rnd(C, K), dim=-1), torch.rand(C, generator=gen).double()),
             ("random keys, beta 2", F.normalize(rnd(C, K), dim=-1), torch.full((C,), 2.0, dtype=torch.float64))]
    for rank in (1, 2, 4):
        keys = F.normalize(rnd(C, rank) @ rnd(rank, K) + 0.05 * rnd(C, K), dim=-1)
        for beta in (1.0, 2.0):
            cases.append((f"rank-{rank} keys + 5% noise, beta {beta:g}", keys, torch.full((C,), beta, dtype=torch.float64)))
    names = list(errors(cases[0][1], cases[0][2], gen))
    print(f"{'keys, beta':36s}" + "".join(f"{n:>17s}" for n in names))
    for label, keys, beta in cases:
        e = errors(keys, beta, gen)
        print(f"{label:36s}" + "".join(f"{e[n]:17.1e}" for n in names))


if __name__ == "__main__":
    main()
