"""One configurable model for every architecture: a stack of (mixer, MLP) blocks whose
mixers follow the config's layer pattern (DESIGN section 5).

Routed layers (MoM mixers, MoE feed-forwards) leave a :class:`~linmem.ops.routing.RouterStats`
after each call; the model collects them layer by layer, returns them, and adds their weighted
balancing (and z-) losses to ``loss`` as ``aux_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from ..layers import LayerState, build_mixer
from ..layers.modules import RMSNorm, positions_in_sequence
from ..layers.moe import MoEFeedForward, SwiGLU
from ..layers.mom import MixtureOfMemories
from ..ops.routing import RouterStats
from .cache import LinmemCache
from .config import LinmemConfig


@dataclass
class LinmemModelOutput(BaseModelOutputWithPast):
    """BaseModelOutputWithPast plus the reports of the routed layers, in layer order."""

    router_stats: Optional[tuple[RouterStats, ...]] = None


@dataclass
class LinmemCausalLMOutput(CausalLMOutputWithPast):
    """CausalLMOutputWithPast plus what the routers (MoM mixers, MoE feed-forwards) report."""

    aux_loss: Optional[torch.FloatTensor] = None  # weighted balancing + z losses (already inside `loss`)
    router_logits: Optional[tuple[torch.FloatTensor, ...]] = None  # per routed layer [B * T, E]
    router_stats: Optional[tuple[RouterStats, ...]] = None  # per routed layer: losses and load


class LinmemBlock(nn.Module):
    """Pre-norm residual block: h + mixer(norm(h)), then h + mlp(norm(h))."""

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
        *,
        cu_seqlens: Optional[torch.Tensor],
        cache: Optional[LayerState],
        token_mask: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
    ) -> torch.Tensor:
        x = self.mixer_norm(hidden)
        if token_mask is not None:  # padded tokens enter no state
            x = x * token_mask[..., None].to(x.dtype)
        hidden = hidden + self.mixer(x, cu_seqlens=cu_seqlens, cache=cache, token_mask=token_mask,
                                     position_ids=position_ids)
        x = self.mlp_norm(hidden)
        return hidden + (self.mlp(x, token_mask) if isinstance(self.mlp, MoEFeedForward) else self.mlp(x))

    def pop_router_stats(self) -> list[RouterStats]:
        """What the block's routers (MoM mixer, MoE feed-forward) reported in the last call; cleared as read."""
        stats = []
        for module in (self.mixer, self.mlp):
            report = getattr(module, "router_stats", None)
            if report is not None:
                stats.append(report)
                module.router_stats = None
        return stats


class LinmemPreTrainedModel(PreTrainedModel):
    """Weights initialise in the constructors: each mixer owns the initialisation of its paper."""

    config_class = LinmemConfig
    base_model_prefix = "model"
    _no_split_modules = ["LinmemBlock"]
    _supports_cache_class = True
    _is_stateful = True

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=self.config.initializer_range)


