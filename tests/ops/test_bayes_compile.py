"""The Bayesian filter's Triton path under ``torch.compile(fullgraph=True)``: a model of Bayesian layers traces as
one graph through the ``linmem::bayes_filter_*`` custom ops and gives the eager loss and gradients; the decoding
step mutates its state in place when compiled; every custom op's fake implementation gives the kernels' shapes and
dtypes. On a machine without CUDA the kernels run through the Triton interpreter at tiny shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import rel_err, triton_kernels_device

DEVICE = triton_kernels_device()

from linmem.models import LinmemConfig, LinmemForCausalLM  # noqa: E402
from linmem.ops import bayes_filter_step  # noqa: E402
from linmem.ops.bayes import ops  # noqa: E402


def recording(seen: set):
    """A dynamo backend that notes the linmem ops of each graph and runs it under AOTAutograd."""

    def backend(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if str(n.target).startswith("linmem."))
        return torch._dynamo.lookup_backend("aot_eager" if DEVICE == "cpu" else "inductor")(gm, example_inputs)

    return backend


def test_a_bayes_model_compiles_to_one_graph_and_equals_eager():
    torch.manual_seed(0)
    config = LinmemConfig(vocab_size=32, hidden_size=32, num_heads=2, layer_pattern="L", memory="bayes",
                          intermediate_size=32, recurrence_backend="triton")
    model = LinmemForCausalLM(config).to(DEVICE)
    ids = torch.randint(0, 32, (1, 6), device=DEVICE)
    seen: set = set()
    compiled = torch.compile(model, fullgraph=True, backend=recording(seen))  # a graph break raises
    results = []
    for fn in (compiled, model):
        model.zero_grad()
        loss = fn(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    for got, expected in zip(*results):
        assert rel_err(got, expected) < 1e-4  # inductor on CUDA reorders fp32 arithmetic
    assert {op for op in seen if "bayes" in op} == {"linmem.bayes_filter_fwd.default"}


def step_inputs(seed: int, B=2, H=1, K=16, V=16):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    A = r(B, H, K, K) / K ** 0.5
    state = (r(B, H, K, V), A @ A.transpose(-1, -2) + torch.eye(K, device=DEVICE))
    gates = dict(log_decay=-torch.rand(B, H, generator=gen).to(DEVICE), obs_noise=0.5 + r(B, H).abs(),
                 process_noise=0.1 * r(B, H).abs())
    return r(B, H, K), F.normalize(r(B, H, K), dim=-1), r(B, H, V), state, gates


def test_the_compiled_decoding_step_updates_the_state_in_place_as_eager():
    q, k, v, state, gates = step_inputs(1)

    def step(q, k, v, M, P):
        o, var, _ = bayes_filter_step(q, k, v, (M, P), **gates, return_variance=True, backend="triton")
        return o, var

    seen: set = set()
    compiled = torch.compile(step, fullgraph=True, backend=recording(seen))
    eager_state = tuple(x.clone() for x in state)
    with torch.no_grad():
        got, expected = compiled(q, k, v, *state), step(q, k, v, *eager_state)
    for a, b in zip((*got, *state), (*expected, *eager_state)):
        assert rel_err(a, b) < 1e-4
    assert seen == {"linmem.bayes_filter_step.default"}


def fake_checks():
    """(custom op, arguments) for every custom op of the filter, at tiny shapes: packed sequences with an initial
    state and the variance, and one fixed-length bf16 batch without them."""
    gen = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    H, K, V = 1, 16, 16
    packed = dict(q=r(1, 5, H, K), k=F.normalize(r(1, 5, H, K), dim=-1), v=r(1, 5, H, V),
                  g=-torch.rand(1, 5, H, generator=gen).to(DEVICE), r=0.5 + r(1, 5, H).abs(),
                  w=0.1 * r(1, 5, H).abs())
    cu = torch.tensor([0, 2, 5], device=DEVICE)
    M0, P0 = r(2, H, K, V), torch.eye(K, device=DEVICE).repeat(2, H, 1, 1)
    base = (*packed.values(), M0, P0, cu, 0.25, 1.0)
    _, _, _, PT, U, S, E, QPQ = ops.filter_fwd_op(*base, True, True, 16, 4)
    bf = lambda x: x.to(torch.bfloat16)  # noqa: E731
    q, k, v, g, rr, _ = packed.values()
    plain = (bf(q), bf(k), bf(v), g, rr, None, None, None, None, 0.25, 1.0, False, False, 16, 4)
    q1, k1, v1, state, gates = step_inputs(3, B=2, H=H, K=K, V=V)
    step = (q1[:, None], k1[:, None], v1[:, None], *(gates[n][:, None] for n in gates), *state, 0.25, 1.0, True, 16, 4)
    return [
        (ops.filter_fwd_op, (*base, True, True, 16, 4)),
        (ops.filter_fwd_op, plain),
        (ops.filter_bwd_op, (*packed.values(), M0, P0, cu, U, S, E, QPQ, PT, r(1, 5, H, V), r(1, 5, H), r(2, H, K, V),
                             r(2, H, K, K), 0.25, 1.0, 16, 4)),
        (ops.step_op, step),
    ]


@pytest.mark.parametrize("check", range(4))
def test_fake_outputs_match_the_kernels(check):
    op, args = fake_checks()[check]
    torch.library.opcheck(op, args, test_utils=("test_faketensor",))
