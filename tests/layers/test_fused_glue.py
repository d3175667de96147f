"""The layers' glue on the fused ops (:mod:`linmem.ops.fused`).

The short convolution has two forms, the fused op (CUDA) and a sum of taps in PyTorch (elsewhere): both
equal a depthwise causal ``F.conv1d``, continue a cache, decode in place, and under sequence parallelism
read the previous rank's halo in the first packed sequence only (the token shift too). The model's chunked
loss equals the loss of its logits, in fp32 and under bf16 autocast; a packed model compiles into one graph
that equals eager. On CUDA every mixer (fused kernels) equals its CPU form.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from linmem.layers import LayerState, MixerArgs, build_mixer, mixer_names
from linmem.layers import conv as conv_module
from linmem.layers.conv import ShortConvolution, token_shift
from linmem.layers.gla import gla_log_decay, gla_log_decay_derivative
from linmem.layers.hgrn2 import HGRN2
from linmem.layers import moe
from linmem.layers.moe import swiglu_down
from linmem.models import LinmemConfig, LinmemForCausalLM
from linmem.models.modeling import causal_lm_loss
from linmem.ops import parallel
from linmem.ops.gates import mamba2_log_decay, pointwise
from tests.helpers import rel_err, triton_kernels_device

C, W = 6, 4


def conv1d_reference(x: torch.Tensor, conv: ShortConvolution, history: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU of the depthwise causal F.conv1d of x [B, T, C] read after history [B, W-1, C] (zeros if None)."""
    past = history if history is not None else x.new_zeros(x.shape[0], W - 1, C)
    seen = torch.cat([past, x], dim=1).transpose(1, 2)  # [B, C, W - 1 + T]
    return F.silu(F.conv1d(seen, conv.weight[:, None], conv.bias, groups=C).transpose(1, 2))


@pytest.fixture(params=["taps", "fused op"])
def conv_form(request, monkeypatch) -> str:
    """Run ShortConvolution in one of its two forms (the fused op runs its PyTorch reference on a CPU)."""
    monkeypatch.setattr(conv_module, "fused_conv", lambda x: request.param == "fused op")
    return request.param


class Halo:
    """A sequence handler of a rank whose predecessor's piece ended with ``tokens`` [B, S, C]."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def halo(self, x: torch.Tensor, size: int, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        return self.tokens[:, self.tokens.shape[1] - size:]


def test_short_convolution_equals_conv1d_continues_its_cache_and_decodes_in_place(conv_form):
    torch.manual_seed(0)
    conv = ShortConvolution(C, W)
    with torch.no_grad():
        conv.bias.normal_()
    x = torch.randn(2, 9, C, requires_grad=True)
    y, ref = conv(x), conv1d_reference(x, conv)
    cotangent = torch.randn_like(y)
    leaves = (x, conv.weight, conv.bias)
    for got, want in zip(torch.autograd.grad(y, leaves, cotangent), torch.autograd.grad(ref, leaves, cotangent)):
        assert rel_err(got, want) < 1e-5
    assert rel_err(y.detach(), ref.detach()) < 1e-5

    with torch.no_grad():
        cache = LayerState()
        parts = [conv(x[:, :3], cache=cache), conv(x[:, 3:6], cache=cache)]  # a prefill in two pieces
        history = cache.get("conv")
        assert history.shape == (2, W - 1, C) and history.is_contiguous()
        parts += [conv(x[:, t:t + 1], cache=cache) for t in range(6, 9)]  # decoding steps
        assert cache.get("conv") is history, "a decoding step shifts the cached history in place"
        assert torch.equal(history, x[:, -(W - 1):])
    assert rel_err(torch.cat(parts, dim=1), ref.detach()) < 1e-5


def test_packed_sequences_read_the_halo_only_in_the_first_sequence(conv_form):
    torch.manual_seed(1)
    conv = ShortConvolution(C, W)
    x = torch.randn(1, 11, C, requires_grad=True)
    halo = torch.randn(1, W - 1, C, requires_grad=True)
    cu = torch.tensor([0, 2, 7, 11])
    with parallel.sequence_parallel(Halo(halo)):
        y = conv(x, cu_seqlens=cu)
        previous = token_shift(x, cu_seqlens=cu)
    pieces = [x[:, a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    ref = torch.cat([conv1d_reference(pieces[0], conv, halo)] + [conv1d_reference(p, conv) for p in pieces[1:]], 1)
    cotangent = torch.randn_like(y)
    leaves = (x, halo, conv.weight, conv.bias)
    for got, want in zip(torch.autograd.grad(y, leaves, cotangent), torch.autograd.grad(ref, leaves, cotangent)):
        assert rel_err(got, want) < 1e-5
    assert rel_err(y.detach(), ref.detach()) < 1e-5
    shifted = [torch.cat([start, p[:, :-1]], dim=1) for start, p in
               zip([halo[:, -1:]] + [torch.zeros(1, 1, C)] * 2, pieces)]
    assert torch.equal(previous, torch.cat(shifted, dim=1))


def saved_bytes(fn, *inputs) -> int:
    """Bytes of the tensors autograd keeps for fn's backward, besides the inputs themselves."""
    kept = {}
    known = {t.untyped_storage().data_ptr() for t in inputs}

    def pack(t):
        if t.untyped_storage().data_ptr() not in known:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(kept.values())


