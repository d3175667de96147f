"""Routing of tokens to groups (experts or memories): top-k choice, the (group, segment, time) sort,
the weighted scatter back, capacity, grouped GEMM, and the context rows of cached segments."""

from __future__ import annotations

import pytest
import torch

from linmem.ops.routing import (
    combine,
    dispatch,
    grouped_linear,
    limit_capacity,
    segment_context,
    segment_tails,
    top_k_routing,
)


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_top_k_routing_picks_the_largest_scores_and_renormalises(kind):
    torch.manual_seed(0)
    logits = torch.randn(20, 6)
    weights, groups, probs = top_k_routing(logits, 3, kind)
    scores = logits.softmax(-1) if kind == "softmax" else torch.sigmoid(logits)
    expected = scores.topk(3, dim=-1)
    assert torch.equal(groups, expected.indices)
    assert torch.allclose(weights, expected.values / expected.values.sum(-1, keepdim=True))
    assert torch.allclose(probs.sum(-1), torch.ones(20))


def test_top_k_routing_refuses_bad_arguments():
    with pytest.raises(ValueError, match="valid: softmax, sigmoid"):
        top_k_routing(torch.randn(2, 4), 1, "relu")
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        top_k_routing(torch.randn(2, 4), 5)


def test_dispatch_orders_by_group_then_segment_then_time():
    torch.manual_seed(0)
    N, S, G = 30, 3, 4
    groups = torch.stack([torch.randperm(G)[:2] for _ in range(N)])  # two distinct groups per token
    segments = torch.sort(torch.randint(0, S, (N,))).values
    keep = torch.rand(N, 2) > 0.2
    d = dispatch(groups, num_groups=G, segments=segments, num_segments=S, keep=keep)
    assert d.cu_seqlens.tolist()[-1] == int(keep.sum()) == d.token.numel()
    for g in range(G):
        for s in range(S):
            run = d.token[d.cu_seqlens[g * S + s]: d.cu_seqlens[g * S + s + 1]].tolist()
            expected = [n for n in range(N) if segments[n] == s and any(
                groups[n, j] == g and keep[n, j] for j in range(2))]
            assert run == expected, (g, s)
        assert int(d.group_sizes[g]) == int(((groups == g) & keep).sum())
    assert torch.equal(groups.reshape(-1)[d.slot], torch.repeat_interleave(torch.arange(G), d.group_sizes))


def test_combine_is_the_weighted_sum_over_each_tokens_slots():
    torch.manual_seed(0)
    x = torch.randn(7, 5)
    weights, groups, _ = top_k_routing(torch.randn(7, 3), 2)
    d = dispatch(groups, num_groups=3)
    scale = torch.tensor([1.0, 2.0, 3.0])
    y = combine(x[d.token] * scale[groups.reshape(-1)[d.slot], None], d, weights)  # group g scales by g + 1
    expected = (weights[..., None] * scale[groups][..., None] * x[:, None]).sum(1)
    assert torch.allclose(y, expected)


def test_limit_capacity_keeps_the_earliest_tokens_of_each_group():
    groups = torch.tensor([[0], [1], [0], [0], [1], [2]])
    d = limit_capacity(dispatch(groups, num_groups=3), 2)
    assert d.token.tolist() == [0, 2, 1, 4, 5]
    assert d.group_sizes.tolist() == [2, 2, 1] and d.cu_seqlens.tolist() == [0, 2, 4, 5]


def test_grouped_linear_loop_equals_a_matmul_per_row():
    torch.manual_seed(0)
    sizes = torch.tensor([3, 0, 5, 1])
    x, w = torch.randn(9, 6), torch.randn(4, 7, 6)
    group = torch.repeat_interleave(torch.arange(4), sizes)
    expected = torch.stack([w[g] @ row for g, row in zip(group, x)])
    assert torch.allclose(grouped_linear(x, w, sizes), expected, atol=1e-6)
    assert torch.allclose(grouped_linear(x, w, sizes, backend="loop"), expected, atol=1e-6)


def test_grouped_linear_refuses_bad_arguments_and_keeps_grouped_mm_off_the_cpu():
    x, w, sizes = torch.randn(4, 8), torch.randn(2, 8, 8), torch.tensor([2, 2])
    with pytest.raises(ValueError, match="valid: auto, grouped_mm, loop"):
        grouped_linear(x, w, sizes, backend="bmm")
    with pytest.raises(ValueError, match="CUDA"):
        grouped_linear(x.bfloat16(), w.bfloat16(), sizes, backend="grouped_mm")
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_linear(x, w, torch.tensor([4]))


def test_segment_context_puts_each_segments_tail_in_front_of_its_next_rows():
    torch.manual_seed(0)
    first_cu, second_cu, W = torch.tensor([0, 5, 6, 6]), torch.tensor([0, 2, 2, 5]), 3
    first, second = torch.randn(6, 4), torch.randn(5, 4)
    tails, lengths = segment_tails(first, first_cu, W)
    assert lengths.tolist() == [3, 1, 0]
    assert torch.equal(tails[0], first[2:5]) and torch.equal(tails[1, 2], first[5])
    assert not tails[1, :2].any() and not tails[2].any()
    packed, cu, index = segment_context(second, second_cu, tails, lengths)
    assert cu.tolist() == [0, 5, 6, 9] and torch.equal(packed[index], second)
    assert torch.equal(packed[:5], torch.cat([first[2:5], second[:2]]))
    assert torch.equal(packed[5], first[5]) and torch.equal(packed[6:], second[2:])
