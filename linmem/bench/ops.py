"""``linmem bench ops``: forward and forward+backward times of linmem's ops, per backend, beside peers.

One table for the shapes asked for (``[B, T, H, D]``, bf16 by default, 16K tokens per
step at the default shapes: 8 x 2K to 1 x 16K, 16 heads of 128): every memory op of the unified recurrence on
each backend and the softmax-attention ops of ``forgetting_attention``, and with ``--peers``
the same computations by others, measured in the same run. A peer that fails (fla refuses gated
backward on Hopper with Triton < 3.7.1; a FlexAttention that does not compile) prints its error
in the table instead of a time.

Rows of a memory op: ``triton``, ``chunk``, ... (each ``linear_recurrence`` backend asked for)
and ``fla.<kernel>`` (fla's kernel of that recurrence, peer ``fla``).

Rows of an attention op (``attention``: causal; ``fox``: causal with the forget gate;
``swa``: a sliding window of ``--window`` keys; ``fox_swa``: the gate and the window):

* ``linmem``: ``forgetting_attention`` (its flash kernels on CUDA);
* ``linmem.pruned`` (gated ops, with ``--prune-tolerance eps``): the same with adaptive computation
  pruning (``prune_tolerance=eps``), which skips the key tiles whose forget bias drops them;
* ``torch.sdpa_causal`` (peer ``sdpa``): PyTorch SDPA, full causal, no gate, the kernel PyTorch
  picks (flash or cuDNN): the lower bound that every other row of the op states its ratio to;
* ``torch.flex_<op>`` (peer ``flex``, CUDA only): ``torch.compile(flex_attention)`` with the
  forget bias ``c_i - c_j`` as its score_mod and causality and the window as its block mask;
* ``fla.parallel_forgetting_attn`` (peer ``fla``, op ``fox``): fla's FoX kernel.

The attention ops run at each of ``--head-dims`` (default: ``--head-dim``), the ``D`` column.

Decoding rows time one ``linear_recurrence_step`` (memory ops) or one ``cached_attention`` of a new token
against a KV cache of ``--decode-context`` keys (attention ops, at each head dim) with its host work, as
steps run back to back, and again replayed from a CUDA graph (the GPU work alone, which the state or cache
bandwidth is computed from); ceilings are measured in the same run. Times are medians of ``triton.testing.do_bench``.
``--breakdown`` adds, for the first shape, the GPU time of every kernel of one forward+backward of
each memory op and its fla peer (torch.profiler).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from . import BenchError
from ..ops import linear_recurrence, linear_recurrence_step
from ..ops.attention import cached_attention, forgetting_attention

#: the memory ops: (decay kind, delta rule, RWKV-6 bonus) of the unified recurrence
MEMORY_OPS = {
    "linear_attention": ("none", False, False),
    "retention": ("constant", False, False),
    "mamba2": ("scalar", False, False),
    "gla": ("vector", False, False),
    "rwkv6": ("vector", False, True),
    "deltanet": ("none", True, False),
    "gated_deltanet": ("scalar", True, False),
    "kda": ("vector", True, False),
    "gfw": ("full", False, False),  # a [K, V] decay per token (gfw, mamba): the chunk backend only
}
#: the ops timed when none are named: all but the full decays, whose fp32 gates alone take B*T*H*K*V*4 bytes
DEFAULT_OPS = tuple(op for op, (kind, _, _) in MEMORY_OPS.items() if kind != "full")
#: peers timed on the inputs of a memory op: fla function name per op
FLA_PEERS = {
    "mamba2": "chunk_simple_gla",
    "gla": "chunk_gla",
    "deltanet": "chunk_delta_rule",
    "gated_deltanet": "chunk_gated_delta_rule",
    "kda": "chunk_kda",
}
#: the softmax-attention ops of forgetting_attention: (forget gate, sliding window)
ATTENTION_OPS = {
    "attention": (False, False),
    "fox": (True, False),
    "swa": (False, True),
    "fox_swa": (True, True),
}
#: the peers --peers can name
PEERS = ("sdpa", "flex", "fla")
DEFAULT_SHAPES = ((8, 2048), (4, 4096), (2, 8192), (1, 16384))


@dataclass(frozen=True)
class BenchConfig:
    """What ``linmem bench ops`` times."""

    shapes: tuple[tuple[int, int], ...] = DEFAULT_SHAPES  # (B, T) pairs
    heads: int = 16  # H
    head_dim: int = 128  # K = V
    head_dims: tuple[int, ...] = ()  # the attention ops' head dims (K = V), each timed in turn; () = (head_dim,)
    dtype: str = "bfloat16"  # activations; gates stay fp32
    ops: tuple[str, ...] = DEFAULT_OPS + tuple(ATTENTION_OPS)  # keys of MEMORY_OPS and ATTENTION_OPS
    backends: tuple[str, ...] = ("triton", "chunk")  # linear_recurrence backends to time
    peers: tuple[str, ...] = ()  # some of PEERS, measured in the same run
    window: int = 512  # keys a query sees in the windowed attention ops (swa, fox_swa)
    prune_tolerance: Optional[float] = None  # also time the gated attention ops pruned at this tolerance
    decode_batch: int = 64  # B of the decoding rows (0: none)
    decode_context: int = 4096  # keys in the KV cache of the attention ops' decoding rows (a window: the ring's)
    gates: float = 1.0  # log decays this many times memory_inputs' default (10: past the one-reference bound)
    breakdown: bool = False  # also print the time per kernel of each memory op at the first shape
    accuracy: bool = False  # also print each memory op's error ratios against float64 at the first shape
    warmup_ms: int = 25
    rep_ms: int = 100

    def __post_init__(self) -> None:
        ops = (*MEMORY_OPS, *ATTENTION_OPS)
        if unknown := [op for op in self.ops if op not in ops]:
            raise ValueError(f"BenchConfig.ops: unknown {unknown}, expected some of {list(ops)}")
        if unknown := [peer for peer in self.peers if peer not in PEERS]:
            raise ValueError(f"BenchConfig.peers: unknown {unknown}, expected some of {list(PEERS)}")
        if self.window < 1:
            raise ValueError(f"BenchConfig.window: expected a number of keys >= 1, got {self.window}")
        if not all(isinstance(d, int) and d >= 1 for d in self.head_dims):
            raise ValueError(f"BenchConfig.head_dims: expected head dims >= 1, got {self.head_dims}")
        if self.decode_context < 1:
            raise ValueError(f"BenchConfig.decode_context: expected a number of keys >= 1, got {self.decode_context}")
        if self.prune_tolerance is not None and not 0 < self.prune_tolerance < 1:
            raise ValueError(f"BenchConfig.prune_tolerance: expected a softmax mass in (0, 1) or None, got "
                             f"{self.prune_tolerance}")

    @property
    def attention_dims(self) -> tuple[int, ...]:
        """The head dims the attention ops are timed at: ``head_dims``, or ``head_dim`` alone."""
        return self.head_dims or (self.head_dim,)


@dataclass
class Row:
    """One line of the table."""

    op: str
    impl: str
    B: int
    T: int
    D: int = 0  # head dim (K = V)
    fwd_ms: float = math.nan
    fwdbwd_ms: float = math.nan
    error: str = ""
    extra: dict = field(default_factory=dict)


def _timer(config: BenchConfig) -> Callable[[Callable[[], object]], float]:
    import triton

    return lambda fn, leaves=(): triton.testing.do_bench(fn, warmup=config.warmup_ms, rep=config.rep_ms,
                                                         grad_to_none=list(leaves) or None, return_mode="median")


def _time_fwd_bwd(bench, fn: Callable[[], torch.Tensor], row: Row, backward: bool = True,
                  leaves: Sequence[torch.Tensor] = ()) -> Row:
    """Fill a row with the median time of fn() and of fn().backward(g); errors go into the row. The
    gradients of ``leaves`` are reset before each timed call (outside the timing), as a training step's
    ``zero_grad`` does, so no call pays for adding its gradients to the last call's."""
    try:
        row.fwd_ms = bench(fn)
        if backward:
            out = fn()
            grad = torch.randn_like(out)
            row.fwdbwd_ms = bench(lambda: fn().backward(grad), leaves)
    except Exception as error:  # a peer or backend that cannot run these shapes says so in the table
        row.error = _error_text(error)
    finally:
        torch.cuda.empty_cache()
    return row