def test_gates_recompute_their_derivatives_from_their_input_alone():
    x = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    A_log, dt_bias = torch.randn(3, dtype=torch.float64, requires_grad=True), torch.randn(3, 4, dtype=torch.float64,
                                                                                           requires_grad=True)
    hgrn2 = HGRN2(MixerArgs(hidden_size=8, num_heads=2, layer_idx=1, num_layers=2))  # lower bound 0.5
    gates = {
        "gla": (lambda t: pointwise(t, gla_log_decay, gla_log_decay_derivative), (x,)),
        "mamba2": (mamba2_log_decay, (x, A_log, dt_bias)),
        "hgrn2": (lambda t: hgrn2.recurrence_inputs(t, cache=None, cu_seqlens=None).log_decay,
                  (torch.randn(1, 3, 8, dtype=torch.float64, requires_grad=True),)),
    }
    hgrn2.double()
    for name, (fn, inputs) in gates.items():
        assert torch.autograd.gradcheck(fn, inputs), name
    bf16 = x.detach().to(torch.bfloat16).requires_grad_(True)
    assert saved_bytes(lambda t: pointwise(t, gla_log_decay, gla_log_decay_derivative), bf16) == 0
    assert saved_bytes(mamba2_log_decay, bf16, A_log.float(), dt_bias.float()) == 0, "only the (bf16) inputs are kept"


def test_swiglu_down_recomputes_its_product_in_the_backward():
    torch.manual_seed(2)
    projected = torch.randn(2, 5, 16, requires_grad=True)  # [gate | up], one projection's output
    weight = torch.randn(6, 8, requires_grad=True)
    gate, up = projected.chunk(2, dim=-1)
    y, ref = swiglu_down(gate, up, weight), F.linear(F.silu(gate) * up, weight)
    cotangent = torch.randn_like(y)
    grads = zip(torch.autograd.grad(y, (projected, weight), cotangent),
                torch.autograd.grad(ref, (projected, weight), cotangent))
    assert max(rel_err(got, want) for got, want in grads) < 1e-6
    assert saved_bytes(lambda p, w: swiglu_down(*p.chunk(2, dim=-1), w), projected, weight) == 0



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_swiglu_down_through_the_kernels(dtype, monkeypatch):
    """``swiglu_down``'s backward on the SwiGLU kernels (which the CPU runs through the interpreter) gives the
    gradients of the plain expression, in fp64 on the same inputs."""
    device = triton_kernels_device()
    monkeypatch.setattr(moe, "swiglu", functools.partial(moe.swiglu, backend="triton"))
    monkeypatch.setattr(moe, "swiglu_grads", functools.partial(moe.swiglu_grads, backend="triton"))
    gen = torch.Generator().manual_seed(4)
    projected, weight = torch.randn(2, 5, 48, generator=gen), torch.randn(6, 24, generator=gen)
    cotangent = torch.randn(2, 5, 6, generator=gen)

    def grads(fn, cast):
        p, w = (t.to(device, cast).requires_grad_(True) for t in (projected, weight))
        y = fn(*p.chunk(2, dim=-1), w)
        return (y, *torch.autograd.grad(y, (p, w), cotangent.to(device, cast)))

    got = grads(swiglu_down, dtype)
    want = grads(lambda gate, up, w: F.linear(F.silu(gate) * up, w), torch.float64)
    assert [g.dtype for g in got] == [dtype] * 3
    assert max(rel_err(g, w) for g, w in zip(got, want)) < (1e-5 if dtype == torch.float32 else 1e-2)

