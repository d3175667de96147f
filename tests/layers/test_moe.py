"""The MoE feed-forward: one chosen expert is that expert's dense SwiGLU, the sorted grouped computation
equals a naive per-token sum, capacity drops the latest tokens, and the balancing losses follow their
formulas. The grouped GEMM of the GPU (torch._grouped_mm) is checked against the loop on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linmem.layers.moe import MoEArgs, MoEFeedForward, SwiGLU

D, FW = 16, 24


def make(**over) -> MoEFeedForward:
    torch.manual_seed(0)
    return MoEFeedForward(MoEArgs(hidden_size=D, intermediate_size=FW, init_std=0.2, **over))


def naive(moe: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Token by token: sum over the top-k experts of weight * SwiGLU_e(x), plus the shared experts."""
    flat = x.reshape(-1, D)
    logits = flat @ moe.router.weight.T
    scores = logits.softmax(-1) if moe.args.router == "softmax" else torch.sigmoid(logits)
    out = []
    for n, row in enumerate(flat):
        top = scores[n].topk(moe.args.num_experts_per_tok)
        y = torch.zeros(D)
        for w, e in zip(top.values / top.values.sum(), top.indices):
            gate, up = (moe.gate_up[e] @ row).chunk(2)
            y = y + w * (moe.down[e] @ (F.silu(gate) * up))
        out.append(y if moe.shared is None else y + moe.shared(row))
    return torch.stack(out).view_as(x)


def test_router_sending_every_token_to_one_expert_equals_that_experts_dense_swiglu():
    moe = make(num_experts=4, num_experts_per_tok=1)
    x = torch.randn(2, 9, D)
    x[..., 0] = x[..., 0].abs() + 0.1  # the router reads channel 0, positive everywhere
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2, 0] = 50.0
        dense = SwiGLU(D, FW, std=0.02)
        dense.gate_up.weight.copy_(moe.gate_up[2])
        dense.down.weight.copy_(moe.down[2])
        y = moe(x)
    assert moe.router_stats.load.tolist() == [0.0, 0.0, 1.0, 0.0]
    torch.testing.assert_close(y, dense(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("router,shared", [("softmax", 0), ("sigmoid", 2)])
def test_sorted_grouped_experts_equal_a_naive_per_token_sum(router, shared):
    moe = make(num_experts=5, num_experts_per_tok=2, router=router, num_shared_experts=shared)
    x = torch.randn(3, 7, D)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), naive(moe, x), rtol=1e-5, atol=1e-6)


def test_capacity_drops_the_latest_tokens_of_an_overfull_expert():
    x = torch.randn(1, 12, D)
    dropless, capped, huge = make(num_experts=3, num_experts_per_tok=1), \
        make(num_experts=3, num_experts_per_tok=1, capacity_factor=0.75), \
        make(num_experts=3, num_experts_per_tok=1, capacity_factor=100.0)
    with torch.no_grad():
        full, y = dropless(x), capped(x)
        assert torch.equal(huge(x), full)
    capacity = 3  # ceil(0.75 * 12 * 1 / 3)
    expert = (x[0] @ capped.router.weight.T).argmax(-1)
    assert int(torch.bincount(expert).max()) > capacity  # some expert overflows
    for n in range(12):
        earlier = int((expert[:n] == expert[n]).sum())
        if earlier < capacity:
            torch.testing.assert_close(y[0, n], full[0, n])
        else:
            assert not y[0, n].any(), f"token {n} should have been dropped"


def test_balancing_and_z_losses_match_their_formulas_over_real_tokens():
    moe = make(num_experts=4, num_experts_per_tok=2)
    x = torch.randn(2, 8, D)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, :3] = False
    moe(x, token_mask=mask)
    logits = x.reshape(-1, D)[mask.reshape(-1)] @ moe.router.weight.T  # [13, 4]
    probs = logits.softmax(-1)
    chosen = probs.topk(2, dim=-1).indices
    f = torch.stack([(chosen == e).any(-1).float().mean() for e in range(4)])  # fraction of tokens choosing e
    balance = 4 * (f * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).pow(2).mean()
    stats = moe.router_stats
    torch.testing.assert_close(stats.balance_loss, balance)
    torch.testing.assert_close(stats.z_loss, z)
    torch.testing.assert_close(stats.load, f)
    assert stats.logits.shape == (16, 4)


def test_inactive_parameters_are_the_unchosen_experts():
    moe = make(num_experts=6, num_experts_per_tok=2)
    assert moe.inactive_parameter_count() == 4 * 3 * D * FW


def test_bad_arguments_name_the_valid_choices():
    with pytest.raises(ValueError, match="`num_experts_per_tok` = 5"):
        make(num_experts=4, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="valid: softmax, sigmoid"):
        make(router="relu")
    with pytest.raises(ValueError, match="`capacity_factor` must be a finite number > 0"):
        make(capacity_factor=0.0)


@pytest.mark.gpu
def test_grouped_mm_equals_the_loop_on_gpu(monkeypatch):
    from linmem.ops.routing import grouped_mm_applies

    torch.manual_seed(0)
    device = torch.device("cuda")
    args = dict(hidden_size=64, intermediate_size=128, num_experts=8, num_experts_per_tok=2, num_shared_experts=1)
    grouped = MoEFeedForward(MoEArgs(**args, expert_backend="grouped_mm")).to(device, torch.bfloat16)
    loop = MoEFeedForward(MoEArgs(**args, expert_backend="loop")).to(device, torch.bfloat16)
    loop.load_state_dict(grouped.state_dict())
    x = torch.randn(4, 256, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    if not grouped_mm_applies(x[0], grouped.gate_up):
        pytest.skip("torch._grouped_mm needs a GPU of compute capability >= 9.0 and a torch that has it")
    calls = []
    original = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or original(*a, **k))
    results = []
    for moe in (grouped, loop):
        y = moe(x)
        y.float().square().sum().backward()
        results.append((y.detach().float(), x.grad.float(), moe.gate_up.grad.float(), moe.down.grad.float()))
        x.grad = None
    assert len(calls) == 2  # gate_up and down of the grouped module, none for the loop
    for a, b in zip(*results):
        assert float((a - b).norm() / b.norm()) < 1e-2