def _error_text(error: Exception) -> str:
    """The error's type and the first line of its message, for the table."""
    return f"{type(error).__name__}: {str(error).splitlines()[0][:160]}" if str(error) else type(error).__name__


def memory_inputs(op: str, B: int, T: int, H: int, D: int, dtype: torch.dtype, device: str,
                  gates: float = 1.0) -> dict:
    """Inputs of a memory op as linear_recurrence keywords (bench_peers conventions): unit keys for
    the delta rule, log decays ``gates`` x logsigmoid(randn) / 10 in fp32, beta in (0, 1).

    The default gates keep every channel's decay over a 64-token chunk far above 2^-64, so per-channel
    decays take the Triton kernels' one-reference path; at ``gates=10`` they take the block products and
    at 100 the pairwise loops (docs/kernels.md), as fast-forgetting channels of a trained model do.

    Example:
        >>> t = memory_inputs("gla", 1, 64, 2, 16, torch.float32, "cpu", gates=10)
        >>> sorted(t), tuple(t["log_decay"].shape)
        (['k', 'log_decay', 'q', 'v'], (1, 64, 2, 16))
    """
    kind, delta, bonus = MEMORY_OPS[op]
    leaf = lambda x: x.detach().requires_grad_(True)  # noqa: E731
    q, k, v = (torch.randn(B, T, H, D, device=device, dtype=dtype) for _ in range(3))
    if delta:
        k = F.normalize(k.float(), dim=-1).to(dtype)
    args = {"q": leaf(q), "k": leaf(k), "v": leaf(v)}
    gate = {"constant": (H,), "scalar": (B, T, H), "vector": (B, T, H, D), "full": (B, T, H, D, D)}.get(kind)
    if gate is not None:
        args["log_decay"] = leaf(F.logsigmoid(torch.randn(*gate, device=device)) * (0.1 * gates))
    if delta:
        args["beta"] = leaf(torch.rand(B, T, H, device=device, dtype=dtype))
    if bonus:
        args["bonus"] = leaf(torch.randn(H, D, device=device, dtype=dtype) * 0.1)
    return args


