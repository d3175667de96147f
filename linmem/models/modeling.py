"""One configurable model for every architecture: a stack of (mixer, feed-forward) blocks whose
mixers follow the config's layer pattern.

The model relies on small protocols rather than on the types of its parts: a feed-forward takes
``(x, token_mask)``; a routed module (a MoM mixer, a MoE feed-forward) leaves a
:class:`~linmem.ops.routing.RouterStats` in ``router_stats`` after each call, which the model
collects layer by layer, returns, and adds (its weighted balancing and z-losses) to ``loss`` as
``aux_loss``; a module whose tokens use only part of its parameters says how many they leave idle
with ``inactive_parameter_count()``.

The decoding cache is passed and returned under the name the installed transformers gives it
(:data:`~linmem.models.outputs.CACHE_NAME`: ``cache`` from 5.x, ``past_key_values`` before); both are accepted as input.

The forwards follow transformers' conventions: ``output_hidden_states``, ``return_dict`` and ``use_cache``
default to the config's; ``return_dict=False`` returns the output's ``to_tuple()`` (the loss first when there is
one). The models compute no attention weights: ``output_attentions=True``, as an argument or in the config, is
refused (:func:`refuse_attention_outputs`), as transformers' recurrent models document.
"""

from __future__ import annotations

import pickle
from functools import partial
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import ModelOutput

from ..generation import generation_forward, prepare_generation_cache
from ..layers import LayerState, build_mixer
from ..layers.init import Linear, normal_init
from ..layers.moe import MoEFeedForward, SwiGLU
from ..layers.norms import RMSNorm
from ..layers.recurrent import activation_dtype
from ..ops.checks import values_checkable as _values_checkable
from ..ops.fused import linear_cross_entropy
from ..ops.routing import RouterStats
from ..ops.varlen import positions_in_sequence
from .cache import LinmemCache, StaticLinmemCache
from .config import LinmemConfig
from .outputs import CACHE_NAME, LinmemCausalLMOutput, LinmemModelOutput, output_cache


def refuse_attention_outputs(output_attentions: Optional[bool], config: LinmemConfig) -> None:
    """A ValueError when attention weights are asked for (``output_attentions`` True, or None and the config's
    True): memory layers have none, and the attention layers' fused kernels never form them.

    Example:
        >>> refuse_attention_outputs(None, LinmemConfig(hidden_size=32, num_heads=2, layer_pattern="L"))
    """
    asked = config.output_attentions if output_attentions is None else output_attentions
    if asked:
        where = "" if output_attentions else " (the config's `output_attentions`)"
        raise ValueError(f"`output_attentions` must be False for linmem models, got True{where}: memory layers have no "
                         "attention weights and the attention layers' kernels never form them; read "
                         "`output_hidden_states` instead")


def _tuple_or_output(output: ModelOutput, return_dict: Optional[bool], config: LinmemConfig):
    """``output`` itself, or its ``to_tuple()`` when ``return_dict`` (default: the config's) is False."""
    keep = config.return_dict if return_dict is None else return_dict
    return output if keep else output.to_tuple()


def _one_cache(cache: Optional[LinmemCache], past_key_values: Optional[LinmemCache]) -> Optional[LinmemCache]:
    if cache is not None and past_key_values is not None:
        raise ValueError("give the decoding cache once: `cache` or `past_key_values` (its name before transformers 5)")
    return cache if cache is not None else past_key_values


