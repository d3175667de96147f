"""Tensor parallelism: every layer's heads and hidden units split over the ``tp`` ranks, which see the same tokens.

Megatron's layout, the one Linear-MoE's Figure 2 draws: the activations between the blocks are replicated
(every rank of a tensor-parallel group holds the whole ``[B, T, D]`` stream, the embeddings, the block norms
and the head); inside a block every mixer and feed-forward is one *region* that computes a share of the heads
(hidden units)::

    x (replicated) -> f -> column-parallel input projections -> the rank's heads -> row-parallel output -> g
    f: identity, gradients summed over the ranks       g: partial outputs summed over the ranks (one all-reduce)

so a block costs one all-reduce per region forward and one backward. The q/k/v, gate and decay projections are
split by output rows (``Shard(0)``, whole heads per rank); the short convolutions over them by channel; per-head
parameters (``A_log``, ``dt_bias``, per-head norms, RWKV's bonus) along their head dimension; the output
projection by input columns (``Shard(1)``), its bias added once after the sum. SwiGLU feed-forwards split their
hidden units: ``[gate; up]`` (one weight, gate rows above up rows) by halves, so that rank r holds the r-th block
of both (``_StridedShard(0, split_factor=2)``), ``down`` by columns; every expert of an MoE layer likewise, with
the router replicated. Norms over the width of all heads (HGRN-2, Lightning, GSA, Mamba-2) sum their statistics
over the ranks. Parameters every head shares (a norm weight over one head's width, the first map of a low-rank
gate, RWKV's token-shift mixes) stay whole on every rank, their gradients summed over the ranks (each rank's is
the part from its heads). Mamba-2's fused input projection keeps its weight whole: its B and C rows serve every
head, so a rank computes with its own z, x and dt rows and the shared B, C rows.

Three mixers need more than that. Mamba-1 splits its channels (whole heads), but its ``x_proj`` reads every
channel for the step sizes' low-rank input and for B and C, which all channels share: its partial outputs are
summed inside the region, a second all-reduce each way (``dt_rank + 2 N`` wide). S4D splits the channels of its
input, each its own SSM, over the ranks (the rank reads its channels of x: :attr:`Mixer.heads`); its output GLU
pairs channel j of ``out_proj`` with channel D + j, so the partial outputs of both halves are summed before the
GLU (the one all-reduce, ``2 D`` wide). A mixture of memories splits every memory by its rule's plan (each stacked
weight ``[M', out, in]`` one dimension further) while every rank routes alike with the whole router: its region
is ``mix_memories`` after the routing, entered by the routing weights with their gradients summed, so the router
and the balancing loss get the same whole gradient on every rank.

Split parameters are DTensors on the ``tp`` mesh (global shapes: FSDP2 shards them over the data ranks, DCP
saves and reshards them, :func:`full_tensor` gathers them); while a region runs, its module sees the local tensors
(``to_local()``, differentiable), so the layers' code runs unchanged on its share of the heads (it takes its
head count from its tensors' shapes). Every mixer has a plan (:data:`PLANS`); counts of heads (channels) or
hidden units that ``tp`` does not divide are refused by name.

A weight split by halves is turned into plain blocks of its global tensor and back by hand (:func:`halves_to_blocks`,
:func:`blocks_to_halves`: one all-gather over the ``tp`` ranks), not by DTensor's ``redistribute``: torch 2.11
cannot redistribute ``(Shard(1), _StridedShard(0, sf=2))``, the placements FSDP2 gives such a weight.

Example (under ``torchrun --nproc-per-node 2``)::

    config = ParallelConfig(tp=2)
    model = parallelize(LinmemForCausalLM(model_config), build_mesh(config), config)  # apply_tp inside
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..layers.base import Mixer
from ..layers.moe import MoEFeedForward
from ..layers.mom import MemoryLinear
from ..layers.norms import RMSNorm
from .collectives import all_reduce_sum, sum_gradients, sum_partials
from .config import ParallelConfig, ParallelConfigError, ParallelMesh
from .expert import ExpertParallelMoE

__all__ = ["PLANS", "apply_tp", "blocks_to_halves", "full_tensor", "halves_to_blocks", "splits_halves_by_rows",
           "tensor_parallel_refusal", "tp_placements"]


# ---------------------------------------------------------------- how a parameter splits


@dataclass(frozen=True)
class Heads:
    """Dimension ``dim`` runs over heads (or hidden units) in consecutive blocks: rank r holds block r
    (``Shard(dim)``)."""

    dim: int = 0


@dataclass(frozen=True)
class Halves:
    """Two halves stacked along ``dim`` (a SwiGLU's [gate; up]), each split in consecutive blocks: rank r holds
    block r of both, concatenated (``_StridedShard(dim, split_factor=2)``)."""

    dim: int = 0


@dataclass(frozen=True)
class Rows:
    """Kept whole on every rank; a rank computes with the rows ``index(rank, ranks)`` of dimension ``dim`` (Mamba-2's
    input projection and convolution, whose B and C rows every head reads), its gradient summed over the ranks."""

    index: Callable[[int, int], list[int]]
    dim: int = 0


@dataclass(frozen=True)
class Replicated:
    """Kept whole on every rank and outside the region's sums: every rank computes the same whole gradient for it
    (MoM's router, which routes before the region)."""


Split = Union[Heads, Halves, Rows, Replicated]


@dataclass
class Plan:
    """How one region (a mixer or a feed-forward) splits: the parameters not named in ``params`` stay whole on
    every rank (their gradients summed over the ranks); ``output`` is the row-parallel projection, whose partial
    outputs are summed over the ranks at the region's end (with ``output_inside``, where the projection computes
    them: S4's GLU follows it), its bias added after the sum; ``norms`` are RMSNorms over the width of all heads;
    ``sums`` are row-parallel maps inside the region whose outputs the rank's heads need whole (Mamba's
    ``x_proj``): summed over the ranks both ways, one all-reduce each. ``units`` names what
    the region splits and how many there are, when not its heads (S4's channels); ``method`` is the module's method
    that is the region (MoM's ``mix_memories``: every rank routes alike before it)."""

    params: dict[str, Split] = field(default_factory=dict)
    output: Optional[str] = None
    norms: tuple[str, ...] = ()
    output_inside: bool = False
    sums: tuple[str, ...] = ()
    units: Optional[tuple[str, int]] = None
    method: str = "forward"


def _columns(*modules: str) -> dict[str, Split]:
    """Column-parallel maps (linear layers, short convolutions, LoRA biases): weight rows and bias split."""
    return {f"{m}.{p}": Heads(0) for m in modules for p in ("weight", "bias")}


def _heads(*names: str, dim: int = 0) -> dict[str, Split]:
    return {name: Heads(dim) for name in names}


def _rows(output: str) -> dict[str, Split]:
    """The row-parallel output projection: weight columns split (its bias, whole, is added after the sum)."""
    return {f"{output}.weight": Heads(1)}


def _attention(m: nn.Module) -> Plan:  # softmax, swa, fox
    return Plan({**_columns("q_proj", "k_proj", "v_proj", "g_proj", "k_shift_proj", "v_shift_proj", "f_proj"),
                 **_heads("q_norm.weight", "k_norm.weight", "o_norm.weight", "f_bias"), **_rows("o_proj")},
                "o_proj")


def _pretrained(m: nn.Module) -> Plan:  # llama_attention, liger: Qwen3's q/k norms are shared by the heads
    return Plan({**_columns("q_proj", "k_proj", "v_proj", "gate_proj"), **_heads("feature_map.weight"),
                 **_rows("o_proj")}, "o_proj")


_CONVS = ("convs.q", "convs.k", "convs.v", "convs.i")


def _memory(*columns: str, heads: tuple[str, ...] = (), output: str = "o_proj",
            norms: tuple[str, ...] = ()) -> Callable[[nn.Module], Plan]:
    """The plan of a memory mixer with column-parallel ``columns`` (and the short convolutions), per-head
    ``heads``, the output projection ``output`` and the all-heads ``norms``."""
    def plan(m: nn.Module) -> Plan:
        return Plan({**_columns(*columns, *_CONVS), **_heads(*heads), **_heads(*(f"{n}.weight" for n in norms)),
                     **_rows(output)}, output, norms)
    return plan


_DELTA = ("q_proj", "k_proj", "v_proj", "b_proj", "a_proj", "g_proj", "m_proj", "q_conv", "k_conv", "v_conv")


def _mamba2(m: nn.Module) -> Plan:
    H, N, P = m.args.num_heads, m.args.key_dim, m.args.value_dim
    inner = H * P

    def share(start: int, size: int, rank: int, ranks: int) -> list[int]:  # block `rank` of [start, start + size)
        step = size // ranks
        return list(range(start + rank * step, start + (rank + 1) * step))

    def in_proj(rank: int, ranks: int) -> list[int]:  # z, x, B, C, dt: the rank's z, x, dt rows, all B, C rows
        return [*share(0, inner, rank, ranks), *share(inner, inner, rank, ranks), *range(2 * inner, 2 * inner + 2 * N),
                *share(2 * inner + 2 * N, H, rank, ranks)]

    def conv(rank: int, ranks: int) -> list[int]:  # x, B, C
        return [*share(0, inner, rank, ranks), *range(inner, inner + 2 * N)]

    return Plan({"in_proj.weight": Rows(in_proj), "conv.weight": Rows(conv), "conv.bias": Rows(conv),
                 **_heads("A_log", "dt_bias", "D", "norm.weight"), **_rows("out_proj")}, "out_proj", ("norm",))


def _mamba(m: nn.Module) -> Plan:
    """Mamba-1 by channels (whole heads): ``in_proj``'s [x; z] by halves, the convolution, ``dt_proj``, ``dt_bias``,
    ``A_log`` and ``D`` by channel; ``x_proj`` reads every channel (the step sizes' low-rank input, B and C, which
    all channels share), so its partial outputs are summed (the region's second all-reduce)."""
    return Plan({"in_proj.weight": Halves(0), **_columns("conv", "dt_proj"), **_heads("dt_bias", "A_log", "D"),
                 "x_proj.weight": Heads(1), **_rows("out_proj")}, "out_proj", sums=("x_proj",))


def _s4(m: nn.Module) -> Plan:
    """S4D by channels of the layer input (each its own SSM); ``out_proj`` reads every channel, and its two halves
    meet in the GLU after it (channel j with channel D + j), so its partial outputs, both halves, are summed before
    the GLU: the region's one all-reduce, of width 2 D."""
    return Plan({**_heads("log_dt", "A_log", "C", "D"), **_rows("out_proj")}, "out_proj", output_inside=True,
                units=("channels", m.args.hidden_size))


def _mom(m: nn.Module) -> Plan:
    """A mixture of memories: its rule's plan inside every memory (a stacked weight ``[M', out, in]``, bias
    ``[M', out]``, split as the rule's, one dimension further), the router whole and before the region: every rank
    routes alike, and the routing weights enter the region with their gradients summed."""
    rule = PLANS[m.args.mom_memory](m.memory)
    params: dict[str, Split] = {"router.weight": Replicated()}
    for name, _ in m.memory.named_parameters():
        split = rule.params.get(name)
        if split is not None and isinstance(m.memory.get_submodule(name.rpartition(".")[0]), MemoryLinear):
            split = replace(split, dim=split.dim + 1)
        if split is not None:
            params[f"memory.{name}"] = split
    inner = lambda names: tuple(f"memory.{n}" for n in names)  # noqa: E731
    return Plan(params, f"memory.{rule.output}", inner(rule.norms), sums=inner(rule.sums), method="mix_memories")


def _rwkv(*columns: str, loras: tuple[str, ...], heads: tuple[str, ...]) -> Callable[[nn.Module], Plan]:
    """RWKV-6/7: column-parallel maps, LoRAs whose second map (``B: [rank, d_out]``) and bias split by heads, the
    per-head GroupNorm; the token-shift mixes (``D -> D``) stay whole."""
    def plan(m: nn.Module) -> Plan:
        return Plan({**_columns(*columns), **_heads(*(f"{n}.B" for n in loras), dim=1),
                     **_heads(*(f"{n}.bias" for n in loras)), **_heads(*heads, "norm.weight", "norm.bias"),
                     **_rows("output_proj")}, "output_proj")
    return plan


#: the plan of every mixer tensor parallelism splits, by registered name
PLANS: dict[str, Callable[[nn.Module], Plan]] = {
    "softmax": _attention, "swa": _attention, "fox": _attention,
    "llama_attention": _pretrained, "liger": _pretrained,
    "gla": _memory("q_proj", "k_proj", "v_proj", "g_proj", "gk_proj.1"),
    "gfw": _memory("q_proj", "k_proj", "v_proj", "g_proj", "alpha_proj", "beta_proj"),
    "gateloop": _memory("q_proj", "k_proj", "v_proj", "g_proj", "a_proj"),
    "deltanet": _memory(*_DELTA), "gated_deltanet": _memory(*_DELTA, heads=("A_log", "dt_bias")),
    "titans": _memory(*_DELTA, heads=("A_log", "dt_bias")),
    "ttt": _memory(*_DELTA, heads=("ttt_norm.weight", "ttt_norm.bias")),
    "bayes": _memory("q_proj", "k_proj", "v_proj", "b_proj", "a_proj", "g_proj",
                     heads=("A_log", "dt_bias", "obs_noise_raw", "process_noise_raw")),
    "kda": _memory("q_proj", "k_proj", "v_proj", "b_proj", "f_proj.1", "g_proj.1", heads=("A_log", "dt_bias")),
    "linear_attention": _memory("q_proj", "k_proj", "v_proj"),
    "retention": _memory("q_proj", "k_proj", "v_proj", "g_proj"),
    "lightning": _memory("q_proj", "k_proj", "v_proj", "g_proj", norms=("o_norm",)),
    "hgrn2": _memory("q_proj", "f_proj", "i_proj", norms=("o_norm",)),
    "gsa": _memory("q_proj", "k_proj", "v_proj", "f_proj", norms=("o_norm",)),
    "mamba2": _mamba2, "mamba": _mamba, "s4": _s4, "mom": _mom,
    "rwkv6": _rwkv("receptance", "key", "value", "gate", loras=("decay",), heads=("bonus",)),
    "rwkv7": _rwkv("receptance", "key", "value", loras=("decay", "icl_rate", "gate"), heads=("k_k", "k_a", "r_k")),
}

def _swiglu() -> Plan:
    return Plan({"gate_up.weight": Halves(0), "down.weight": Heads(1)}, "down")


def tp_placements(split: Split) -> list:
    """The DTensor placement on the ``tp`` mesh of a split parameter (:class:`Heads` or :class:`Halves`)."""
    if isinstance(split, Halves):
        return [_StridedShard(split.dim, split_factor=2)]
    return [Shard(split.dim)]


# ---------------------------------------------------------------- halves <-> blocks


def _tp_dim(value: DTensor) -> Optional[int]:
    """The index of the ``tp`` dimension of ``value``'s mesh (None: not on it)."""
    names = value.device_mesh.mesh_dim_names or ()
    return names.index("tp") if "tp" in names else None


def _check_halves(what: str, value: DTensor, mesh_dim: int, dim: int) -> None:
    """Refuse by name a layout the hand conversion does not describe: another mesh dimension (FSDP's) sharding the
    split dimension too, or halves that the ``tp`` ranks do not divide evenly."""
    for i, p in enumerate(value.placements):
        if i != mesh_dim and isinstance(p, (Shard, _StridedShard)) and p.dim == dim:
            raise ValueError(f"{what}: placements {tuple(value.placements)} shard tensor dimension {dim}, which "
                             f"tp splits by halves, on mesh dimension {i} too; FSDP must shard another dimension")
    ranks = value.device_mesh.size(mesh_dim)
    if value.shape[dim] % (2 * ranks):
        raise ValueError(f"{what}: dimension {dim} of shape {tuple(value.shape)} must split into 2 halves of "
                         f"{ranks} blocks (tp = {ranks})")


@torch.no_grad()
def _regroup(value: DTensor, mesh_dim: int, dim: int, placements: tuple[Placement, ...],
             to_blocks: bool) -> DTensor:
    """``value`` with its local tensor along ``dim`` regrouped over the ranks of ``mesh_dim`` (one all-gather):
    ``[gate_r; up_r]`` into block r of ``[gate; up]`` (``to_blocks``), or back; ``placements`` describe the result."""
    mesh = value.device_mesh
    ranks, rank = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    local = value.to_local().contiguous()
    pieces = [torch.empty_like(local) for _ in range(ranks)]
    dist.all_gather(pieces, local, group=mesh.get_group(mesh_dim))
    if to_blocks:  # piece r = [gate_r; up_r]: gather each half's blocks, then take block r of the whole
        whole = torch.cat([torch.cat([piece.chunk(2, dim)[half] for piece in pieces], dim) for half in (0, 1)], dim)
        mine = whole.chunk(ranks, dim)[rank]
    else:  # piece r = block r of [gate; up]: block r of each half
        mine = torch.cat([half.chunk(ranks, dim)[rank] for half in torch.cat(pieces, dim).chunk(2, dim)], dim)
    return DTensor.from_local(mine.contiguous(), mesh, placements, run_check=False, shape=value.shape,
                              stride=value.stride())


def halves_to_blocks(value: DTensor) -> DTensor:
    """``value`` split by halves over ``tp`` (``_StridedShard(dim, split_factor=2)`` on the mesh dimension named
    ``tp``; the other mesh dimensions, FSDP's, on other tensor dimensions) as plain blocks (``Shard(dim)``): tp rank r
    holds rows ``[r 2F/n, (r + 1) 2F/n)`` of the global ``[gate; up]`` (``[2F, ...]`` along ``dim``, n ranks)
    instead of ``[gate_r; up_r]``. One all-gather over the ``tp`` ranks, outside autograd; the other placements are
    kept. ``value`` itself when it is not split by halves.

    Example (under ``torchrun``, a SwiGLU's ``gate_up.weight: [2F, D]`` after ``parallelize``)::

        blocks = halves_to_blocks(mlp.gate_up.weight)   # placements (Shard(1), Shard(0)) on (data, tp)
    """
    mesh_dim = _tp_dim(value)
    placement = None if mesh_dim is None else value.placements[mesh_dim]
    if not isinstance(placement, _StridedShard):
        return value
    if placement.split_factor != 2:
        raise ValueError(f"halves_to_blocks: expected _StridedShard(dim, split_factor=2) on tp (halves), got "
                         f"{placement}")
    _check_halves("halves_to_blocks", value, mesh_dim, placement.dim)
    placements = tuple(Shard(placement.dim) if i == mesh_dim else p for i, p in enumerate(value.placements))
    return _regroup(value, mesh_dim, placement.dim, placements, to_blocks=True)


def blocks_to_halves(value: DTensor, placements: tuple[Placement, ...]) -> DTensor:
    """The inverse of :func:`halves_to_blocks`: ``value``, plain blocks along ``dim`` over ``tp`` (``Shard(dim)``),
    in ``placements``, the halves' layout (``_StridedShard(dim, split_factor=2)`` on ``tp``, the others as
    ``value``'s). One all-gather over the ``tp`` ranks, outside autograd.

    Example (under ``torchrun``)::

        halves = blocks_to_halves(halves_to_blocks(weight), weight.placements)   # equal to weight
    """
    placements = tuple(placements)
    mesh_dim = _tp_dim(value)
    target = None if mesh_dim is None else placements[mesh_dim]
    expected = tuple(Shard(target.dim) if i == mesh_dim else p for i, p in enumerate(placements)) \
        if isinstance(target, _StridedShard) and target.split_factor == 2 else None
    if expected is None or tuple(value.placements) != expected:
        raise ValueError(f"blocks_to_halves: placements must split by halves over tp (_StridedShard(dim, "
                         f"split_factor=2)) and value's be the same with Shard(dim) there; got placements "
                         f"{placements}, value's {tuple(value.placements)}")
    _check_halves("blocks_to_halves", value, mesh_dim, target.dim)
    return _regroup(value, mesh_dim, target.dim, placements, to_blocks=False)


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """``value`` whole on every rank: a DTensor gathered (a collective: every rank of its mesh takes part; one split
    by halves over ``tp`` through :func:`halves_to_blocks` first), any other tensor as it is.

    Example (under ``torchrun``)::

        grads = [full_tensor(p.grad) for p in model.parameters()]
    """
    return halves_to_blocks(value).full_tensor() if isinstance(value, DTensor) else value


# ---------------------------------------------------------------- refusals


def tensor_parallel_refusal(model: nn.Module, tp: int) -> Optional[str]:
    """Why ``model``'s blocks cannot split over ``tp`` ranks (None: they can): a mixer without a plan, or heads
    (S4: channels), KV heads or hidden units that ``tp`` does not divide, each naming its layer."""
    if tp == 1:
        return None
    for i, block in enumerate(_blocks(model)):
        mixer = block.mixer
        name = type(mixer).name or type(mixer).__name__
        if name not in PLANS:
            return f"parallel.tp = {tp} has no plan for layer {i}'s mixer {name!r} ({type(mixer).__name__})"
        units = PLANS[name](mixer).units
        heads = mixer.args.num_heads
        kv = getattr(mixer, "num_kv_heads", heads)
        counts = [units] if units is not None else [("heads", heads), ("KV heads", kv)]
        for what, count in counts:
            if count % tp:
                return f"parallel.tp = {tp} must divide the {what} of every layer: layer {i} ({name}) has {count}"
        mlp = block.mlp
        what, width = (("moe.intermediate_size", mlp.args.intermediate_size) if isinstance(mlp, MoEFeedForward)
                       else ("intermediate_size", mlp.down.weight.shape[1]))  # a SwiGLU: down [D, F]
        if width % tp:
            return f"parallel.tp = {tp} must divide the feed-forward's hidden units: layer {i}'s {what} is {width}"
    return None


def splits_halves_by_rows(mixer: Mixer) -> bool:
    """Whether ``mixer``'s plan splits a weight by halves along its rows (Mamba's [x; z] input projection), which
    FSDP2 then shards along its input width, as a SwiGLU's [gate; up]."""
    return any(isinstance(split, Halves) and split.dim == 0 for split in PLANS[type(mixer).name](mixer).params.values())


# ---------------------------------------------------------------- the regions


@dataclass
class _Local:
    """One parameter of a region as the rank computes with it: ``owner._parameters[name]`` replaced, while the
    region runs, by its local tensor (a DTensor's), its rows (``index`` along ``dim``) or itself with gradients
    summed."""

    owner: nn.Module
    name: str
    index: Optional[torch.Tensor] = None  # Rows: the rank's rows
    dim: int = 0

    def value(self, param: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        if isinstance(param, DTensor):
            return param.to_local()
        whole = sum_gradients(param, group)
        return whole if self.index is None else whole.index_select(self.dim, self.index)


class _TensorParallelForward:
    """A region: its parameters local while it runs; with ``reduce``, the gradients of its floating-point
    positional inputs (the layer input; MoM's routing weights) summed over the ranks (f); with ``output``, its
    output summed over the ranks (g) and that projection's bias added after the sum."""

    def __init__(self, forward: Callable[..., torch.Tensor], params: list[_Local], group: ProcessGroup,
                 output: Optional[nn.Module], reduce: bool) -> None:
        self.forward, self.params, self.group, self.output, self.reduce = forward, params, group, output, reduce

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.reduce:
            args = tuple(sum_gradients(a, self.group) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                         for a in args)
        saved = [(p.owner, p.name, p.owner._parameters[p.name]) for p in self.params]
        bias = None if self.output is None else self.output._parameters.get("bias")
        try:
            for (owner, name, param), local in zip(saved, self.params):
                owner._parameters[name] = local.value(param, self.group)
            if bias is not None:
                self.output._parameters["bias"] = None  # added once, after the ranks' partial outputs are summed
            out = self.forward(*args, **kwargs)
        finally:
            for owner, name, param in saved:
                owner._parameters[name] = param
            if bias is not None:
                self.output._parameters["bias"] = bias
        if self.output is None:
            return out
        out = sum_partials(out, self.group)
        return out if bias is None else out + bias.to(out.dtype)


class _Summed:
    """The forward of a row-parallel linear map called as a module inside a region: its product on the rank's
    input columns, summed over the ranks by ``collective``, then its bias added once. An output projection the
    forward goes on after (:func:`sum_partials`, Megatron's g: the gradient, the same on every rank, passes back
    unchanged) or a map whose output the rank's heads need whole (:func:`all_reduce_sum`: the gradients, each
    rank's from its heads, summed too)."""

    def __init__(self, linear: nn.Linear, group: ProcessGroup,
                 collective: Callable[[torch.Tensor, ProcessGroup], torch.Tensor]) -> None:
        self.linear, self.forward, self.group, self.collective = linear, linear.forward, group, collective

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.linear._parameters.get("bias")
        if bias is not None:
            self.linear._parameters["bias"] = None  # added once, after the ranks' partial products are summed
        try:
            out = self.forward(x)
        finally:
            if bias is not None:
                self.linear._parameters["bias"] = bias
        out = self.collective(out, self.group)
        return out if bias is None else out + bias.to(out.dtype)


class _WidthRMSNorm:
    """The forward of an RMSNorm over the width of all heads when each rank holds a share of it: the mean square
    is summed over the ranks (one all-reduce per call), then each rank scales its channels by its weight share."""

    def __init__(self, norm: RMSNorm, width: int, group: ProcessGroup) -> None:
        self.norm, self.width, self.group = norm, width, group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(acc)
        mean_square = all_reduce_sum(xf.square().sum(-1, keepdim=True), self.group) / self.width
        return (xf * torch.rsqrt(mean_square + self.norm.eps) * self.norm.weight.to(acc)).to(x.dtype)


def _split(module: nn.Module, plan: Plan, mesh: DeviceMesh, *, reduce: bool) -> None:
    """Distribute ``module``'s parameters as ``plan`` says and make its ``plan.method`` a region; with ``reduce``,
    the ranks' partial outputs are summed (at the region's end, or where the output projection computes them)."""
    group, rank, ranks = mesh.get_group(), mesh.get_local_rank(), mesh.size()
    output = module.get_submodule(plan.output) if plan.output is not None else None
    if not reduce and output is not None and output.bias is not None:
        raise ValueError(f"tensor parallelism: {plan.output} of a region whose caller sums the ranks' outputs "
                         "has a bias, which every rank would add")
    output_bias = f"{plan.output}.bias"  # added after the sum, the same on every rank: its gradient too
    params: list[_Local] = []
    for full_name, param in list(module.named_parameters()):
        owner_name, _, name = full_name.rpartition(".")
        owner = module.get_submodule(owner_name)
        split = plan.params.get(full_name)
        if isinstance(split, Replicated) or (reduce and full_name == output_bias):
            continue
        if isinstance(split, (Heads, Halves)):
            sharded = distribute_tensor(param.detach(), mesh, tp_placements(split))
            setattr(owner, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
            params.append(_Local(owner, name))
        elif isinstance(split, Rows):
            index = torch.tensor(split.index(rank, ranks), dtype=torch.long, device=param.device)
            params.append(_Local(owner, name, index, split.dim))
        else:
            params.append(_Local(owner, name))
    for name in plan.norms:
        norm = module.get_submodule(name)
        norm.forward = _WidthRMSNorm(norm, norm.weight.shape[0], group)
    for name in plan.sums:
        linear = module.get_submodule(name)
        linear.forward = _Summed(linear, group, all_reduce_sum)
    if reduce and output is not None and plan.output_inside:
        output.forward = _Summed(output, group, sum_partials)
    summed = output if reduce and not plan.output_inside else None
    setattr(module, plan.method, _TensorParallelForward(getattr(module, plan.method), params, group, summed, reduce))


def _tensor_parallel_experts(moe: nn.Module, mesh: ParallelMesh) -> None:
    """An expert-parallel MoE layer's experts split by hidden units (``gate_up: [E, 2F, D]`` by halves,
    ``down: [E, D, F]`` by columns) over ``mesh.tp``; experts already split over ``mesh.ep`` become DTensors on
    the 2-D ``(ep, tp)`` mesh, split both ways. Its shared experts become a region without sums (the layer sums
    once, routed and shared outputs together); its router stays whole."""
    by_expert = isinstance(moe.gate_up, DTensor)
    experts = mesh.root["ep", "tp"] if by_expert else mesh.tp
    for name, split in (("gate_up", Halves(1)), ("down", Heads(2))):
        param = getattr(moe, name).detach()
        full = param.full_tensor() if by_expert else param  # every rank the same weights (as before ep)
        placements = [Shard(0), *tp_placements(split)] if by_expert else tp_placements(split)
        setattr(moe, name, nn.Parameter(distribute_tensor(full, experts, placements)))
    moe.tp_group = mesh.tp.get_group()
    if moe.shared is not None:
        _split(moe.shared, _swiglu(), mesh.tp, reduce=False)


def apply_tp(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig) -> nn.Module:
    """Tensor parallelism, in place, over ``mesh.tp`` (``config.tp`` ranks; 1: nothing); returns the model.

    Every block's mixer and feed-forward becomes a region (see the module docstring): split parameters become
    DTensors on ``mesh.tp``, each mixer computes ``heads / tp`` heads (:attr:`Mixer.heads`: its share). MoE
    layers must be :class:`~linmem.distributed.expert.ExpertParallelMoE` already (``apply_expert_parallel``).
    Call before FSDP2, which then shards these DTensors over the data ranks.

    Args:
        model: a :class:`~linmem.models.LinmemForCausalLM`, the same weights on every rank.
        mesh: the run's :class:`~linmem.distributed.config.ParallelMesh`.
        config: its :class:`~linmem.distributed.config.ParallelConfig`; refused layouts raise
            :class:`~linmem.distributed.config.ParallelConfigError` (see :func:`tensor_parallel_refusal`).
    """
    if config.tp == 1:
        return model
    refusal = tensor_parallel_refusal(model, config.tp)
    if refusal is not None:
        raise ParallelConfigError(refusal)
    tp = mesh.tp
    rank = tp.get_local_rank()
    for block in _blocks(model):
        mixer: Mixer = block.mixer
        plan = PLANS[type(mixer).name](mixer)
        _split(mixer, plan, tp, reduce=True)
        share = (mixer.args.num_heads if plan.units is None else plan.units[1]) // config.tp
        for module in mixer.modules():  # the mixer, and a mixture's rule
            if isinstance(module, Mixer):
                module.heads = slice(rank * share, (rank + 1) * share)
        if isinstance(block.mlp, MoEFeedForward):
            if not isinstance(block.mlp, ExpertParallelMoE):
                raise TypeError("apply_tp: MoE layers must be made expert-parallel first (apply_expert_parallel)")
            _tensor_parallel_experts(block.mlp, mesh)
        else:
            _split(block.mlp, _swiglu(), tp, reduce=True)
    return model


def _blocks(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", model)
    return list(inner.layers)