class LinmemModel(LinmemPreTrainedModel):
    """Embeddings -> blocks -> final norm. Returns hidden states [B, T, D]."""

    def __init__(self, config: LinmemConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LinmemBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[LinmemCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: bool = False,
        **kwargs,
    ) -> LinmemModelOutput:
        """input_ids: [B, T] (or inputs_embeds [B, T, D]); attention_mask: [B, past + T] 1 = token, 0 = pad;
        cu_seqlens: [N + 1] boundaries of packed sequences (B == 1)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of `input_ids` and `inputs_embeds`")
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = hidden.shape[:2]
        if cu_seqlens is not None and B != 1:
            raise ValueError(f"`cu_seqlens` packs sequences along T and needs batch size 1, got {B}")
        use_cache = (not self.training) if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = LinmemCache(self.config.num_hidden_layers)
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        token_mask = _token_mask(attention_mask, T)
        if position_ids is None:
            position_ids = _positions(B, T, past, attention_mask, cu_seqlens, hidden.device)

        all_hidden, router_stats = [], []
        for i, layer in enumerate(self.layers):
            if output_hidden_states:
                all_hidden.append(hidden)
            hidden = layer(hidden, cu_seqlens=cu_seqlens, cache=past_key_values[i] if use_cache else None,
                           token_mask=token_mask, position_ids=position_ids)
            router_stats += layer.pop_router_stats()
        hidden = self.norm(hidden)
        if use_cache:
            past_key_values.seen_tokens += T
        if output_hidden_states:
            all_hidden.append(hidden)
        return LinmemModelOutput(
            last_hidden_state=hidden,
            past_key_values=past_key_values if use_cache else None,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            router_stats=tuple(router_stats) or None,
        )


def _token_mask(attention_mask: Optional[torch.Tensor], T: int) -> Optional[torch.Tensor]:
    """[B, T] bool of the current tokens, or None when nothing is padded."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(f"`attention_mask` must be [B, past + T] of 0/1, got shape {list(attention_mask.shape)}")
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
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        nn.init.normal_(self.lm_head.weight, std=config.initializer_range)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own LinmemCache

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
        past_key_values: Optional[LinmemCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: bool = False,
        logits_to_keep: int = 0,
        output_router_logits: Optional[bool] = None,
        **kwargs,
    ) -> LinmemCausalLMOutput:
        """Logits [B, T, vocab]; with ``labels`` [B, T] (-100 = ignore) the next-token loss.

        Labels are shifted inside: position t predicts label t + 1. Under ``cu_seqlens``
        the last token of a sequence predicts nothing of the next one. With routed layers
        (MoM, MoE) ``aux_loss`` is their weighted balancing and z-losses, and it is part of
        ``loss`` (set its coefficients to 0 to train without); ``output_router_logits``
        (default: the config's) also returns every routed layer's logits ``[B * T, E]``.
        """
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, cu_seqlens=cu_seqlens,
            use_cache=use_cache, output_hidden_states=output_hidden_states,
        )
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        stats = out.router_stats or ()
        aux_loss = router_aux_loss(stats, self.config) if stats else None
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels, cu_seqlens)
            if aux_loss is not None:
                loss = loss + aux_loss
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        return LinmemCausalLMOutput(
            loss=loss, logits=logits, past_key_values=out.past_key_values, hidden_states=out.hidden_states,
            aux_loss=aux_loss, router_logits=tuple(s.logits for s in stats) if output_router_logits and stats else None,
            router_stats=out.router_stats,
        )

    def num_active_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameters one token uses: all, less the experts and memories its routers leave out.

        ``exclude_embeddings`` also leaves out the input embedding and an untied ``lm_head``.
        Works on the meta device.
        """
        idle = sum(m.inactive_parameter_count() for m in self.modules()
                   if isinstance(m, (MoEFeedForward, MixtureOfMemories)))
        return self.num_all_parameters(exclude_embeddings) - idle

    def num_all_parameters(self, exclude_embeddings: bool = False) -> int:
        """Every parameter (tied ones once); ``exclude_embeddings`` as in :meth:`num_active_parameters`."""
        embeddings = {self.model.embed_tokens.weight, self.lm_head.weight} if exclude_embeddings else set()
        return sum(p.numel() for p in self.parameters() if p not in embeddings)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        past_key_values: Optional[LinmemCache] = None,
        attention_mask: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        use_cache: bool = True,
        **kwargs,
    ) -> dict:
        """Feed only the tokens the cache has not seen; positions follow the attention mask."""
        seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        inputs = {"past_key_values": past_key_values, "attention_mask": attention_mask, "use_cache": use_cache}
        if inputs_embeds is not None and seen == 0:
            inputs["inputs_embeds"] = inputs_embeds
        else:
            inputs["input_ids"] = input_ids[:, seen:]
        if kwargs.get("logits_to_keep") is not None:
            inputs["logits_to_keep"] = kwargs["logits_to_keep"]
        return inputs


def router_aux_loss(stats: Sequence[RouterStats], config: LinmemConfig) -> torch.Tensor:
    """The routers' share of the loss, each kind averaged over its layers::

        mom_aux_loss_coef * mean(MoM balance) + router_aux_loss_coef * mean(MoE balance)
        + router_z_loss_coef * mean(MoE z-loss)
    """
    total = torch.zeros((), device=stats[0].balance_loss.device)
    mean = lambda values: torch.stack(values).mean()  # noqa: E731
    mom = [s for s in stats if s.kind == "mom"]
    moe = [s for s in stats if s.kind == "moe"]
    if mom:
        total = total + config.mom_aux_loss_coef * mean([s.balance_loss for s in mom])
    if moe:
        total = total + config.router_aux_loss_coef * mean([s.balance_loss for s in moe])
        total = total + config.router_z_loss_coef * mean([s.z_loss for s in moe])
    return total


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                   ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32) over labels != ignore_index."""
    targets = labels[:, 1:].clone()
    if cu_seqlens is not None:  # the last token of each packed sequence has no target
        ends = cu_seqlens[1:-1].long() - 1
        targets[0, ends[(ends >= 0) & (ends < targets.shape[1])]] = ignore_index
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets.flatten(), ignore_index=ignore_index)