class LinmemBlock(GradientCheckpointingLayer):
    """Pre-norm residual block: h + mixer(norm(h)), then h + mlp(norm(h)).

    The residual stream h travels between blocks as two tensors, (the last block's output, the stream
    before it), so that each add is fused into the next norm (:meth:`RMSNorm.add_and_norm`).

    With activation checkpointing (``config.activation_checkpointing`` or
    ``model.gradient_checkpointing_enable()``) a training forward keeps only the block's inputs
    and recomputes the block in the backward pass.
    """

    def __init__(self, config: LinmemConfig, layer_idx: int) -> None:
        super().__init__()
        self.mixer_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mixer = build_mixer(config.mixer_name(layer_idx), config.mixer_args(layer_idx))
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = (MoEFeedForward(config.moe_args()) if config.mlp == "moe"
                    else SwiGLU(config.hidden_size, config.mlp_width, config.initializer_range))

    def forward(
        self,
        hidden: torch.Tensor,
        residual: Optional[torch.Tensor],
        *,
        cu_seqlens: Optional[torch.Tensor],
        cache: Optional[LayerState],
        token_mask: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the previous block's output (the embeddings in the first block), residual: the stream
        before it (None in the first block), both [B, T, D] -> (this block's output, the stream before it)."""
        x, residual = self.mixer_norm.add_and_norm(hidden, residual)
        if token_mask is not None:  # padded tokens enter no state
            x = x * token_mask[..., None].to(x.dtype)
        mixed = self.mixer(x, cu_seqlens=cu_seqlens, cache=cache, token_mask=token_mask, position_ids=position_ids)
        x, residual = self.mlp_norm.add_and_norm(mixed, residual)
        return self.mlp(x, token_mask), residual

    def pop_router_stats(self) -> list[RouterStats]:
        """What the block's routed modules reported in the last call; cleared as read."""
        stats = []
        for module in (self.mixer, self.mlp):
            report = getattr(module, "router_stats", None)
            if report is not None:
                stats.append(report)
                module.router_stats = None
        return stats


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # the files from_pretrained reads weights from


def _check_config_file(folder: Path, config: object) -> None:
    """A local model folder read without an explicit ``config`` must hold ``config.json``."""
    path = folder / "config.json"
    if config is None and folder.is_dir() and not path.is_file():
        raise FileNotFoundError(f"{path} not found: a model folder needs the config that save_pretrained "
                                f"writes beside the weights (or pass config=LinmemConfig(...))")


class LinmemPreTrainedModel(PreTrainedModel):
    """Each module initialises its parameters in ``reset_parameters()`` (the mixers as their papers
    do); ``_init_weights`` calls it for the modules a checkpoint leaves incomplete."""

    config_class = LinmemConfig
    base_model_prefix = "model"
    _no_split_modules = ["LinmemBlock"]
    _supports_cache_class = True
    _is_stateful = True
    supports_gradient_checkpointing = True

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """As PreTrainedModel's; a local folder without ``config.json`` (and no ``config=`` given) raises a
        FileNotFoundError naming it before a model is built, and weights that cannot be read (a damaged or
        cut safetensors file, a pickle that the weights-only load refuses) raise an OSError that names the
        folder and its weight files."""
        if pretrained_model_name_or_path is not None:  # None: weights from ``state_dict=``, a config from ``config=``
            _check_config_file(Path(pretrained_model_name_or_path, kwargs.get("subfolder") or ""), kwargs.get("config"))
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except (SafetensorError, pickle.UnpicklingError) as err:
            folder = Path(pretrained_model_name_or_path)
            files = sorted(p.name for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES) if folder.is_dir() else []
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise OSError(f"cannot read the weights in {folder} ({', '.join(files) or 'no weight file'}): "
                          f"{reason}") from err

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Initialise ``module`` as its constructor does, keeping every parameter already loaded.

        transformers calls this for every module (children first) after building a model and for the
        modules whose parameters a checkpoint lacks (it marks the loaded ones ``_is_hf_initialized``).
        """
        if isinstance(module, nn.Embedding):
            reset = partial(nn.init.normal_, module.weight, std=self.config.initializer_range)
        elif callable(getattr(module, "reset_parameters", None)):
            reset = module.reset_parameters
        else:
            return
        params = list(module.parameters())
        loaded = [p for p in params if getattr(p, "_is_hf_initialized", False)]
        if params and len(loaded) == len(params):
            return
        kept = [p.detach().clone() for p in loaded]
        reset()
        for p, value in zip(loaded, kept):
            p.copy_(value)


class LinmemModel(LinmemPreTrainedModel):
    """Embeddings -> blocks -> final norm. Returns hidden states [B, T, D]."""

    def __init__(self, config: LinmemConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LinmemBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()
        if config.activation_checkpointing:
            for layer in self.layers:  # the attributes transformers' gradient_checkpointing_enable sets
                layer.gradient_checkpointing = True
                layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        cache: Optional[LinmemCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        past_key_values: Optional[LinmemCache] = None,
        output_attentions: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        **kwargs,
    ) -> LinmemModelOutput | tuple:
        """input_ids: [B, T] (or inputs_embeds [B, T, D]); attention_mask: [B, past + T] 1 = token, 0 = pad;
        cu_seqlens: [N + 1] boundaries of packed sequences (B == 1; no decoding cache).

        ``use_cache`` defaults to the config's in eval mode without ``cu_seqlens`` (and to True with a
        ``cache``); ``output_hidden_states`` and ``return_dict`` default to the config's;
        ``output_attentions=True`` is refused (:func:`refuse_attention_outputs`); ``past_key_values`` is the
        name transformers before 5.x gives ``cache``. Other keywords transformers passes (``cache_position``,
        ...) are accepted and unused.
        """
        refuse_attention_outputs(output_attentions, self.config)
        cache = _one_cache(cache, past_key_values)
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        hidden = self._embed(input_ids, inputs_embeds)
        B, T = hidden.shape[:2]
        if cu_seqlens is not None:
            if B != 1:
                raise ValueError(f"`cu_seqlens` packs sequences along T and needs batch size 1, got {B}")
            if use_cache or cache is not None:
                raise ValueError("packed sequences (`cu_seqlens`) keep no decoding cache; pass use_cache=False "
                                 "and no `cache`, or decode a padded batch with `attention_mask`")
        if use_cache is None:
            use_cache = cache is not None or (self.config.use_cache and not self.training and cu_seqlens is None)
        if use_cache and cache is None:
            cache = LinmemCache(self.config.num_hidden_layers)
        if isinstance(cache, StaticLinmemCache):
            cache.check_room(T)  # before any layer writes its part of the cache
        past = cache.get_seq_length() if cache is not None else 0
        token_mask = _token_mask(attention_mask, B, T)
        if position_ids is None:
            position_ids = _positions(B, T, past, attention_mask, cu_seqlens, hidden.device)

        all_hidden, router_stats = [], []
        residual = None  # the stream is residual + hidden (hidden alone before the first block)
        for i, layer in enumerate(self.layers):
            if output_hidden_states:
                all_hidden.append(_stream(hidden, residual))
            hidden, residual = layer(hidden, residual, cu_seqlens=cu_seqlens, cache=cache[i] if use_cache else None,
                                     token_mask=token_mask, position_ids=position_ids)
            router_stats += layer.pop_router_stats()
        hidden = self.norm.add_and_norm(hidden, residual, out_dtype=None if residual is None else residual.dtype)[0]
        if use_cache:
            cache.advance(T, token_mask)
        if output_hidden_states:
            all_hidden.append(hidden)
        output = LinmemModelOutput(
            last_hidden_state=hidden,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            router_stats=tuple(router_stats) or None,
            **{CACHE_NAME: cache if use_cache else None},
        )
        return _tuple_or_output(output, return_dict, self.config)

    def _embed(self, input_ids: Optional[torch.Tensor], inputs_embeds: Optional[torch.Tensor]) -> torch.Tensor:
        """The input as ``[B, T, D]`` hidden states; empty inputs and ids outside the vocabulary are refused."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of `input_ids` and `inputs_embeds`")
        given = input_ids if input_ids is not None else inputs_embeds
        name = "input_ids" if input_ids is not None else "inputs_embeds"
        rank = 2 if input_ids is not None else 3
        if given.dim() != rank or given.shape[0] == 0 or given.shape[1] == 0:
            raise ValueError(f"`{name}` must be a non-empty {'[B, T]' if rank == 2 else '[B, T, D]'} tensor with "
                             f"B, T >= 1, got shape {list(given.shape)}")
        if inputs_embeds is not None:
            if inputs_embeds.shape[-1] != self.config.hidden_size:
                raise ValueError(f"`inputs_embeds` must be [B, T, hidden_size = {self.config.hidden_size}], "
                                 f"got shape {list(inputs_embeds.shape)}")
            return inputs_embeds
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"`input_ids` must hold integer token ids, got dtype {input_ids.dtype}")
        if input_ids.numel() and _values_checkable(input_ids):  # CPU ids; on a GPU under debug checks (a sync)
            low, high = torch.stack(torch.aminmax(input_ids)).tolist()
            if low < 0 or high >= self.config.vocab_size:
                bad = low if low < 0 else high
                raise ValueError(f"`input_ids` must lie in [0, vocab_size = {self.config.vocab_size}), got {bad}")
        return self.embed_tokens(input_ids)


