"""torch.compile of the chunk backend with packed sequences: one graph (no breaks), the same
outputs and gradients as eager, and no accumulating scatter in the graphs (what inductor's CPU
backend miscompiles, see dev/upstream/inductor_tile2d_atomic_add.py)."""

from __future__ import annotations

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from linmem.ops import linear_recurrence
from tests.helpers import make_inputs


def packed_gated_delta():
    t = make_inputs("scalar", "delta", False, B=1, T=20, H=1, K=4, V=4, generator=torch.Generator().manual_seed(0),
                    initial_state=False)
    t["initial_state"] = torch.randn(3, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    t["cu_seqlens"] = torch.tensor([0, 7, 7, 20])  # an empty sequence in the middle
    return t


def recording_backend(graphs: list):
    """AOTAutograd, running the forward and backward graphs as they are and keeping them."""

    def keep(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


def run(fn, t: dict):
    leaves = {n: (x.detach().clone().requires_grad_(True) if x.is_floating_point() else x) for n, x in t.items()}
    o, S = fn(**leaves)
    loss = (o * torch.cos(o)).sum() + S.square().sum()
    grads = torch.autograd.grad(loss, [x for x in leaves.values() if x.requires_grad])
    return (o, S, *grads)


def test_compiled_packed_recurrence_is_one_graph_and_equals_eager():
    t = packed_gated_delta()

    def f(**x):
        return linear_recurrence(**x, output_final_state=True, backend="chunk")

    graphs: list = []
    compiled = torch.compile(f, fullgraph=True, backend=recording_backend(graphs))  # a graph break raises
    for got, expected in zip(run(compiled, t), run(f, t)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert len(graphs) == 2, "one forward and one backward graph"
    for gm in graphs:
        for node in gm.graph.nodes:
            assert not accumulating_scatter(node), node.format_node()


def accumulating_scatter(node: torch.fx.Node) -> bool:
    name = str(node.target)
    if "index_put" in name:
        return bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False))
    return any(op in name for op in ("index_add", "scatter_add", "scatter_reduce"))
