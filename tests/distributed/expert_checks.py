"""Checks run on every rank: an expert-parallel MoE layer equals the one-process layer on the global batch.

The global batch is the ranks' batches stacked; the one-process objective is the data-parallel
mean ``J = mean_r sum(y_r * g_r) + balance + z-loss`` (the routing losses over the global batch).
Each rank backpropagates ``J_r = sum(y_r * g_r) + balance + z-loss``; the mean of the ranks'
gradients (what data parallelism takes) must be the one-process gradient, for the router and the
shared expert (replicated), the experts (summed over the ranks that hold them) and the inputs.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from linmem.distributed import expert_parallel
from linmem.layers.moe import MoEArgs, MoEFeedForward
from tests.helpers import rel_err

TOL = 1e-6  # the router runs in fp32


def _close(name: str, got: torch.Tensor, ref: torch.Tensor, case: str) -> None:
    assert got.shape == ref.shape, f"{case}: {name} shape {list(got.shape)} vs {list(ref.shape)}"
    err = rel_err(got, ref)
    assert err < TOL, f"{case}: {name} differs from the one-process layer, error ratio {err:.2e}"


def expert_case(ep: int, router: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    case = f"ep={ep}/world={world}/router={router}"
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("edp", "ep"))
    torch.manual_seed(0)
    args = MoEArgs(hidden_size=8, intermediate_size=12, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
                   router=router, expert_backend="loop")
    reference = MoEFeedForward(args).double()
    layer = expert_parallel(copy.deepcopy(reference), mesh["ep"] if ep > 1 else None, dist.group.WORLD)
    B, T = 2, 5
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(world * B, T, 8, generator=gen, dtype=torch.float64)
    g = torch.randn(world * B, T, 8, generator=gen, dtype=torch.float64)
    mask = torch.rand(world * B, T, generator=gen) > 0.2  # some padding: routed nowhere, out of the statistics

    xr = x.clone().requires_grad_()
    y_ref = reference(xr, mask)
    stats_ref = reference.router_stats
    ((y_ref * g).sum() / world + stats_ref.balance_loss + stats_ref.z_loss).backward()

    mine = slice(rank * B, (rank + 1) * B)
    xl = x[mine].clone().requires_grad_()
    y = layer(xl, mask[mine])
    stats = layer.router_stats
    ((y * g[mine]).sum() + stats.balance_loss + stats.z_loss).backward()

    _close("output", y, y_ref[mine], case)
    for name in ("balance_loss", "z_loss", "load"):
        _close(name, getattr(stats, name), getattr(stats_ref, name), case)
    _close("input gradient", xl.grad / world, xr.grad[mine], case)
    for name, p in layer.named_parameters():
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad.clone()
        ref = dict(reference.named_parameters())[name].grad
        if name in ("gate_up", "down") and ep > 1:
            dist.all_reduce(grad, group=mesh["edp"].get_group())  # the replicas of these experts
            per_rank = ref.shape[0] // ep
            ref = ref[mesh["ep"].get_local_rank() * per_rank:][:per_rank]
        else:
            dist.all_reduce(grad)
        _close(f"d{name}", grad / world, ref, case)


def all_expert_checks() -> None:
    world = dist.get_world_size()
    expert_case(world, "softmax")
    expert_case(1, "sigmoid")  # experts on every rank: global statistics only
    if world == 4:
        expert_case(2, "softmax")