def grad_leaves(args: dict) -> list[torch.Tensor]:
    """The tensors of ``args`` that receive gradients."""
    return [x for x in args.values() if isinstance(x, torch.Tensor) and x.requires_grad]


def _fla_call(name: str, args: dict) -> Callable[[], torch.Tensor]:
    import importlib

    module = {"chunk_simple_gla": "fla.ops.simple_gla", "chunk_gla": "fla.ops.gla",
              "chunk_delta_rule": "fla.ops.delta_rule", "chunk_gated_delta_rule": "fla.ops.gated_delta_rule",
              "chunk_kda": "fla.ops.kda"}[name]
    fn = getattr(importlib.import_module(module), name)
    q, k, v = args["q"], args["k"], args["v"]
    if name in ("chunk_simple_gla", "chunk_gla"):
        return lambda: fn(q, k, v, args["log_decay"])[0]
    if name == "chunk_delta_rule":
        return lambda: fn(q, k, v, args["beta"])[0]
    return lambda: fn(q, k, v, args["log_decay"], args["beta"])[0]


def nominal_cost(op: str, B: int, T: int, H: int, D: int, act_bytes: int) -> tuple[float, float]:
    """(FLOPs, bytes) of forward+backward of a memory op, for the achieved fractions.

    FLOPs: the matrix products of the chunked algorithm (chunk 64) per token and head: forward
    2C(K + V) intra-chunk + 4KV state read/write (+ 2CK + 2C(K+V) + 2KV for the WY form of
    the delta rule), backward twice the forward. Bytes: each input and output read or
    written once per pass: forward reads q, k, v, gates and writes o; backward reads them and
    do and writes every gradient.
    """
    kind, delta, _ = MEMORY_OPS[op]
    C, K, V = 64, D, D
    fwd = 2 * C * (K + V) + 4 * K * V + (2 * C * K + 2 * C * (K + V) + 2 * K * V if delta else 0)
    flops = 3 * fwd * B * T * H
    gate = {"none": 0, "constant": 0, "scalar": 4, "vector": 4 * K, "full": 4 * K * V}[kind]
    gate += act_bytes if delta else 0
    per_token = (3 * D * act_bytes + gate)  # inputs
    fwd_bytes = per_token + D * act_bytes
    bwd_bytes = 2 * per_token + D * act_bytes
    return flops, float((fwd_bytes + bwd_bytes) * B * T * H)