def _stream(hidden: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
    """The residual stream from its two parts (as :meth:`RMSNorm.add_and_norm` adds them)."""
    return hidden if residual is None else hidden.to(residual.dtype) + residual


def _token_mask(attention_mask: Optional[torch.Tensor], B: int, T: int) -> Optional[torch.Tensor]:
    """[B, T] bool of the current tokens, or None when nothing is padded."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
        raise ValueError(f"`attention_mask` must be [B, past + T] of 0/1 with B = {B} and past + T >= T = {T}, "
                         f"got shape {list(attention_mask.shape)}")
    mask = attention_mask[:, -T:].bool()
    return None if bool(mask.all()) else mask


def _positions(B, T, past, attention_mask, cu_seqlens, device) -> torch.Tensor:
    """Positions of the current tokens: restart per packed sequence, skip left padding."""
    if cu_seqlens is not None:
        return positions_in_sequence(T, cu_seqlens, device)[None]
    if attention_mask is not None:
        positions = attention_mask.long().cumsum(-1) - 1
        return positions.clamp(min=0)[:, -T:]
    return (torch.arange(T, device=device) + past)[None].expand(B, T)


class LinmemForCausalLM(LinmemPreTrainedModel, GenerationMixin):
    """A causal language model over :class:`LinmemModel`.

    Example:
        >>> import torch
        >>> from linmem.models import LinmemConfig, LinmemForCausalLM
        >>> config = LinmemConfig(vocab_size=256, hidden_size=64, num_heads=2, layer_pattern="LLN")
        >>> model = LinmemForCausalLM(config).eval()
        >>> ids = torch.randint(0, 256, (1, 8))
        >>> model(ids, labels=ids).loss.shape
        torch.Size([])
        >>> model.generate(ids, max_new_tokens=4, do_sample=False).shape
        torch.Size([1, 12])
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: LinmemConfig) -> None:
        super().__init__(config)
        self.model = LinmemModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, init=normal_init(config.initializer_range))
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own LinmemCache

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, generation_mode, batch_size: int,
                                      max_cache_length: int) -> None:
        """``generate()``'s cache: ``cache_implementation="static"`` builds a
        :class:`~linmem.models.cache.StaticLinmemCache` of ``max_cache_length`` tokens; without one (or
        ``"dynamic"``) the model makes its own :class:`LinmemCache` on the first call."""
        prepare_generation_cache(self, generation_config, model_kwargs, batch_size, max_cache_length)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        cache: Optional[LinmemCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        logits_to_keep: int = 0,
        output_router_logits: Optional[bool] = None,
        past_key_values: Optional[LinmemCache] = None,
        return_logits: Optional[bool] = None,
        shift_labels: Optional[torch.LongTensor] = None,
        num_items_in_batch: Optional[int | torch.Tensor] = None,
        output_attentions: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        **kwargs,
    ) -> LinmemCausalLMOutput | tuple:
        """Logits [B, T, vocab]; with ``labels`` [B, T] (-100 = ignore) the next-token loss.

        Labels are shifted inside: position t predicts label t + 1. Under ``cu_seqlens``
        the last token of a sequence predicts nothing of the next one. ``shift_labels`` [B, T] are targets already
        shifted (position t predicts ``shift_labels[:, t]``; what transformers' Trainer passes under context
        parallelism): given, with or without ``labels``, they are the loss's targets and ``labels`` are not read,
        as in transformers' ``ForCausalLMLoss``. The loss is the mean over the targets, or their sum divided by
        ``num_items_in_batch`` when given (the Trainer's count over its gradient-accumulation steps).
        With a loss the logits are computed chunk by chunk from the hidden states
        (:func:`linmem.ops.fused.linear_cross_entropy`), so the ``[B, T, vocab]`` logits are never materialised and
        ``logits`` is None, unless ``return_logits`` is True (default: logits only without a loss).
        ``logits_to_keep`` keeps the logits of the last positions only. With routed layers
        (MoM, MoE) ``aux_loss`` is their weighted balancing and z-losses, and it is part of
        ``loss`` (set its coefficients to 0 to train without); ``output_router_logits``
        (default: the config's) also returns every routed layer's logits ``[B * T, E]``.
        ``output_hidden_states``, ``use_cache`` and ``return_dict`` default to the config's (``return_dict=False``:
        the output's ``to_tuple()``, the loss first); ``output_attentions=True`` is refused.
        The decoding cache comes back under :data:`CACHE_NAME` (read it with :func:`output_cache`).
        With a cache and ``logits_to_keep`` > 0, a prompt longer than the cache's ``prefill_chunk`` runs in
        chunks; a one-token step against a :class:`~linmem.models.cache.StaticLinmemCache` is replayed from a
        CUDA graph on CUDA (:func:`linmem.generation.generation_forward`).
        """
        refuse_attention_outputs(output_attentions, self.config)
        cache = _one_cache(cache, past_key_values)
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        wants_loss = labels is not None or shift_labels is not None
        served = None if wants_loss else generation_forward(
            self, input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
            position_ids=position_ids, cache=cache, use_cache=use_cache, cu_seqlens=cu_seqlens,
            output_hidden_states=output_hidden_states, output_router_logits=output_router_logits,
            logits_to_keep=logits_to_keep,
        )
        if served is not None:
            return _tuple_or_output(served, return_dict, self.config)
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            cache=cache, inputs_embeds=inputs_embeds, cu_seqlens=cu_seqlens,
            use_cache=use_cache, output_hidden_states=output_hidden_states, return_dict=True,
        )
        hidden = out.last_hidden_state
        stats = out.router_stats or ()
        aux_loss = router_aux_loss(stats, self.config) if stats else None
        loss = logits = None
        if wants_loss:
            loss = self.lm_loss(hidden, labels, cu_seqlens, shift_labels=shift_labels,
                                num_items_in_batch=num_items_in_batch)
            if aux_loss is not None:
                loss = loss + aux_loss
        if return_logits is None:
            return_logits = not wants_loss
        if return_logits:
            logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        output = LinmemCausalLMOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states,
            aux_loss=aux_loss, router_logits=tuple(s.logits for s in stats) if output_router_logits and stats else None,
            router_stats=out.router_stats, **{CACHE_NAME: output_cache(out)},
        )
        return _tuple_or_output(output, return_dict, self.config)

    def lm_loss(self, hidden: torch.Tensor, labels: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor] = None,
                *, shift_labels: Optional[torch.Tensor] = None,
                num_items_in_batch: Optional[int | torch.Tensor] = None) -> torch.Tensor:
        """The next-token cross-entropy of ``lm_head(hidden)`` (the value of :func:`causal_lm_loss`) without the
        full logits: hidden [B, T, D], labels [B, T] (or ``shift_labels`` [B, T], already shifted) -> an fp32
        scalar, the mean over the targets or their sum / ``num_items_in_batch``.

        The logits' matmuls run in the activation dtype (autocast's when it is on), the log-sum-exp in fp32.
        """
        targets = loss_targets(labels, shift_labels, hidden.shape[:2], cu_seqlens)
        dtype = activation_dtype(hidden)
        reduction = "mean" if num_items_in_batch is None else "sum"
        with torch.autocast(hidden.device.type, enabled=False):  # the chunks pick their own dtypes
            loss = linear_cross_entropy(hidden.flatten(0, 1).to(dtype), self.lm_head.weight.to(dtype),
                                        targets.flatten(), reduction=reduction)
        return loss if num_items_in_batch is None else loss / num_items_in_batch

    def num_active_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameters one token uses: all, less those its routed modules leave idle.

        ``exclude_embeddings`` also leaves out the input embedding and an untied ``lm_head``.
        Works on the meta device.
        """
        idle = sum(m.inactive_parameter_count() for m in self.modules() if hasattr(m, "inactive_parameter_count"))
        return self.num_all_parameters(exclude_embeddings) - idle

    def num_all_parameters(self, exclude_embeddings: bool = False) -> int:
        """Every parameter (tied ones once); ``exclude_embeddings`` as in :meth:`num_active_parameters`."""
        embeddings = {self.model.embed_tokens.weight, self.lm_head.weight} if exclude_embeddings else set()
        return sum(p.numel() for p in self.parameters() if p not in embeddings)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        cache: Optional[LinmemCache] = None,
        attention_mask: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        use_cache: bool = True,
        past_key_values: Optional[LinmemCache] = None,
        position_ids: Optional[torch.LongTensor] = None,
        **kwargs,
    ) -> dict:
        """The inputs of one forward call of ``generate()``: the tokens the cache has not seen (the prompt's
        ``inputs_embeds`` on the first call), their ``position_ids`` when given, the attention mask, the cache, and
        every other keyword as given (``output_hidden_states``, ``logits_to_keep``, a caller's own), except those
        that only steer ``generate()`` (:data:`GENERATE_ONLY_KEYWORDS`).

        Example:
            >>> model = LinmemForCausalLM(LinmemConfig(vocab_size=32, hidden_size=32, num_heads=2, layer_pattern="L"))
            >>> inputs = model.prepare_inputs_for_generation(torch.tensor([[1, 2, 3]]), output_hidden_states=True)
            >>> inputs["input_ids"].tolist(), inputs["output_hidden_states"]
            ([[1, 2, 3]], True)
        """
        cache = _one_cache(cache, past_key_values)
        seen = cache.get_seq_length() if cache is not None else 0
        inputs = {key: value for key, value in kwargs.items() if key not in GENERATE_ONLY_KEYWORDS}
        if inputs_embeds is not None and seen == 0:
            inputs["inputs_embeds"] = inputs_embeds
        else:
            inputs["input_ids"] = _unseen_tokens(input_ids, inputs_embeds, seen)
        if position_ids is not None:
            new = (inputs_embeds if "inputs_embeds" in inputs else inputs["input_ids"]).shape[1]
            inputs["position_ids"] = position_ids[..., -new:]
        inputs.update({CACHE_NAME: cache, "attention_mask": attention_mask, "use_cache": use_cache})
        return inputs


#: keywords of ``prepare_inputs_for_generation`` that steer ``generate()`` and are not the model's inputs
GENERATE_ONLY_KEYWORDS = frozenset({"labels", "next_sequence_length", "is_first_iteration"})


def _unseen_tokens(input_ids: torch.Tensor, inputs_embeds: Optional[torch.Tensor], seen: int) -> torch.Tensor:
    """The tokens of ``input_ids [B, L]`` after the first ``seen`` positions of the sequence. ``input_ids`` hold the
    whole sequence, or, when the prompt was given as ``inputs_embeds`` alone, only the tokens generated after it
    (then no more than ``seen``: the cache has seen the prompt)."""
    whole_sequence = inputs_embeds is None or input_ids.shape[1] > seen
    return input_ids[:, seen if whole_sequence else seen - inputs_embeds.shape[1]:]


def router_aux_loss(stats: Sequence[RouterStats], config: LinmemConfig) -> torch.Tensor:
    """The routers' share of the loss, each kind averaged over its layers::

        mom.aux_loss_coef * mean(MoM balance) + moe.aux_loss_coef * mean(MoE balance)
        + moe.z_loss_coef * mean(MoE z-loss)
    """
    total = torch.zeros((), device=stats[0].balance_loss.device)
    mean = lambda values: torch.stack(values).mean()  # noqa: E731
    mom = [s for s in stats if s.kind == "mom"]
    moe = [s for s in stats if s.kind == "moe"]
    if mom:
        total = total + config.mom["aux_loss_coef"] * mean([s.balance_loss for s in mom])
    if moe:
        total = total + config.moe["aux_loss_coef"] * mean([s.balance_loss for s in moe])
        total = total + config.moe["z_loss_coef"] * mean([s.z_loss for s in moe])
    return total


def next_token_targets(labels: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                       ignore_index: int = -100) -> torch.Tensor:
    """The label each position predicts: ``targets[:, t] = labels[:, t + 1]``, ``ignore_index`` at the last
    position and at the last token of every packed sequence. labels [B, T] -> [B, T].

    Example:
        >>> next_token_targets(torch.tensor([[5, 6, 7, 8]]), torch.tensor([0, 2, 4])).tolist()
        [[6, -100, 8, -100]]
    """
    following = labels[:, 1:]
    if cu_seqlens is not None:  # the last token of each packed sequence has no target: the next one starts anew
        starts = positions_in_sequence(labels.shape[1], cu_seqlens, labels.device)[1:] == 0
        following = following.masked_fill(starts, ignore_index)
    return torch.cat([following, following.new_full((labels.shape[0], 1), ignore_index)], dim=1)


def loss_targets(labels: Optional[torch.Tensor], shift_labels: Optional[torch.Tensor], shape: Sequence[int],
                 cu_seqlens: Optional[torch.Tensor] = None, ignore_index: int = -100) -> torch.Tensor:
    """The label each of ``shape = [B, T]`` positions predicts: ``shift_labels`` [B, T] as given (already shifted,
    as transformers' ``ForCausalLMLoss`` takes them; ``labels`` are then not read), else
    :func:`next_token_targets` of ``labels`` [B, T].

    Example:
        >>> loss_targets(torch.tensor([[5, 6, 7]]), torch.tensor([[6, 7, -100]]), (1, 3)).tolist()
        [[6, 7, -100]]
    """
    name, given = ("shift_labels", shift_labels) if shift_labels is not None else ("labels", labels)
    if given is None:
        raise ValueError("a loss needs `labels` [B, T] or `shift_labels` [B, T], got neither")
    if tuple(given.shape) != tuple(shape) or given.dtype.is_floating_point or given.dtype == torch.bool:
        raise ValueError(f"`{name}` must be integer token ids of the inputs' shape [B, T] = {list(shape)}, "
                         f"got shape {list(given.shape)} and dtype {given.dtype}")
    return given if shift_labels is not None else next_token_targets(labels, cu_seqlens, ignore_index)


def causal_lm_loss(logits: torch.Tensor, labels: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor] = None,
                   ignore_index: int = -100, *, shift_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32) of logits [B, T, vocab] over the targets != ignore_index; the targets
    are ``shift_labels`` [B, T] when given, else ``labels`` [B, T] shifted (:func:`loss_targets`)."""
    targets = loss_targets(labels, shift_labels, logits.shape[:2], cu_seqlens, ignore_index)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=ignore_index)
