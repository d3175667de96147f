"""The Bayesian memory layer beyond the invariants every mixer keeps (decoding, varlen, padding, autocast,
save/load and gradients to every parameter: tests/layers/test_mixers.py, test_autocast.py, test_mom.py and
tests/models/test_model.py run them for ``bayes`` as for every registered mixer): with its covariance reset it is
Gated DeltaNet with the same weights; the noise parameters learn; extreme gates stay finite; the conv-free layer
decodes; the fused kernels, sequential and chunked (through the Triton interpreter on CPU), equal the token loop;
the chunked kernels' layer decodes with the step kernel; MoM carries the covariance; a backend the layer cannot run
is refused by name."""

from __future__ import annotations

import pytest
import torch

from linmem.layers import LayerState, MixerArgs, build_mixer
from linmem.layers.mom import MoMArgs
from linmem.ops import bayes_filter
from tests.helpers import rel_err, triton_kernels_device

D, H = 32, 2


def make(**over) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_mixer("bayes", MixerArgs(hidden_size=D, num_heads=H, **over))


def test_with_the_covariance_reset_the_layer_is_gated_deltanet_with_the_same_weights():
    layer = make().double()
    gdn = build_mixer("gated_deltanet", MixerArgs(hidden_size=D, num_heads=H)).double()
    names = {"convs.q": "q_conv", "convs.k": "k_conv", "convs.v": "v_conv"}
    weights = {}
    for name, value in layer.state_dict().items():
        prefix = name.rsplit(".", 1)[0]
        weights[name.replace(prefix, names[prefix]) if prefix in names else name] = value
    for name in ("obs_noise_raw", "process_noise_raw"):
        weights.pop(name)
    gdn.load_state_dict(weights)
    x = torch.randn(2, 9, D, dtype=torch.float64)
    with torch.no_grad():
        args = layer.recurrence_inputs(x, cache=None, cu_seqlens=None)
        o, _, _ = bayes_filter(args.q, args.k, args.v, log_decay=args.log_decay, obs_noise=args.obs_noise, reset=True)
        # the gates are computed in fp32 by both layers (r_h = softplus(softplus^-1(1)) is 1 up to fp32 rounding)
        assert rel_err(layer.output(o, x, args), gdn(x)) < 1e-5


def test_the_noise_parameters_learn():
    layer = make()
    layer(torch.randn(2, 9, D)).square().mean().backward()
    for p in (layer.obs_noise_raw, layer.process_noise_raw):
        assert torch.isfinite(p.grad).all() and bool((p.grad != 0).all())


def test_extreme_gates_stay_finite():
    layer = make()
    with torch.no_grad():
        layer.b_proj.weight.mul_(1e4)  # r_t at both ends of its clamp
        layer.a_proj.weight.mul_(1e4)  # decays from 1 to 0
        layer.dt_bias.fill_(-30.0)
    x = torch.randn(2, 12, D, requires_grad=True)
    y = layer(x)
    y.square().mean().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


def test_the_conv_free_layer_decodes_as_it_runs():
    layer = make(use_short_conv=False).eval()
    assert not any("conv" in name for name, _ in layer.named_parameters())
    x = torch.randn(1, 8, D)
    with torch.no_grad():
        full = layer(x)
        cache = LayerState()
        parts = [layer(x[:, :3], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in range(3, 8)]
    assert rel_err(torch.cat(parts, 1), full) < 1e-5


def test_the_fused_kernels_equal_the_token_loop():
    device = triton_kernels_device()
    x = torch.randn(1, 7, D, device=device)
    cu = torch.tensor([0, 3, 7], device=device)
    results = []
    for backend in ("triton", "chunk_triton", "reference"):
        layer = make(backend=backend).to(device)
        leaf = x.clone().requires_grad_(True)
        y = layer(leaf, cu_seqlens=cu)
        y.square().sum().backward()
        noise = (layer.obs_noise_raw, layer.process_noise_raw, layer.A_log)
        results.append([y.detach(), leaf.grad, *(p.grad for p in noise)])
    for run in results[:2]:
        for got, expected in zip(run, results[2]):
            assert rel_err(got, expected) < 1e-4


def test_the_chunked_kernels_layer_decodes_with_the_step_kernel():
    device = triton_kernels_device()
    layer = make(backend="chunk_triton").to(device).eval()
    x = torch.randn(1, 6, D, device=device)
    with torch.no_grad():
        full = make(backend="reference").to(device).eval()(x)
        cache = LayerState()
        parts = [layer(x[:, :4], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in range(4, 6)]
    assert rel_err(torch.cat(parts, 1), full) < 1e-5


def test_mom_keeps_a_covariance_per_sequence_and_memory_from_the_prior():
    mom = build_mixer("mom", MoMArgs(hidden_size=D, num_heads=H, mom_memory="bayes", num_memories=3, top_k=1)).eval()
    cache = LayerState()
    with torch.no_grad():
        mom(torch.randn(2, 1, D), cache=cache)
    P = cache.get("covariance")  # [B, M + shared, H, K, K]
    assert P.shape == (2, 4, H, D // H, D // H)
    routed = mom.router_stats.logits.argmax(-1)  # [B]: the one memory of each row
    eye = torch.eye(D // H)
    for b in range(2):
        for m in range(4):
            written = m == int(routed[b]) or m == 3
            assert torch.equal(P[b, m], eye.expand_as(P[b, m])) != written, f"row {b}, memory {m}"


def test_a_backend_the_layer_cannot_run_is_refused_by_name():
    with pytest.raises(ValueError, match="backend.*'chunk'.*auto, reference, triton"):
        make(backend="chunk")