def ceilings(device: str) -> dict:
    """Measured bf16 matmul rate (TFLOP/s) and copy bandwidth (TB/s, read + write) of the device."""
    import triton

    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t_mm = bench(lambda: a @ b)
    x = torch.randn(2**30, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    t_copy = bench(lambda: y.copy_(x))
    del a, b, x, y
    torch.cuda.empty_cache()
    return {"bf16_tflops": 2 * 8192**3 / t_mm / 1e9, "copy_TBps": 2 * 2**30 * 2 / t_copy / 1e9}


def run_ops(config: BenchConfig, device: str = "cuda", report: Callable[[Row], None] = lambda row: None
            ) -> list[Row]:
    """Time every op, backend and peer of ``config`` at every shape; ``report`` sees each row when done."""
    bench = _timer(config)
    dtype = getattr(torch, config.dtype)
    H, D = config.heads, config.head_dim
    rows = []

    def add(row: Row) -> None:
        rows.append(row)
        report(row)

    for B, T in config.shapes:
        for op in config.ops:
            if op in MEMORY_OPS:
                args = memory_inputs(op, B, T, H, D, dtype, device, config.gates)
                leaves = grad_leaves(args)
                for backend in config.backends:
                    fn = lambda args=args, backend=backend: linear_recurrence(**args, backend=backend)[0]  # noqa: E731
                    add(_time_fwd_bwd(bench, fn, Row(op, backend, B, T, D), leaves=leaves))
                if "fla" in config.peers and op in FLA_PEERS:
                    add(_fla_row(bench, FLA_PEERS[op], op, args, B, T, D))
                del args, leaves
            elif op in ATTENTION_OPS:
                for dim in config.attention_dims:
                    for row in _attention_rows(bench, op, config, B, T, H, dim, dtype, device):
                        add(row)
    if config.decode_batch:
        for row in decode_rows(config, device):
            add(row)
    return rows


def _fla_row(bench, name: str, op: str, args: dict, B: int, T: int, D: int) -> Row:
    row = Row(op, f"fla.{name}", B, T, D)
    try:
        fn = _fla_call(name, args)
    except ImportError as error:
        row.error = f"fla not installed ({error})"
        return row
    return _time_fwd_bwd(bench, fn, row, leaves=grad_leaves(args))


def attention_inputs(op: str, B: int, T: int, H: int, D: int, dtype: torch.dtype, device: str) -> dict:
    """Inputs of an attention op as forgetting_attention keywords: q, k, v ``[B, T, H, D]`` and, for the gated ops,
    ``log_forget = logsigmoid(N(0, 1) + 3)`` ``[B, T, H]`` in fp32 (forget gates near 0.95), every one a leaf.

    Example:
        >>> t = attention_inputs("fox_swa", 1, 64, 2, 16, torch.float32, "cpu")
        >>> sorted(t), tuple(t["log_forget"].shape)
        (['k', 'log_forget', 'q', 'v'], (1, 64, 2))
    """
    gated, _ = ATTENTION_OPS[op]
    args = {n: torch.randn(B, T, H, D, device=device, dtype=dtype).requires_grad_(True) for n in ("q", "k", "v")}
    if gated:
        args["log_forget"] = F.logsigmoid(torch.randn(B, T, H, device=device) + 3).requires_grad_(True)
    return args


def flex_attention_fn(B: int, T: int, window: Optional[int] = None, device: str = "cuda",
                      compiled: bool = True) -> Callable[..., torch.Tensor]:
    """forgetting_attention's function through PyTorch's FlexAttention, for inputs of batch B and length T.

    The forget bias ``c_i - c_j`` (``c`` the fp32 cumulative sum of ``log_forget`` over T) is the score_mod;
    causality and the window (``i - window < j <= i``) are the block mask, so FlexAttention skips the key
    blocks outside them. ``compiled=False`` runs flex_attention eagerly: it materialises the scores, and
    on CPU it has no backward, which is enough to check it against the reference.

    Returns:
        ``fn(q, k, v, log_forget=None) -> o``: q, k, v ``[B, T, H, D]``, log_forget ``[B, T, H]`` -> o ``[B, T, H, D]``.

    Example:
        >>> q, f = torch.randn(1, 32, 2, 16), F.logsigmoid(torch.randn(1, 32, 2))
        >>> o = flex_attention_fn(1, 32, window=8, device="cpu", compiled=False)(q, q, q, log_forget=f)
        >>> torch.allclose(o, forgetting_attention(q, q, q, log_forget=f, window=8), atol=1e-5)
        True
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def visible(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window) if window else q_idx >= kv_idx

    block_mask = create_block_mask(visible, B, None, T, T, device=device)
    flex = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           log_forget: Optional[torch.Tensor] = None) -> torch.Tensor:
        score_mod = None
        if log_forget is not None:
            c = log_forget.float().cumsum(1).transpose(1, 2).contiguous()  # [B, H, T]

            c_key = c.clone()  # one index per tensor: flex's backward (torch 2.11) refuses two into one

            def score_mod(score, b, h, q_idx, kv_idx):
                return score + c[b, h, q_idx] - c_key[b, h, kv_idx]

        o = flex(*(x.transpose(1, 2) for x in (q, k, v)), score_mod=score_mod, block_mask=block_mask)
        return o.transpose(1, 2)

    return fn


def fla_forgetting_fn() -> Callable[..., torch.Tensor]:
    """fla's ``parallel_forgetting_attn`` as ``fn(q, k, v, log_forget) -> o``, all in linmem's layout (q, k, v, o
    ``[B, T, H, D]``, log_forget ``[B, T, H]``, the default scale ``D ** -0.5``). Raises ImportError without fla."""
    from fla.ops.forgetting_attn.parallel import parallel_forgetting_attn

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_forget: torch.Tensor) -> torch.Tensor:
        return parallel_forgetting_attn(q, k, v, log_forget)

    return fn


def _attention_rows(bench, op, config, B, T, H, D, dtype, device) -> list[Row]:
    """linmem's row of an attention op, then the peers' (module docstring); every row but SDPA's gets its ratios to
    SDPA causal, and a windowed op's rows but SDPA's their window."""
    window = config.window if ATTENTION_OPS[op][1] else None
    args = attention_inputs(op, B, T, H, D, dtype, device)
    leaves = grad_leaves(args)
    rows = [_time_fwd_bwd(bench, lambda: forgetting_attention(**args, window=window), Row(op, "linmem", B, T, D),
                          leaves=leaves)]
    if (eps := config.prune_tolerance) is not None and ATTENTION_OPS[op][0]:
        pruned = lambda: forgetting_attention(**args, window=window, prune_tolerance=eps)  # noqa: E731
        row = Row(op, "linmem.pruned", B, T, D, extra={"prune_tolerance": eps})
        rows.append(_time_fwd_bwd(bench, pruned, row, leaves=leaves))
    sdpa = None
    if "sdpa" in config.peers:  # as shared/peers/bench_peers.py: PyTorch picks the kernel
        qt, kt, vt = (args[n].detach().transpose(1, 2).contiguous().requires_grad_(True) for n in ("q", "k", "v"))
        fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)  # noqa: E731
        sdpa = _time_fwd_bwd(bench, fn, Row(op, "torch.sdpa_causal", B, T, D), leaves=(qt, kt, vt))
        rows.append(sdpa)
    if "flex" in config.peers:
        rows.append(_flex_row(bench, op, args, window, B, T, D, device))
    if "fla" in config.peers and op == "fox":
        rows.append(_fla_fox_row(bench, args, B, T, D, device))
    for row in rows:
        if row is sdpa:
            continue
        if window:
            row.extra["window"] = window
        for pass_ in ("fwd", "fwdbwd") if sdpa is not None else ():
            ms, sdpa_ms = getattr(row, f"{pass_}_ms"), getattr(sdpa, f"{pass_}_ms")
            if math.isfinite(ms) and sdpa_ms > 0:  # both timed (NaN: the row or SDPA failed)
                row.extra[f"{pass_}_vs_sdpa"] = ms / sdpa_ms
    return rows


def _flex_row(bench, op: str, args: dict, window: Optional[int], B: int, T: int, D: int, device: str) -> Row:
    row = Row(op, f"torch.flex_{op}", B, T, D)
    if torch.device(device).type != "cuda":
        row.error = "needs CUDA (FlexAttention has no backward on CPU)"
        return row
    # past dynamo's recompilation limit flex_attention would run eagerly (the scores materialised) and that would be
    # timed: one compilation per shape and op stays far below 64, and reaching it fails the row instead
    try:
        fn = flex_attention_fn(B, T, window, device)
        with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
            return _time_fwd_bwd(bench, lambda: fn(**args), row, leaves=grad_leaves(args))
    except Exception as error:  # a FlexAttention (or torch) that cannot build this mask or limit says so in the table
        row.error = _error_text(error)
        return row


def _fla_fox_row(bench, args: dict, B: int, T: int, D: int, device: str) -> Row:
    row = Row("fox", "fla.parallel_forgetting_attn", B, T, D)
    try:
        fn = fla_forgetting_fn()
    except ImportError as error:
        row.error = f"fla not installed ({error})"
        return row
    if torch.device(device).type != "cuda":
        row.error = "needs CUDA (fla's kernels are Triton GPU kernels)"
        return row
    return _time_fwd_bwd(bench, lambda: fn(**args), row, leaves=grad_leaves(args))


def decode_rows(config: BenchConfig, device: str) -> list[Row]:
    """One decoding step per op at B = decode_batch: a linear_recurrence_step of each memory op against an fp32 state
    [B, H, K, V], and for each attention op and head dim a cached_attention of one new token against a KV cache of
    ``decode_context`` keys (a window: its ring of ``window`` slots, passed in slot order as a static cache's step
    does), a key mask and, for the gated ops, the cumulative forget values."""
    bench = _timer(config)
    dtype = getattr(torch, config.dtype)
    B, H, D = config.decode_batch, config.heads, config.head_dim
    rows = []
    for op in config.ops:
        if op in ATTENTION_OPS:
            rows += [_attention_decode_row(bench, op, config, dim, dtype, device) for dim in config.attention_dims]
        if op not in MEMORY_OPS:
            continue
        args = {n: x.detach() for n, x in memory_inputs(op, B, 1, H, D, dtype, device, config.gates).items()}
        step = {n: (x if n == "bonus" or (n == "log_decay" and x.dim() == 1) else x[:, 0]) for n, x in args.items()}
        state = torch.zeros(B, H, D, D, device=device)
        q, k, v = step.pop("q"), step.pop("k"), step.pop("v")
        row = Row(op, "step", B, 1, D)
        fn = lambda: linear_recurrence_step(q, k, v, state, **step)[0]  # noqa: E731
        _time_step(bench, fn, row)
        gpu_ms = row.extra.get("graph_ms", row.fwd_ms)
        row.extra["state_TBps"] = 2 * state.numel() * 4 / (gpu_ms * 1e-3) / 1e12
        rows.append(row)
    return rows


def _attention_decode_row(bench, op: str, config: BenchConfig, D: int, dtype: torch.dtype, device: str) -> Row:
    """The decoding row of an attention op at head dim D (:func:`decode_rows`); ``cache_TBps``: the keys and values
    read per step over the step's GPU time."""
    gated, windowed = ATTENTION_OPS[op]
    B, H = config.decode_batch, config.heads
    keys = min(config.window, config.decode_context) if windowed else config.decode_context
    q = torch.randn(B, 1, H, D, device=device, dtype=dtype)
    k, v = (torch.randn(B, keys, H, D, device=device, dtype=dtype) for _ in range(2))
    present = torch.ones(B, keys, dtype=torch.bool, device=device)
    cum = F.logsigmoid(torch.randn(B, keys, H, device=device) + 3).cumsum(1) if gated else None
    row = Row(op, "decode", B, 1, D, extra={"keys": keys})
    _time_step(bench, lambda: cached_attention(q, k, v, key_mask=present, cum_forget=cum), row)
    gpu_ms = row.extra.get("graph_ms", row.fwd_ms)
    row.extra["cache_TBps"] = (k.numel() + v.numel()) * k.element_size() / (gpu_ms * 1e-3) / 1e12
    return row


def _time_step(bench, fn: Callable[[], object], row: Row) -> None:
    """Fill a decoding row: the time per step back to back and, when the step can be captured, in a CUDA graph."""
    with torch.no_grad():
        _time_fwd_bwd(_back_to_back_ms, fn, row, backward=False)
        if not row.error:
            try:
                row.extra["graph_ms"] = _graphed_ms(bench, fn)
            except Exception as error:  # a step that cannot be captured says so in the table
                row.error = f"CUDA graph: {type(error).__name__}: {str(error).splitlines()[0][:120]}"


def _back_to_back_ms(fn: Callable[[], object], steps: int = 100, rounds: int = 5) -> float:
    """Time per call of fn called ``steps`` times in a row with one synchronisation at the end (the median of
    ``rounds``): what a decoding loop gets, the larger of its host work and its GPU work per step. ``do_bench``
    empties the L2 cache before each call, and that GPU work hides up to its own length of host work (a 256 MB
    memset: about 60 us on an H200), so it understates a step that the host bounds. One untimed round first."""
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return sorted(times)[rounds // 2]


def _graphed_ms(bench, fn: Callable[[], object]) -> float:
    """Time of fn replayed from a CUDA graph: its GPU work without the host's per-call dispatch."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay)


TABLE_HEAD = (f"{'op':18s} {'impl':28s} {'B':>3s} {'T':>6s} {'D':>4s} {'fwd ms':>8s} {'f+b ms':>8s} {'Mtok/s':>7s} "
              f"{'%flop':>6s} {'%bw':>5s}  note")


def format_row(r: Row, config: BenchConfig, ceil: Optional[dict]) -> str:
    """One line: times, tokens/s and, for memory ops, achieved fractions of the measured ceilings; for attention
    ops the window and the ratios to SDPA causal."""
    act_bytes = torch.finfo(getattr(torch, config.dtype)).bits // 8
    tok = r.B * r.T / (r.fwdbwd_ms * 1e-3) / 1e6 if not math.isnan(r.fwdbwd_ms) else math.nan
    fl = bw = math.nan
    notes = [f"window {r.extra['window']}"] if "window" in r.extra else []
    notes += [f"prune tolerance {r.extra['prune_tolerance']:g}"] if "prune_tolerance" in r.extra else []
    ratios = [f"{name} {r.extra[f'{pass_}_vs_sdpa']:.2f}" for pass_, name in (("fwdbwd", "f+b"), ("fwd", "fwd"))
              if f"{pass_}_vs_sdpa" in r.extra]
    if ratios:
        notes.append("x sdpa_causal: " + ", ".join(ratios))
    note = "; ".join(notes + ([r.error] if r.error else []))
    if r.op in MEMORY_OPS and r.T > 1 and ceil and not math.isnan(r.fwdbwd_ms):
        flops, nbytes = nominal_cost(r.op, r.B, r.T, config.heads, config.head_dim, act_bytes)
        fl = 100 * flops / (r.fwdbwd_ms * 1e-3) / (ceil["bf16_tflops"] * 1e12)
        bw = 100 * nbytes / (r.fwdbwd_ms * 1e-3) / (ceil["copy_TBps"] * 1e12)
    read = next((name for name in ("state", "cache") if f"{name}_TBps" in r.extra), None)
    if read:
        graphed = f", {r.extra['graph_ms'] * 1e3:.1f} us in a CUDA graph" if "graph_ms" in r.extra else ""
        keys = f", {r.extra['keys']} keys" if "keys" in r.extra else ""
        rate = f"{read} {r.extra[f'{read}_TBps']:.2f} TB/s "
        note = f"{r.fwd_ms * 1e3:.1f} us/step back to back{graphed}{keys}, {rate}" + note
        if ceil:
            note += f"({100 * r.extra[f'{read}_TBps'] / ceil['copy_TBps']:.0f}% of copy)"
    return (f"{r.op:18s} {r.impl:28s} {r.B:3d} {r.T:6d} {r.D:4d} {r.fwd_ms:8.3f} {r.fwdbwd_ms:8.3f} {tok:7.2f} "
            f"{fl:6.1f} {bw:5.1f}  {note}")


def environment() -> dict:
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none"}
    try:
        import fla

        env["fla"] = getattr(fla, "__version__", "installed")
    except ImportError:
        env["fla"] = "not installed"
    return env


def kernel_breakdown(fn: Callable[[], torch.Tensor], device: str = "cuda", iters: int = 10,
                     leaves: Sequence[torch.Tensor] = ()) -> tuple[float, list[tuple[str, float]]]:
    """Where one ``fn().backward(g)`` spends its time: ``(total ms, [(name, ms), ...])``, largest first.

    On CUDA the names are kernels and the times their GPU time; on CPU, aten ops and their self
    time. Means over ``iters`` calls after two warm-up calls. The gradients of ``leaves`` are reset
    before each call, so no call adds its gradients to the last call's.

    Example:
        >>> q = torch.randn(1, 64, 2, 16, requires_grad=True)
        >>> total, parts = kernel_breakdown(lambda: linear_recurrence(q, q, q, backend="chunk")[0], "cpu", iters=1)
        >>> total > 0 and any(name == "aten::bmm" for name, _ in parts)
        True
    """
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    grad = torch.randn_like(fn())

    def step() -> None:
        for x in leaves:
            x.grad = None
        fn().backward(grad)

    for _ in range(2):
        step()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            step()
        sync()
    per_name: dict[str, float] = defaultdict(float)
    if device == "cuda":
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                per_name[event.name] += event.device_time_total
    else:
        for event in prof.key_averages():
            per_name[event.key] += event.self_cpu_time_total
    parts = sorted(((name, us / iters / 1000) for name, us in per_name.items() if us > 0), key=lambda p: -p[1])
    return sum(ms for _, ms in parts), parts


def breakdown_rows(config: BenchConfig, device: str = "cuda", top: int = 8, iters: int = 10) -> list[str]:
    """Lines of the per-kernel breakdown of every memory op (each backend, and its fla peer) at the
    first shape of ``config``."""
    B, T = config.shapes[0]
    lines = [f"time per kernel, one forward+backward, B x T = {B} x {T}, H = {config.heads}, "
             f"K = V = {config.head_dim}, {config.dtype}"]
    for op in (o for o in config.ops if o in MEMORY_OPS):
        lines += _op_breakdown(op, config, device, top, iters)
        if device == "cuda":
            torch.cuda.empty_cache()  # the op's inputs are gone with _op_breakdown's frame
    return lines


def _op_breakdown(op: str, config: BenchConfig, device: str, top: int, iters: int) -> list[str]:
    B, T = config.shapes[0]
    args = memory_inputs(op, B, T, config.heads, config.head_dim, getattr(torch, config.dtype), device, config.gates)
    calls = [(backend, lambda backend=backend: linear_recurrence(**args, backend=backend)[0])
             for backend in config.backends]
    lines = []
    if "fla" in config.peers and op in FLA_PEERS:
        try:
            calls.append((f"fla.{FLA_PEERS[op]}", _fla_call(FLA_PEERS[op], args)))
        except ImportError as error:
            lines.append(f"{op} fla: not installed ({error})")
    for impl, fn in calls:
        try:
            total, parts = kernel_breakdown(fn, device, iters, leaves=grad_leaves(args))
        except Exception as error:  # a peer that refuses these inputs says so
            lines.append(f"{op} {impl}: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
            continue
        lines.append(f"{op} {impl}: {total:.3f} ms")
        lines += [f"    {ms:8.3f} ms  {name[:90]}" for name, ms in parts[:top]]
    return lines


def accuracy_rows(config: BenchConfig, device: str = "cuda") -> list[str]:
    """Lines of the error ratios ``rms(x - ref) / rms(ref)`` (as the tests measure them) of every memory op's
    backends and fla peer at the first shape of ``config``: the output and the gradient of every
    input under one random cotangent, against the chunk backend run in float64 on the same inputs.
    The cotangent is representable in the benchmark dtype, so a ratio counts only what the
    implementation loses.

    Example:
        >>> config = BenchConfig(shapes=((1, 64),), heads=2, head_dim=16, dtype="float32",
        ...                      ops=("deltanet",), backends=("chunk",))
        >>> accuracy_rows(config, "cpu")[1].startswith("deltanet chunk: worst ")
        True
    """
    B, T = config.shapes[0]
    dtype = getattr(torch, config.dtype)
    lines = [f"error ratio against float64, B x T = {B} x {T}, H = {config.heads}, K = V = {config.head_dim}, "
             f"{config.dtype}: output, then each input's gradient"]
    for op in (o for o in config.ops if o in MEMORY_OPS):
        torch.manual_seed(0)
        args = memory_inputs(op, B, T, config.heads, config.head_dim, dtype, device, config.gates)
        grad = torch.randn(B, T, config.heads, config.head_dim, device=device).to(dtype)
        ref = _output_and_grads(lambda a: linear_recurrence(**a, backend="chunk")[0], args, grad, torch.float64)
        impls = [(backend, lambda a, backend=backend: linear_recurrence(**a, backend=backend)[0])
                 for backend in config.backends]
        if "fla" in config.peers and op in FLA_PEERS:
            impls.append((f"fla.{FLA_PEERS[op]}", lambda a: _fla_call(FLA_PEERS[op], a)()))
        for impl, fn in impls:
            try:
                got = _output_and_grads(fn, args, grad)
            except ImportError as error:
                lines.append(f"{op} {impl}: not installed ({error})")
                continue
            except Exception as error:  # a backend or peer that refuses these inputs says so
                lines.append(f"{op} {impl}: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
                continue
            ratios = {name: _error_ratio(got[name], ref[name]) for name in ref}
            lines.append(f"{op} {impl}: worst {max(ratios.values()):.1e}  "
                         + "  ".join(f"{name} {ratio:.1e}" for name, ratio in ratios.items()))
        del args
        if device == "cuda":
            torch.cuda.empty_cache()
    return lines


def _output_and_grads(fn: Callable[[dict], torch.Tensor], args: dict, grad: torch.Tensor,
                      dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """{"o": fn(inputs), "d<name>": gradient of each input} under the cotangent ``grad``, on fresh
    copies of ``args`` (cast to ``dtype`` if given)."""
    leaves = {name: x.detach().to(dtype or x.dtype).requires_grad_(True) for name, x in args.items()}
    out = fn(leaves)
    out.backward(grad.to(out.dtype))
    return {"o": out.detach()} | {f"d{name}": x.grad for name, x in leaves.items()}


def _error_ratio(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))


def main(config: BenchConfig, json_path: Optional[str] = None) -> int:
    """Run the benchmark and print the table (and write rows as JSON)."""
    if not torch.cuda.is_available():
        raise BenchError("linmem bench ops times CUDA kernels: no CUDA device found")
    env = environment()
    ceil = ceilings("cuda")
    gates = {"gates": config.gates} if config.gates != 1.0 else {}
    print(json.dumps({**env, **{k: round(v, 3) for k, v in ceil.items()}, **gates}), flush=True)
    print(TABLE_HEAD + "\n" + "-" * len(TABLE_HEAD), flush=True)
    rows = run_ops(config, report=lambda row: print(format_row(row, config, ceil), flush=True))
    if config.breakdown:
        print("\n" + "\n".join(breakdown_rows(config)), flush=True)
    if config.accuracy:
        print("\n" + "\n".join(accuracy_rows(config)), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"env": env, "ceilings": ceil, "config": asdict(config), "rows": [asdict(r) for r in rows]}, f,
                      indent=1)
    return 0


def parser() -> argparse.ArgumentParser:
    """The options of ``linmem bench ops``."""
    ops = argparse.ArgumentParser(
        prog="linmem bench ops",
        description="Forward and forward+backward times of linmem's ops beside peers, in one table (CUDA). Rows of a "
                    "memory op: one per --backends, then fla.<kernel> (--peers fla). Rows of an attention op: linmem "
                    "(forgetting_attention), torch.sdpa_causal (--peers sdpa: the other rows give their ratio to it), "
                    "torch.flex_<op> (--peers flex) and, for fox, fla.parallel_forgetting_attn (--peers fla).")
    ops.add_argument("--shapes", default="8x2048,4x4096,2x8192,1x16384", help="BxT pairs, comma-separated")
    ops.add_argument("--heads", type=int, default=16)
    ops.add_argument("--head-dim", type=int, default=128)
    ops.add_argument("--head-dims", default="",
                     help="time the attention ops at each of these head dims (comma-separated, e.g. "
                          "32,64,96,128,192,256) instead of --head-dim; the memory ops stay at --head-dim")
    ops.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ops.add_argument("--ops", default="linear_attention,retention,mamba2,gla,rwkv6,deltanet,gated_deltanet,kda,"
                                      "attention,fox,swa,fox_swa",
                     help="memory ops of the unified recurrence ('gfw': a full [K, V] decay, as gfw and mamba "
                          "give it; not timed unless named) and forgetting_attention's: 'attention' (causal), "
                          "'fox' (causal, forget gate), 'swa' (sliding window of --window keys), 'fox_swa' (both)")
    ops.add_argument("--backends", default="triton,chunk", help="linear_recurrence backends to time")
    ops.add_argument("--peers", nargs="?", const="sdpa,flex,fla", default="",
                     help="add peers measured in the same run (alone: all three): sdpa (PyTorch SDPA, full causal, "
                          "no gate: the lower bound of each attention op, which its other rows state their ratios to), "
                          "flex (torch.compile(flex_attention) computing each attention op: forget bias as score_mod, "
                          "causality and window as block mask; CUDA), fla (flash-linear-attention's kernel of each "
                          "memory op and parallel_forgetting_attn for fox)")
    ops.add_argument("--window", type=int, default=512, help="keys a query sees in the ops swa and fox_swa")
    ops.add_argument("--prune-tolerance", type=float, default=None,
                     help="also time fox and fox_swa with adaptive computation pruning at this tolerance")
    ops.add_argument("--decode-batch", type=int, default=64, help="batch of the decoding-step rows (0: none)")
    ops.add_argument("--decode-context", type=int, default=4096,
                     help="keys in the KV cache of the attention ops' decoding rows (swa, fox_swa: the ring of "
                          "--window slots)")
    ops.add_argument("--gates", type=float, default=1.0,
                     help="log decays this many times the default: 10 and 100 send per-channel decays down the "
                          "kernels' block and pairwise paths, as fast-forgetting channels of a trained model do")
    ops.add_argument("--json", help="also write the rows to this JSON file")
    ops.add_argument("--breakdown", action="store_true",
                     help="also print the GPU time of every kernel of each memory op (and fla peer) at the first shape")
    ops.add_argument("--accuracy", action="store_true",
                     help="also print the error ratios of each memory op (and fla peer) against float64 at the first "
                          "shape")
    return ops


def config_from(args: argparse.Namespace) -> BenchConfig:
    """The :class:`BenchConfig` of parsed ``linmem bench ops`` options."""
    shapes = tuple(tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(","))
    head_dims = tuple(int(d) for d in args.head_dims.split(",") if d)
    return BenchConfig(shapes=shapes, heads=args.heads, head_dim=args.head_dim, head_dims=head_dims, dtype=args.dtype,
                       ops=tuple(args.ops.split(",")), backends=tuple(args.backends.split(",")),
                       peers=tuple(p for p in args.peers.split(",") if p),
                       window=args.window, prune_tolerance=args.prune_tolerance,
                       decode_batch=args.decode_batch, decode_context=args.decode_context, gates=args.gates,
                       breakdown=args.breakdown, accuracy=args.accuracy)


def main_argv(argv: Optional[list[str]] = None) -> int:
    """``linmem bench ops`` (and ``python -m linmem.bench.ops``) with these command-line options."""
    args = parser().parse_args(argv)
    return main(config_from(args), json_path=args.json)


if __name__ == "__main__":
    raise SystemExit(main_argv())
