"""Checks run on every rank: the sequence-parallel ops equal the one-process ops, outputs and gradients.

Every rank builds the same global inputs (one seed), runs the one-process op on all of them and
the sequence-parallel op on its piece, and compares its piece of the outputs, final states and
gradients; gradients of tensors every rank holds (a constant decay, the bonus, initial states)
are summed over the ranks first.
"""

from __future__ import annotations

import itertools
import zlib
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from linmem.distributed import shard_sequence, sp_attention, sp_halo, sp_linear_recurrence, split_packing
from linmem.layers.conv import causal_window
from linmem.ops import linear_recurrence
from linmem.ops.attention import forgetting_attention
from tests.helpers import make_inputs, max_float, rel_err

TOL = 1e-9  # fp64: the split run must agree to rounding
BF16_TOL = 5e-3  # bf16 activations (fp32 gates and states) against the fp32 one-process run
PER_TOKEN = ("q", "k", "v", "beta", "a", "b")


def _check(name: str, got: torch.Tensor, ref: torch.Tensor, case: str, tol: float = TOL) -> None:
    assert got.shape == ref.shape, f"{case}: {name} shape {list(got.shape)} vs {list(ref.shape)}"
    if ref.numel() == 0:
        return
    err = rel_err(got, ref) if ref.abs().max() > 0 else float((got - ref).abs().max())
    assert err < tol, f"{case}: {name} differs from the one-process run, error ratio {err:.2e}"


def _summed(grad: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    g = torch.zeros_like(like) if grad is None else grad.clone()
    dist.all_reduce(g)
    return g


def global_packing(world: int) -> tuple[int, list[int]]:
    """A packed row whose sequences cross rank boundaries, one spans a whole rank, one ends on a boundary."""
    if world == 2:
        return 16, [0, 5, 8, 13, 16]  # rank 1 starts a sequence; 3..: one crossing
    return 24, [0, 4, 17, 20, 24]  # 4..16 spans rank 1 entirely (6 tokens per rank)


def recurrence_case(kind: str, rule: str, bonus: bool, varlen: bool, dtype: torch.dtype = torch.float64) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    H, K, V = 2, 4, 3
    if varlen:
        T, bounds = global_packing(world)
        B, cu = 1, torch.tensor(bounds)
    else:
        B, T, cu = 2, 5 * world, None
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}{rule}{bonus}{varlen}".encode()))
    N = B if cu is None else len(bounds) - 1
    full = make_inputs(kind, rule, bonus, 1 if varlen else B, T, H, K, V, dtype=dtype, generator=gen,
                       initial_state=False)
    full["initial_state"] = torch.randn(N, H, K, V, generator=gen, dtype=torch.float64).to(max_float(dtype))
    w_out = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    w_state = torch.randn(N, H, K, V, generator=gen, dtype=torch.float64)
    case = f"{kind}/{rule}/bonus={bonus}/varlen={varlen}/world={world}/{dtype}"

    tol = TOL if dtype == torch.float64 else BF16_TOL  # bf16 pieces against the fp32 one-process run
    ref_in = {n: x.to(max_float(x.dtype)).clone().requires_grad_() for n, x in full.items()}
    o_ref, S_ref = linear_recurrence(**ref_in, output_final_state=True, cu_seqlens=cu, backend="chunk")
    ((o_ref * w_out).sum() + (S_ref * w_state).sum()).backward()

    L = T // world
    lo, hi = rank * L, (rank + 1) * L
    per_token = lambda n, x: n in PER_TOKEN or (n == "log_decay" and x.dim() >= 3)  # noqa: E731
    mine = {n: (x[:, lo:hi] if per_token(n, x) else x).clone().requires_grad_() for n, x in full.items()
            if n != "initial_state"}
    init = full["initial_state"].clone().requires_grad_()
    if varlen:
        local_cu, prefix = split_packing(cu, T, rank, world)
        starts = torch.tensor(bounds)
        seq_of = [int(torch.searchsorted(starts[1:], lo + s, right=True)) for s in local_cu[:-1].tolist()]
        ends_here = [lo + e in bounds for e in local_cu[1:].tolist()]
        kw = dict(cu_seqlens=local_cu, prefix_length=prefix)
    else:
        seq_of, ends_here, kw = list(range(B)), [rank == world - 1] * B, {}
    o, S = sp_linear_recurrence(**mine, group=group, initial_state=init[seq_of], output_final_state=True,
                                backend="chunk", **kw)
    done = torch.tensor(ends_here)
    loss = (o * w_out[:, lo:hi]).sum() + (S[done] * w_state[seq_of][done]).sum()
    loss.backward()

    _check("o", o, o_ref[:, lo:hi], case, tol)
    _check("final state", S[done], S_ref[seq_of][done], case, tol)
    for n, x in mine.items():
        if per_token(n, x):
            _check(f"d{n}", x.grad, ref_in[n].grad[:, lo:hi], case, tol)
        else:
            _check(f"d{n}", _summed(x.grad, x), ref_in[n].grad, case, tol)
    _check("d initial_state", _summed(init.grad, init), ref_in["initial_state"].grad, case, tol)


def recurrence_checks(kinds=("none", "constant", "scalar", "vector", "full")) -> None:
    """Every decay kind x rule, fixed-length and packed, plus the RWKV-6 bonus."""
    for kind, rule, varlen in itertools.product(kinds, ("additive", "delta", "dplr"), (False, True)):
        recurrence_case(kind, rule, False, varlen)
    for varlen in (False, True):
        recurrence_case("vector", "additive", True, varlen)
        recurrence_case("scalar", "delta", True, varlen)
        recurrence_case("scalar", "delta", False, varlen, torch.bfloat16)
        recurrence_case("vector", "additive", False, varlen, torch.bfloat16)