def tiny_model(**fields) -> LinmemForCausalLM:
    torch.manual_seed(0)
    return LinmemForCausalLM(LinmemConfig(vocab_size=40, hidden_size=16, num_heads=2, **fields))


def test_chunked_loss_equals_the_loss_of_the_logits_with_its_gradients():
    model = tiny_model(layer_pattern="L", memory="gla")
    ids = torch.randint(0, 40, (1, 12))
    labels = ids.clone()
    labels[0, 6] = -100
    cu = torch.tensor([0, 4, 12])
    params = [p for p in model.parameters()]
    fused = model(ids, labels=labels, cu_seqlens=cu, use_cache=False)
    assert fused.logits is None, "with labels the logits are not computed unless asked for"
    full = model(ids, labels=labels, cu_seqlens=cu, use_cache=False, return_logits=True)
    reference = causal_lm_loss(full.logits, labels, cu)
    assert rel_err(fused.loss.detach(), reference.detach()) < 1e-6
    grads = zip(torch.autograd.grad(fused.loss, params), torch.autograd.grad(reference, params))
    assert max(rel_err(got, want) for got, want in grads) < 1e-4

    with torch.autocast("cpu", dtype=torch.bfloat16):  # the logits' matmuls in bf16, as the lm_head runs
        out = model(ids, labels=labels, cu_seqlens=cu, use_cache=False, return_logits=True)
    assert out.logits.dtype == torch.bfloat16
    assert rel_err(out.loss.detach(), causal_lm_loss(out.logits, labels, cu).detach()) < 5e-3
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in params)


def test_packed_model_compiles_into_one_graph_equal_to_eager():
    device = triton_kernels_device()
    model = tiny_model(layer_pattern="LN", memory="gated_deltanet", recurrence_backend="triton").to(device)
    ids = torch.randint(0, 40, (1, 10), device=device)
    cu = torch.tensor([0, 4, 10], device=device)
    params = [p for p in model.parameters()]
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break fails
    losses = [m(ids, labels=ids, cu_seqlens=cu, use_cache=False).loss for m in (compiled, model)]
    assert rel_err(losses[0].detach(), losses[1].detach()) < 1e-6
    grads = zip(torch.autograd.grad(losses[0], params), torch.autograd.grad(losses[1], params))
    assert max(rel_err(got, want) for got, want in grads) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("name", mixer_names())
def test_fused_kernels_on_cuda_equal_the_cpu_layer(name):
    """fp32 on both sides (tf32 inside the CUDA kernels); outputs, every gradient, and decoding on CUDA."""
    torch.manual_seed(0)
    layer = build_mixer(name, MixerArgs(hidden_size=64, num_heads=2, window=16, use_short_conv=True))
    with torch.no_grad():  # off the init, so that zero-initialised output projections pass a signal
        for p in layer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x = torch.randn(1, 40, 64)
    cu = torch.tensor([0, 17, 40])
    cotangent = torch.randn(1, 40, 64)
    results = []
    for device in ("cpu", "cuda"):
        layer.to(device)
        xd = x.to(device).requires_grad_(True)
        y = layer(xd, cu_seqlens=cu.to(device))
        grads = torch.autograd.grad(y, [xd, *layer.parameters()], cotangent.to(device), allow_unused=True)
        results.append([y.detach().cpu()] + [None if g is None else g.cpu() for g in grads])
    for cpu, cuda in zip(*results):
        if cpu is not None:
            assert rel_err(cuda, cpu) < 5e-3
    with torch.no_grad():
        xd = x.cuda()
        full = layer(xd)
        cache = LayerState()
        parts = [layer(xd[:, :30], cache=cache)] + [layer(xd[:, t:t + 1], cache=cache) for t in range(30, 40)]
    assert rel_err(torch.cat(parts, 1), full) < 1e-4
