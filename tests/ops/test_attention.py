"""The attention ops against an explicit softmax in fp64 (outputs and gradients of q, k, v and
log_forget), windows, GQA, packed sequences, the decoding form and input validation."""

from __future__ import annotations

import logging
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from linmem.ops.attention import cached_attention, cumulative_forget, forgetting_attention
from tests.helpers import rel_err

B, H, D, DV = 2, 4, 8, 6


def naive(q, k, v, log_forget=None, window: Optional[int] = None, scale: Optional[float] = None):
    """softmax_j(scale q_i.k_j + c_i - c_j) over j <= i (and j > i - window), written out."""
    T, Hkv = q.shape[1], k.shape[2]
    k, v = (x.repeat_interleave(H // Hkv, dim=2) for x in (k, v))
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if log_forget is not None:
        c = torch.stack([log_forget[:, : t + 1].sum(1) for t in range(T)], dim=1)  # [B, T, H]
        scores = scores + c.permute(0, 2, 1)[..., :, None] - c.permute(0, 2, 1)[..., None, :]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (j <= i) & ((j > i - window) if window is not None else True)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("bhij,bjhd->bihd", weights, v)


def inputs(T: int, Hkv: int = H, forget: bool = True, batch: int = B, dtype=torch.float64, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = dict(q=rnd(batch, T, H, D), k=rnd(batch, T, Hkv, D), v=rnd(batch, T, Hkv, DV))
    x = {n: t.to(dtype) for n, t in x.items()}
    if forget:
        x["log_forget"] = F.logsigmoid(rnd(batch, T, H) + 1.0)
    return x


def with_grads(fn, tensors: dict, cotangent: Optional[torch.Tensor] = None, **kwargs):
    """fn(**tensors, **kwargs) and the gradients of <o, cotangent> (random by default)."""
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in tensors.items()}
    o = fn(**leaves, **kwargs)
    if cotangent is None:
        cotangent = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad((o * cotangent.to(o.dtype)).sum(), list(leaves.values()))
    return o.detach(), dict(zip(leaves, grads))


@pytest.mark.parametrize("forget", [True, False], ids=["forget", "plain"])
@pytest.mark.parametrize("window", [None, 1, 3])
@pytest.mark.parametrize("Hkv", [H, 2, 1], ids=lambda h: f"Hkv{h}")
@pytest.mark.parametrize("T", [1, 17])
def test_matches_naive_softmax_fp64(forget, window, Hkv, T):
    x = inputs(T, Hkv, forget)
    o, grads = with_grads(forgetting_attention, x, window=window)
    o_ref, grads_ref = with_grads(naive, x, window=window)
    assert rel_err(o, o_ref) < 1e-12
    for name in x:
        assert rel_err(grads[name], grads_ref[name]) < 1e-10, name


@pytest.mark.parametrize("window", [None, 4])
def test_fp32_within_tolerance(window):
    x = inputs(33, Hkv=2)
    o, grads = with_grads(forgetting_attention, {n: t.float() for n, t in x.items()}, window=window)
    o_ref, grads_ref = with_grads(naive, x, window=window)
    assert rel_err(o, o_ref) < 1e-5
    for name in x:
        assert rel_err(grads[name], grads_ref[name]) < 1e-4, name


def test_custom_scale():
    x = inputs(9)
    assert rel_err(forgetting_attention(**x, scale=0.3), naive(**x, scale=0.3)) < 1e-12


@pytest.mark.parametrize("forget", [True, False], ids=["forget", "plain"])
@pytest.mark.parametrize("window", [None, 3])
def test_varlen_equals_separate_sequences(window, forget, caplog):
    """Packed sequences attend within themselves; without a forget gate SDPA serves them (one sequence at a
    time: no [T, T] mask), windowed or not, an empty sequence included."""
    lengths = [5, 0, 1, 9, 4]
    x = inputs(sum(lengths), Hkv=2, batch=1, forget=forget)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    do = torch.randn(1, sum(lengths), H, DV, dtype=torch.float64)
    with caplog.at_level(logging.DEBUG, logger="linmem.ops"):
        o, grads = with_grads(forgetting_attention, x, do, window=window, cu_seqlens=cu)
    assert forget or "cannot serve" not in caplog.text, caplog.text
    for s in range(len(lengths)):
        piece = {n: t[:, cu[s] : cu[s + 1]] for n, t in x.items()}
        if not lengths[s]:
            continue
        o_ref, grads_ref = with_grads(naive, piece, do[:, cu[s] : cu[s + 1]], window=window)
        assert rel_err(o[:, cu[s] : cu[s + 1]], o_ref) < 1e-12, f"sequence {s}"
        for name in x:  # a one-token sequence has no log_forget gradient: compare it absolutely
            got, ref = grads[name][:, cu[s] : cu[s + 1]], grads_ref[name]
            err = rel_err(got, ref) if ref.abs().max() > 0 else float(got.abs().max())
            assert err < 1e-10, (s, name)


@pytest.mark.parametrize("window", [None, 5, 16, 40])
def test_sdpa_backend_matches_the_reference(window):
    """Without a forget gate the SDPA backend (one causal call, or O(T W) blocks of W queries under a shared band
    mask) is the reference: values and gradients, GQA, T not a multiple of the window."""
    x = inputs(37, Hkv=2, forget=False)
    o, grads = with_grads(forgetting_attention, x, window=window, backend="sdpa")
    o_ref, grads_ref = with_grads(forgetting_attention, x, window=window, backend="reference")
    assert rel_err(o, o_ref) < 1e-12
    for name in x:
        assert rel_err(grads[name], grads_ref[name]) < 1e-12, name


def test_sdpa_backend_hands_a_forget_gate_to_the_reference(caplog):
    x = inputs(9)
    with caplog.at_level(logging.DEBUG, logger="linmem.ops"):
        o = forgetting_attention(**x, backend="sdpa")
    assert "backend 'sdpa' cannot serve" in caplog.text and "forget gate" in caplog.text
    assert rel_err(o, naive(**x)) < 1e-12


def test_cumulative_forget_restarts_per_sequence():
    log_f = -torch.rand(1, 7, 3, generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 3, 7])
    c = cumulative_forget(log_f, cu_seqlens=cu)
    # the second sequence's sums are differences of the running sum: fp32 rounding of about 1e-7 absolute
    assert torch.allclose(c[:, :3], log_f[:, :3].cumsum(1), atol=1e-6)
    assert torch.allclose(c[:, 3:], log_f[:, 3:].cumsum(1), atol=1e-6)
    assert c.dtype == torch.float32


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("Tq", [1, 5])
def test_cached_attention_is_the_tail_of_the_full_pass(window, Tq):
    x = inputs(13, Hkv=2)
    c = cumulative_forget(x["log_forget"]) + 7.0  # a common offset cancels
    tail = cached_attention(x["q"][:, -Tq:], x["k"], x["v"], cum_forget=c, window=window)
    assert rel_err(tail, naive(**x, window=window)[:, -Tq:]) < 1e-12


def test_cached_attention_key_mask_drops_keys():
    x = inputs(11, Hkv=2, batch=1)
    present = torch.ones(1, 11, dtype=torch.bool)
    present[0, [0, 1, 4, 7]] = False
    c = cumulative_forget(x["log_forget"])
    o = cached_attention(x["q"][:, -2:], x["k"], x["v"], key_mask=present, cum_forget=c)
    kept = {n: t[:, present[0]] for n, t in x.items()}
    c_kept = c[:, present[0]]
    kept["log_forget"] = torch.diff(c_kept, dim=1, prepend=torch.zeros_like(c_kept[:, :1]))  # same c on kept keys
    assert rel_err(o, naive(**kept)[:, -2:]) < 1e-12


def test_fully_padded_rows_stay_finite():
    x = inputs(6, batch=2)
    present = torch.ones(2, 6, dtype=torch.bool)
    present[1] = False
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    c = cumulative_forget(leaves["log_forget"])
    o = cached_attention(leaves["q"], leaves["k"], leaves["v"], key_mask=present, cum_forget=c)
    o.square().sum().backward()
    assert torch.isfinite(o).all()
    assert all(torch.isfinite(t.grad).all() for t in leaves.values())
    assert rel_err(o[:1].detach(), naive(**{n: t[:1] for n, t in x.items()})) < 1e-12
    assert torch.equal(o[1].detach(), torch.zeros_like(o[1]))  # a query that sees no key gets zeros
    assert all(torch.equal(t.grad[1], torch.zeros_like(t.grad[1])) for t in (leaves["q"], leaves["k"], leaves["v"]))


def test_extreme_gates_stay_finite():
    T = 512
    x = inputs(T, forget=False, dtype=torch.float32)
    for log_f in (torch.full((B, T, H), -30.0), torch.full((B, T, H), -1e-7)):
        leaves = {n: t.clone().requires_grad_(True) for n, t in {**x, "log_forget": log_f}.items()}
        o = forgetting_attention(**leaves)
        o.sum().backward()
        assert torch.isfinite(o).all() and all(torch.isfinite(t.grad).all() for t in leaves.values())


def test_strong_forgetting_attends_to_the_current_token():
    x = inputs(10, forget=False)
    o = forgetting_attention(**x, log_forget=torch.full((B, 10, H), -200.0, dtype=torch.float64))
    assert rel_err(o, x["v"]) < 1e-12


def good(**over) -> dict:
    x = dict(q=torch.randn(B, 6, H, D), k=torch.randn(B, 6, 2, D), v=torch.randn(B, 6, 2, DV))
    x.update(over)
    return x


@pytest.mark.parametrize(
    "over, error, words",
    [
        (dict(k=torch.randn(B, 6, 2, D + 1)), ValueError, ["`k`", "[2, 6, 2, 8]", "[2, 6, 2, 9]"]),
        (dict(k=torch.randn(B, 5, 2, D)), ValueError, ["`k`", "[B, T, Hkv, D]"]),
        (dict(v=torch.randn(B, 6, 1, DV)), ValueError, ["`v`", "[2, 6, 2, 6]", "[2, 6, 1, 6]"]),
        (dict(k=torch.randn(B, 6, 3, D), v=torch.randn(B, 6, 3, DV)), ValueError, ["multiple", "Hkv = 3"]),
        (dict(q=torch.randn(B, 6, H * D)), ValueError, ["`q`", "4-D", "3-D"]),
        (dict(q=torch.zeros(B, 6, H, D, dtype=torch.int64)), TypeError, ["`q`", "floating", "int64"]),
        (dict(v=torch.randn(B, 6, 2, DV, dtype=torch.float64)), TypeError, ["share one dtype"]),
        (dict(log_forget=-torch.rand(B, 6, 2)), ValueError, ["`log_forget`", "[B, T, H]", "[2, 6, 4]", "[2, 6, 2]"]),
        (dict(log_forget=torch.rand(B, 6, H)), ValueError, ["`log_forget`", "<= 0"]),
        (dict(log_forget=torch.zeros(B, 6, H, dtype=torch.int32)), TypeError, ["`log_forget`", "floating"]),
        (dict(window=0), ValueError, ["`window`", ">= 1"]),
        (dict(window=2.0), TypeError, ["`window`", "int"]),
        (dict(scale="0.5"), TypeError, ["`scale`"]),
        (dict(scale=float("nan")), ValueError, ["`scale`", "finite", "nan"]),
        (dict(scale=float("inf")), ValueError, ["`scale`", "finite", "inf"]),
        (dict(scale=0.0), ValueError, ["`scale`", "> 0", "0.0"]),
        (dict(scale=-0.5), ValueError, ["`scale`", "> 0", "-0.5"]),
        (dict(backend="flash"), ValueError, ["`backend`", "'flash'", "triton"]),
        (dict(prune_tolerance=0.0), ValueError, ["`prune_tolerance`", "(0, 1)"]),
        (dict(prune_tolerance=1.5), ValueError, ["`prune_tolerance`", "1.5"]),
        (dict(prune_tolerance="1e-3"), TypeError, ["`prune_tolerance`", "float"]),
        (dict(cu_seqlens=torch.tensor([0, 3, 6])), ValueError, ["`cu_seqlens`", "B == 1"]),
        (dict(cu_seqlens=torch.tensor([0.0, 6.0])), TypeError, ["`cu_seqlens`", "int32 or int64"]),
    ],
    ids=lambda x: None,
)
def test_bad_inputs_raise_named_errors(over, error, words):
    with pytest.raises(error) as info:
        forgetting_attention(**good(**over))
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


@pytest.mark.parametrize("cu, words", [([1, 3, 6], ["start at 0"]), ([0, 4, 2, 6], ["non-decreasing"]),
                                       ([0, 3, 5], ["end at T = 6"]), ([[0, 6]], ["[N + 1]"])])
def test_bad_cu_seqlens(cu, words):
    x = good(q=torch.randn(1, 6, H, D), k=torch.randn(1, 6, 2, D), v=torch.randn(1, 6, 2, DV))
    with pytest.raises(ValueError) as info:
        forgetting_attention(**x, cu_seqlens=torch.tensor(cu))
    assert all(word in str(info.value) for word in words), str(info.value)


@pytest.mark.parametrize(
    "over, error, words",
    [
        (dict(q=torch.randn(B, 7, H, D)), ValueError, ["Tk >= Tq = 7", "Tk = 6"]),
        (dict(key_mask=torch.ones(B, 6)), TypeError, ["`key_mask`", "bool"]),
        (dict(key_mask=torch.ones(B, 5, dtype=torch.bool)), ValueError, ["`key_mask`", "[B, Tk]", "[2, 6]", "[2, 5]"]),
        (dict(cum_forget=torch.zeros(B, 1, H)), ValueError, ["`cum_forget`", "[2, 6, 4]"]),
        (dict(scale=float("nan")), ValueError, ["`scale`", "finite"]),
        (dict(backend=None), ValueError, ["`backend`", "None"]),
    ],
    ids=lambda x: None,
)
def test_cached_attention_bad_inputs(over, error, words):
    x = good(q=torch.randn(B, 1, H, D))
    x.update(over)
    with pytest.raises(error) as info:
        cached_attention(**x)
    assert all(word in str(info.value) for word in words), str(info.value)
    assert str(info.value).startswith("cached_attention:")