def attention_case(forget: bool, window: Optional[int], varlen: bool) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    H, Hkv, D = 4, 2, 4
    if varlen:
        T, bounds = global_packing(world)
        B, cu = 1, torch.tensor(bounds)
    else:
        B, T, cu = 2, 5 * world, None
    gen = torch.Generator().manual_seed(zlib.crc32(f"{forget}{window}{varlen}".encode()))
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    full = {"q": rnd(B, T, H, D), "k": rnd(B, T, Hkv, D), "v": rnd(B, T, Hkv, D)}
    if forget:
        full["log_forget"] = F.logsigmoid(rnd(B, T, H) + 2)
    w_out = rnd(B, T, H, D)
    case = f"attention forget={forget} window={window} varlen={varlen} world={world}"

    ref_in = {n: x.clone().requires_grad_() for n, x in full.items()}
    o_ref = forgetting_attention(**ref_in, window=window, cu_seqlens=cu)
    (o_ref * w_out).sum().backward()

    L = T // world
    lo, hi = rank * L, (rank + 1) * L
    mine = {n: x[:, lo:hi].clone().requires_grad_() for n, x in full.items()}
    kw = {}
    if varlen:
        local_cu, prefix = split_packing(cu, T, rank, world)
        kw = dict(cu_seqlens=local_cu, prefix_length=prefix)
    o = sp_attention(**mine, group=dist.group.WORLD, window=window, **kw)
    (o * w_out[:, lo:hi]).sum().backward()
    _check("o", o, o_ref[:, lo:hi], case)
    for n, x in mine.items():
        _check(f"d{n}", x.grad, ref_in[n].grad[:, lo:hi], case)


def attention_checks() -> None:
    """Softmax, sliding window (halo within one rank and reaching over several) and FoX, fixed and packed."""
    for forget, window, varlen in itertools.product((False, True), (None, 3, 9), (False, True)):
        attention_case(forget, window, varlen)


def halo_checks() -> None:
    """A short convolution's window built from the halo equals the one-process window (zeros at starts)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    size, C = 3, 5
    for varlen in (False, True):
        if varlen:
            T, bounds = global_packing(world)
            B, cu = 1, torch.tensor(bounds)
        else:
            B, T, cu = 2, 5 * world, None
        x = torch.randn(B, T, C, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        ref = causal_window(x, size + 1, cu_seqlens=cu)  # [B, T, size + 1, C]
        L = T // world
        lo, hi = rank * L, (rank + 1) * L
        piece = x[:, lo:hi].clone().requires_grad_()
        kw = {}
        if varlen:
            local_cu, prefix = split_packing(cu, T, rank, world)
            kw = dict(cu_seqlens=local_cu, prefix_length=prefix)
        halo = sp_halo(piece, dist.group.WORLD, size, **kw)
        seen = torch.cat([halo, piece], dim=1).unfold(1, size + 1, 1).movedim(-1, 2)  # [B, L, size + 1, C]
        if varlen:  # later local segments start fresh: mask what precedes their start
            window = causal_window(piece, size + 1, history=halo, cu_seqlens=local_cu)
            first = torch.arange(L) < local_cu[1]
            seen = torch.where(first[None, :, None, None], seen, window)
        _check("halo window", seen, ref[:, lo:hi], f"halo varlen={varlen}")
        weight = torch.randn(size + 1, C, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
        (seen * weight).sum().backward()
        xr = x.clone().requires_grad_()
        (causal_window(xr, size + 1, cu_seqlens=cu) * weight).sum().backward()
        _check("halo gradient", piece.grad, xr.grad[:, lo:hi], f"halo varlen={varlen}")


def shard_checks() -> None:
    """shard_sequence's pieces put back together are the batch, with global positions and shifted labels."""
    world, rank = dist.get_world_size(), dist.get_rank()
    T, bounds = global_packing(world)
    ids = torch.arange(T)[None]
    piece, layout = shard_sequence({"input_ids": ids, "labels": ids, "cu_seqlens": torch.tensor(bounds)}, rank, world)
    gathered = [torch.empty_like(piece["position_ids"]) for _ in range(world)]
    dist.all_gather(gathered, piece["position_ids"].contiguous())
    expect = torch.cat([torch.arange(e - s) for s, e in zip(bounds[:-1], bounds[1:])])
    assert torch.equal(torch.cat(gathered, 1)[0], expect), "positions are not the global ones"
    assert layout.prefix_length == int(piece["position_ids"][0, 0]), "prefix_length is the first token's position"


def argument_checks() -> None:
    """Bad arguments of the sequence-parallel ops are refused by name."""
    group, rank = dist.group.WORLD, dist.get_rank()
    q = torch.randn(1, 4, 1, 2)
    cases = [
        (lambda: sp_linear_recurrence(q, q, q, group=None), TypeError, "`group` must be a process group"),
        (lambda: sp_linear_recurrence(q, q, q, group=group, cu_seqlens=torch.tensor([0, 4])), ValueError,
         "`prefix_length`"),
        (lambda: sp_linear_recurrence(q, q, q, group=group, cu_seqlens=torch.tensor([0, 4]), prefix_length=99),
         ValueError, "exceeds"),
        (lambda: sp_halo(q, group, 5), ValueError, "size <= the local length"),
        (lambda: sp_attention(q, q, q, group=group, prefix_length=2), ValueError, "with `cu_seqlens`"),
    ]
    for call, error, words in cases:
        try:
            call()
        except error as caught:
            assert words in str(caught), f"rank {rank}: {caught}"
        else:
            raise AssertionError(f"rank {rank}: no {error.__name__} mentioning {words!r}")


def all_sequence_checks() -> None:
    shard_checks()
    halo_checks()
    recurrence_checks()
    attention_checks()
