"""GPU check of the mixers and the model features: every registered mixer (KDA, the FoX gate variants and
the Pro options on softmax / swa included) in bf16 autocast against its fp32 forward and gradients, decoding
against the forward; then a 340M-class model's training step with and without activation checkpointing
(loss, gradients, peak memory, time) and its generate() cache reuse. Writes ``$OUT/check_layers.log``.

Run from the repository root on a CUDA machine: ``python dev/gpu/tools/check_layers.py``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from linmem.layers import LayerState, MixerArgs, build_mixer, mixer_names
from linmem.models import LinmemForCausalLM, model_recipe

OUT = Path(os.environ.get("OUT", "."))
LOG = OUT / "check_layers.log"
PRO = dict(qk_norm=True, output_gate=True, output_norm=True, kv_shift=True)
CASES = [(name, {}) for name in mixer_names()]
CASES += [("fox", {"forget_gate": "data_independent"}), ("fox", {"forget_gate": "fixed", **PRO}),
          ("softmax", PRO), ("swa", PRO)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """rms(a - b) / rms(b)."""
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def log(line: str) -> None:
    print(line, flush=True)
    with LOG.open("a") as f:
        f.write(line + "\n")


def check_mixer(name: str, over: dict) -> bool:
    torch.manual_seed(0)
    window = 256 if name == "swa" else None
    m = build_mixer(name, MixerArgs(hidden_size=512, num_heads=4, head_dim=128, window=window, **over)).cuda()
    with torch.no_grad():  # off the init, so that zero-initialised output projections (RWKV) pass a signal
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x = torch.randn(2, 1024, 512, device="cuda", requires_grad=True)
    probe = torch.randn(2, 1024, 512, device="cuda")  # a loss whose gradient is not the output itself

    def grads_of(out: torch.Tensor) -> torch.Tensor:
        x.grad = None
        m.zero_grad()
        (out.float() * probe).mean().backward()
        return torch.cat([g.flatten() for g in (x.grad, *(p.grad for p in m.parameters())) if g is not None])

    ref = m(x)
    ref_grads = grads_of(ref)
    ref = ref.detach()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = m(x)
    grad_err = rel(grads_of(out), ref_grads)
    out = out.detach()
    with torch.no_grad():
        xs = x.detach()[:, :300]
        full = m(xs)
        cache = LayerState()
        parts = [m(xs[:, :200], cache=cache)] + [m(xs[:, t:t + 1], cache=cache) for t in range(200, 300)]
        decode_err = rel(torch.cat(parts, 1), full)
    ok = rel(out.float(), ref) < 2e-2 and grad_err < 5e-2 and decode_err < 1e-4
    log(f"{name:16s} {str(over):60s} bf16 out {rel(out.float(), ref):.2e} grads {grad_err:.2e} "
        f"decode {decode_err:.2e} {'ok' if ok else 'FAIL'}")
    return ok


def train_step(model: LinmemForCausalLM, ids: torch.Tensor) -> tuple[float, list[torch.Tensor], float, float]:
    model.zero_grad()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    torch.cuda.synchronize()
    return (loss.item(), [p.grad.float() for p in model.parameters()], time.perf_counter() - start,
            torch.cuda.max_memory_allocated() / 2 ** 30)


def check_model() -> bool:
    ids = torch.randint(0, 32000, (4, 2048), device="cuda")
    results = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        config = model_recipe("hybrid-gdn-340m").build_config(activation_checkpointing=checkpointing)
        model = LinmemForCausalLM(config).cuda().train()
        train_step(model, ids)  # warm-up
        results[checkpointing] = train_step(model, ids)
        loss, _, seconds, peak = results[checkpointing]
        log(f"hybrid-gdn-340m 4 x 2048 activation_checkpointing={checkpointing}: loss {loss:.5f}, "
            f"{seconds * 1e3:.0f} ms fwd+bwd, peak {peak:.2f} GiB")
        del model
    grad_err = max(rel(a, b) for a, b in zip(results[True][1], results[False][1]) if b.abs().sum() > 0)
    ok = abs(results[True][0] - results[False][0]) < 1e-3 and grad_err < 5e-2 and results[True][3] < results[False][3]
    log(f"checkpointing vs not: grads {grad_err:.2e}, peak {results[True][3]:.2f} vs {results[False][3]:.2f} GiB "
        f"{'ok' if ok else 'FAIL'}")
    torch.manual_seed(0)
    model = LinmemForCausalLM(model_recipe("hybrid-gdn-340m").build_config()).cuda().eval()
    lengths = []
    forward = model.model.forward
    model.model.forward = lambda *a, **k: lengths.append(k["input_ids"].shape[1]) or forward(*a, **k)
    model.generate(ids[:1, :64], max_new_tokens=16, do_sample=False, pad_token_id=0)
    cached = lengths == [64] + [1] * 15
    log(f"generate() forwards {lengths[:3]}... {'ok' if cached else 'FAIL'} (one token per step after the prompt)")
    return ok and cached


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    ok = all([check_mixer(name, over) for name, over in CASES])
    ok = check_model() and ok
    log("ALL OK" if ok else "FAILURES")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
