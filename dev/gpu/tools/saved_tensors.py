"""What a model keeps for its backward, module by module, linmem's beside its peer of the same shape.

One forward pass of a model of ``linmem.bench.peers`` (the bench's ~370M shape by default) runs under
``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves is attributed to the innermost module
running when it was saved (a stack of forward pre/post hooks), and counted once per storage (a tensor saved
twice, or two views of one buffer, are one allocation). The table gives, per module path of block 0 (the first
layer; every block of a stack keeps the same) and for the stack's top (embedding, final norm, head), the MB kept
and the tensors (shape, dtype) of the largest entries, so that what linmem keeps and its peer recomputes or does
not keep stands side by side::

    python dev/gpu/tools/saved_tensors.py --models deltanet,fla-deltanet --batch 8 --seq-len 2048 --out $OUT/saved
    python dev/gpu/tools/saved_tensors.py --models gla --device cpu --hidden-size 64 --layers 2 --seq-len 64

``--recompute-states`` runs the recurrence's Triton kernels with ``configs.KEEP_STATES`` off (the backward
recomputes the chunk-start states). linmem's models pick their recurrence backend as a user's do (``auto``: the
PyTorch chunk backend on a CPU); ``--backend triton`` with ``TRITON_INTERPRET=1`` runs the Triton kernels on a CPU,
so the GPU's saved tensors are counted without one (slowly: keep the sequence short; every token of a block keeps
the same bytes from one chunk, 64 tokens, on)::

    TRITON_INTERPRET=1 python dev/gpu/tools/saved_tensors.py --models gla --device cpu --backend triton \
        --dtype bf16 --batch 1 --seq-len 128 --layers 1 --vocab-size 256

Writes ``saved.json`` (every entry) and ``saved.md`` (the table) to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from linmem.bench.peers import ModelShape, build_model, parse_keys, ARCHITECTURES, PEERS
from linmem.ops.recurrence.triton import configs

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _block(path: str) -> str:
    """The module path with the first layer index kept and the others folded: layers.0.x -> block.x."""
    match = re.search(r"(?:^|\.)(?:layers|blocks|h)\.(\d+)(\.|$)", path)
    if match is None:
        return "top." + path if path else "top"
    if match.group(1) != "0":
        return ""
    return "block" + path[match.end() - 1:] if match.group(2) else "block"


def saved_by_module(model: nn.Module, input_ids: torch.Tensor) -> dict[str, dict]:
    """``{module path: {"bytes": int, "tensors": [(shape, dtype, bytes)]}}`` of one forward of ``model``."""
    stack: list[str] = [""]
    names = {module: name for name, module in model.named_modules()}
    def enter(module: nn.Module, args) -> None:
        stack.append(names[module])

    def leave(module: nn.Module, args, out) -> None:
        stack.pop()

    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # saved by matmuls, not activations
    seen: set[tuple[int, int]] = set()
    table: dict[str, dict] = defaultdict(lambda: {"bytes": 0, "tensors": []})

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen and storage.nbytes() > 0 and key[0] not in weights:
            seen.add(key)
            entry = table[stack[-1]]
            entry["bytes"] += storage.nbytes()
            entry["tensors"].append((list(t.shape), str(t.dtype).replace("torch.", ""), storage.nbytes()))
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(input_ids=input_ids, labels=input_ids)
    finally:
        for handle in handles:
            handle.remove()
    del out
    return dict(table)


def fold(table: dict[str, dict]) -> dict[str, dict]:
    """Block 0's entries and the top's, by :func:`_block` path."""
    folded: dict[str, dict] = defaultdict(lambda: {"bytes": 0, "tensors": []})
    for path, entry in table.items():
        key = _block(path)
        if key:
            folded[key]["bytes"] += entry["bytes"]
            folded[key]["tensors"] += entry["tensors"]
    return dict(folded)


def markdown(results: dict[str, dict[str, dict]], tokens: int) -> str:
    lines = []
    for key, table in results.items():
        block = sum(e["bytes"] for p, e in table.items() if p.startswith("block"))
        top = sum(e["bytes"] for p, e in table.items() if p.startswith("top"))
        lines += [f"## {key}: {block / 2**20:.1f} MB a block ({block / tokens:.0f} B a token), "
                  f"{top / 2**20:.1f} MB outside the blocks", "",
                  "| module | MB | B/token | largest tensors |", "|---|---|---|---|"]
        for path, entry in sorted(table.items(), key=lambda kv: -kv[1]["bytes"]):
            big = sorted(entry["tensors"], key=lambda t: -t[2])[:4]
            shown = ", ".join(f"{'x'.join(map(str, s))} {d}" for s, d, _ in big)
            lines.append(f"| {path} | {entry['bytes'] / 2**20:.1f} | {entry['bytes'] / tokens:.0f} | {shown} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="deltanet,fla-deltanet",
                        help=f"comma list of {', '.join(ARCHITECTURES + PEERS)}")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="the models' dtype (default: bf16 on CUDA, else fp32)")
    parser.add_argument("--backend", default="auto", help="linmem mixers' linear_recurrence backend (peers: their own)")
    parser.add_argument("--recompute-states", action="store_true",
                        help="the Triton recurrence's backward recomputes the chunk-start states (KEEP_STATES off)")
    parser.add_argument("--out", default="saved")
    args = parser.parse_args()
    keys = parse_keys(args.models, ARCHITECTURES + PEERS, "model")
    shape = ModelShape(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.layers)
    dtype = DTYPES[args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
    results = {}
    for key in keys:
        try:
            model, _ = build_model(key, shape, device=args.device, dtype=dtype, recurrence_backend=args.backend)
        except ImportError as error:
            print(f"{key}: not built ({error})")
            continue
        ids = torch.randint(0, args.vocab_size, (args.batch, args.seq_len), device=args.device)
        with configs.override(KEEP_STATES=not args.recompute_states):
            table = saved_by_module(model, ids)
        results[key] = fold(table)
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "saved.json").write_text(json.dumps(results, indent=1))
    text = markdown(results, args.batch * args.seq_len)
    (out / "saved.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
