"""``linmem bench layers``: the Linear-MoE system's layers and a whole model on one GPU.

* MoM layer (Gated DeltaNet memories, M = 4, top-2, shared memory) forward+backward
  against the single-memory Gated DeltaNet layer of the same width, and against
  flash-linear-attention's MoM layer when fla ships one;
* single memory mixers by name (``--parts mixers --mixers ttt,titans``) forward+backward, Titans
  with and without its momentum (the momentum runs ``linmem.ops.titans``' chunked PyTorch form);
  ``--mixers all`` is every memory mixer beside the attention baselines ``softmax`` and ``fox``, and
  ``--mixer-seq-lens 2048,4096,8192,16384`` sweeps the sequence length at a fixed number of tokens per
  step (``--tokens``): Linear-MoE's Table 3 sweep of training throughput over its LSM instances, per layer;
* the MoE feed-forward with grouped GEMM (``torch._grouped_mm``) against the
  per-expert loop, same weights;
* training tokens/s of a model recipe (default ``linear-moe-a0.3b-2b``) at sequence
  lengths 2K..16K with a fixed number of tokens per step;
* (part ``mixers``, not run by default) forward+backward of single mixer layers named by
  ``--mixers`` (default the Table-1 memories ``gfw,gateloop,mamba,s4`` beside ``gla`` and ``mamba2``),
  with thousand tokens/s and the peak memory of each.

Times are medians of CUDA-event-timed repeats after a warm-up; every row is printed as
one JSON line too, for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable, Optional

import torch

from . import BenchError
from ..layers import MixerArgs, build_mixer, mixer_class, mixer_names
from ..layers.moe import MoEArgs, MoEFeedForward
from ..layers.mom import MoMArgs
from ..models import LinmemForCausalLM, model_recipe


def cuda_time_ms(fn: Callable[[], object], *, warmup: int = 3, repeats: int = 10) -> float:
    """Median milliseconds of ``fn`` on the current CUDA stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _fwd_bwd(module: torch.nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = module(x)
        y.float().square().mean().backward()

    return step


def bench_mom(tokens: int, seq_len: int, hidden: int, heads: int) -> list[dict]:
    """MoM (4 memories, top-2, shared) vs one Gated DeltaNet memory, fwd+bwd."""
    x = torch.randn(tokens // seq_len, seq_len, hidden, device="cuda", requires_grad=True)
    base = dict(hidden_size=hidden, num_heads=heads)
    rows = []
    for name, mixer in [
        ("gated_deltanet (1 memory)", build_mixer("gated_deltanet", MixerArgs(**base))),
        ("mom gated_deltanet (4 memories, top-2, shared)",
         build_mixer("mom", MoMArgs(**base, mom_memory="gated_deltanet", num_memories=4, top_k=2,
                                    shared_memory=True))),
    ]:
        mixer = mixer.cuda()
        rows.append({"part": "mom", "name": name, "B": x.shape[0], "T": seq_len, "D": hidden,
                     "fwdbwd_ms": cuda_time_ms(_fwd_bwd(mixer, x))})
    rows.append(_fla_mom_row(x, hidden, heads))
    return rows


def _fla_mom_row(x: torch.Tensor, hidden: int, heads: int) -> dict:
    row = {"part": "mom", "name": "fla MomAttention (4 memories, top-2, shared)", "B": x.shape[0],
           "T": x.shape[1], "D": hidden}
    try:
        from fla.layers import MomAttention  # type: ignore[attr-defined]
    except ImportError as err:
        row["error"] = f"not available: {err}"
        return row
    try:
        layer = MomAttention(hidden_size=hidden, num_heads=heads, num_memories=4, topk=2,
                             shared_mem=True).cuda()
        row["fwdbwd_ms"] = cuda_time_ms(_fwd_bwd(lambda h: layer(h)[0], x))
    except Exception as err:  # a peer that fails is reported, not hidden
        row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
    return row


#: the options each bench row of a mixer is timed with besides its defaults (one row per entry)
MIXER_VARIANTS: dict[str, tuple[dict, ...]] = {"titans": ({}, {"momentum": True})}
#: the state sizes of the SSM papers (Mamba: N = 16 and an inner width of 2D; S4D: N = 64), per mixer
SSM_SHAPES = {"mamba": lambda hidden, heads: dict(head_dim=16, expand_v=2 * hidden / (heads * 16)),
              "s4": lambda hidden, heads: dict(head_dim=64)}


#: the attention mixers the part ``mixers`` times beside the memories (Linear-MoE Table 3's baseline, and FoX)
ATTENTION_BASELINES = ("softmax", "fox")


def benched_mixers(names: list[str]) -> list[str]:
    """``names`` with ``all`` expanded to every memory mixer and the :data:`ATTENTION_BASELINES`.

    Example:
        >>> benched_mixers(["gla", "softmax"])
        ['gla', 'softmax']
        >>> len(benched_mixers(["all"])) == len(mixer_names("memory")) + len(ATTENTION_BASELINES)
        True
    """
    every = [*mixer_names("memory"), *ATTENTION_BASELINES]
    return list(dict.fromkeys(n for name in names for n in (every if name == "all" else [name])))


def mixer_variants(names: list[str], hidden: int, heads: int) -> list[tuple[str, torch.nn.Module]]:
    """(label, mixer) of every memory mixer or attention baseline in ``names`` (``all``: every one, see
    :func:`benched_mixers`) and each of its :data:`MIXER_VARIANTS`, on the CPU; the SSMs at their papers' state
    sizes (:data:`SSM_SHAPES`).

    Example:
        >>> [label for label, _ in mixer_variants(["ttt", "titans"], 64, 2)]
        ['ttt', 'titans', 'titans momentum=True']
    """
    names = benched_mixers(names)
    valid = [*mixer_names("memory"), *ATTENTION_BASELINES]
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise BenchError(f"--mixers: unknown mixers {unknown}; valid: all, {', '.join(valid)}")
    rows = []
    for name in names:
        shape = SSM_SHAPES[name](hidden, heads) if name in SSM_SHAPES else {}
        for options in MIXER_VARIANTS.get(name, ({},)):
            label = " ".join([name, *(f"{k}={v}" for k, v in options.items())])
            args = mixer_class(name).args_class(hidden_size=hidden, num_heads=heads, **shape, **options)
            rows.append((label, build_mixer(name, args)))
    return rows


def bench_mixers(names: list[str], tokens: int, seq_lens: list[int], hidden: int, heads: int) -> list[dict]:
    """Forward+backward of single mixers (bf16 autocast), one row per :func:`mixer_variants` entry and sequence
    length, ``tokens // T`` sequences of each length T: milliseconds, thousand tokens/s and peak GB."""
    rows = []
    for label, mixer in mixer_variants(names, hidden, heads):
        mixer = mixer.cuda()
        for seq_len in seq_lens:
            row = {"part": "mixers", "name": label, "B": max(1, tokens // seq_len), "T": seq_len, "D": hidden,
                   "H": heads}
            try:
                x = torch.randn(row["B"], seq_len, hidden, device="cuda", requires_grad=True)
                torch.cuda.reset_peak_memory_stats()
                row["fwdbwd_ms"] = cuda_time_ms(_fwd_bwd(mixer, x))
                row["ktok_s"] = x.shape[0] * seq_len / row["fwdbwd_ms"]
                row["peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
            except Exception as err:  # a mixer that cannot run these shapes (memory) says so in its row
                row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            finally:
                x = None
                torch.cuda.empty_cache()
            rows.append(row)
        mixer.cpu()
    return rows


def bench_moe(tokens: int, hidden: int, experts: int, top_k: int, width: int) -> list[dict]:
    """Grouped GEMM vs per-expert loop for one MoE feed-forward, same weights, fwd+bwd."""
    x = torch.randn(1, tokens, hidden, device="cuda", requires_grad=True)
    torch.manual_seed(0)
    grouped = MoEFeedForward(MoEArgs(hidden_size=hidden, intermediate_size=width, num_experts=experts,
                                     num_experts_per_tok=top_k, expert_backend="grouped_mm")).cuda()
    loop = MoEFeedForward(MoEArgs(hidden_size=hidden, intermediate_size=width, num_experts=experts,
                                  num_experts_per_tok=top_k, expert_backend="loop")).cuda()
    loop.load_state_dict(grouped.state_dict())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        diff = (grouped(x) - loop(x)).float()
        ref = loop(x).float()
    rows = []
    for name, layer in (("moe grouped_mm", grouped), ("moe per-expert loop", loop)):
        rows.append({"part": "moe", "name": name, "tokens": tokens, "D": hidden, "E": experts, "k": top_k,
                     "F": width, "fwdbwd_ms": cuda_time_ms(_fwd_bwd(layer, x))})
    rows[0]["rel_err_vs_loop"] = float(diff.norm() / ref.norm())
    return rows


def bench_model(recipe: str, tokens_per_step: int, seq_lens: list[int]) -> list[dict]:
    """Training tokens/s (fwd + bwd + fused AdamW, bf16 autocast) of a recipe at several lengths."""
    torch.manual_seed(0)
    model = LinmemForCausalLM(model_recipe(recipe).build_config()).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for T in seq_lens:
        ids = torch.randint(0, model.config.vocab_size, (max(1, tokens_per_step // T), T), device="cuda")

        def step() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        torch.cuda.reset_peak_memory_stats()
        ms = cuda_time_ms(step, warmup=2, repeats=5)
        rows.append({"part": "train", "name": recipe, "params_M": params / 1e6, "B": ids.shape[0], "T": T,
                     "ktok_s": ids.numel() / ms, "peak_GB": torch.cuda.max_memory_allocated() / 1e9})
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``linmem bench layers``."""
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per step")
    parser.add_argument("--recipe", default="linear-moe-a0.3b-2b", help="model recipe of the tokens/s rows")
    parser.add_argument("--seq-lens", default="2048,4096,8192,16384", help="sequence lengths of the tokens/s rows")
    parser.add_argument("--parts", default="mom,moe,train", help="comma list of mom, moe, train, mixers")
    parser.add_argument("--mixers", default="gla,mamba2,gfw,gateloop,mamba,s4,gated_deltanet,ttt,titans",
                        help="memory mixers of the part 'mixers' (one layer each, D 1024, 8 heads); 'all': every "
                             f"memory mixer and the attention baselines {', '.join(ATTENTION_BASELINES)}")
    parser.add_argument("--mixer-seq-lens", default="2048",
                        help="sequence lengths of the part 'mixers', each at --tokens tokens per step")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="linmem bench layers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Time the parts asked for and print JSON lines and a table."""
    if not torch.cuda.is_available():
        raise BenchError("linmem bench layers times CUDA kernels: no CUDA device found")
    parts = set(args.parts.split(","))
    rows: list[dict] = []
    if "mom" in parts:
        rows += bench_mom(args.tokens, 2048, hidden=1024, heads=4)
    if "mixers" in parts:
        rows += bench_mixers(args.mixers.split(","), args.tokens, [int(t) for t in args.mixer_seq_lens.split(",")],
                             hidden=1024, heads=8)
    if "moe" in parts:
        rows += bench_moe(args.tokens, hidden=1024, experts=64, top_k=8, width=896)
    if "train" in parts:
        rows += bench_model(args.recipe, args.tokens, [int(t) for t in args.seq_lens.split(",")])
    for row in rows:
        print(json.dumps(row))
    print(f"\n{'part':<6}{'name':<50}{'shape':<22}{'result':>26}")
    for row in rows:
        shape = f"B={row['B']}, T={row['T']}" if "B" in row and "T" in row else f"T={row.get('T', row.get('tokens'))}"
        result = (f"{row['fwdbwd_ms']:.2f} ms, {row['ktok_s']:.0f} ktok/s" if {"ktok_s", "fwdbwd_ms"} <= set(row) else
                  f"{row['ktok_s']:.1f} ktok/s" if "ktok_s" in row else
                  f"{row['fwdbwd_ms']:.2f} ms" if "fwdbwd_ms" in row else row.get("error", "")[:40])
        print(f"{row['part']:<6}{row['name'][:49]:<50}{shape:<22}{result:>26}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
