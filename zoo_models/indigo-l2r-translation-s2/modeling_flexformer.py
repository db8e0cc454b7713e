"""The flexformers backbone: fairseq's encoder-decoder Transformer as a native Transformers v5 model.

Every method of the zoo extends this file at a named seam (see docs/ARCHITECTURE.md):

- sub-layer order as data (`sublayer_order`, `PerRowSublayerOrder`) — IOT;
- attention / feed-forward branches merged by weights (`num_branches`, `branch_weights`, `head_weights`) — MAT;
- additive relative-position bias on attention logits (`relative_position_bias`) and a decoder without absolute
  positions — InDIGO;
- a decoder loop built from `embed` / `run_layer` / `finalize`, with row subsets of the batch
  (`rows` + `StepKVCollector`) and `project_key_value` for copied states — Depth-Adaptive.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)
from transformers.utils import can_return_tuple, logging
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, OutputRecorder

from .configuration_flexformer import FlexformerConfig

from .backbone_blocks import FlexformerDecoderLayer, FlexformerEncoderLayer
from .backbone_sublayers import FlexformerAttention, FlexformerFeedForward
from .branch_merge import (
    checkpoint_in_current_layout,
    init_branched_linear,
)
from .cpu_kernels import (
    dropout,
    project_vocabulary,
)
from .generation_hooks import FlexformerGenerationMixin
from .kv_caches import (
    new_decoder_cache,
    static_cache_capacity,
)
from .losses import label_smoothed_nll_loss
from .output_recording import records_block_outputs
from .positional_embeddings import (
    LearnedPositionalEmbedding,
    build_positional_embedding,
)
from .transformers_compat import (
    CACHE_NAME,
    accepts_cache_argument,
    cache_field,
    drop_generation_position_arguments,
    output_cache,
)

logger = logging.get_logger(__name__)


# --------------------------------------------------------------------------------------------------------------------
# Encoder and decoder stacks
# --------------------------------------------------------------------------------------------------------------------


def host_sync_forbidden(tensor: torch.Tensor) -> bool:
    """True while `torch.compile` traces or a CUDA graph is being captured on `tensor`'s device: reading a device
    value on the host (a sync) is then not allowed, and code that would look at one takes the path that needs none."""
    return torch.compiler.is_compiling() or (tensor.is_cuda and torch.cuda.is_current_stream_capturing())


def padding_mask(attention_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Additive key mask `[batch, 1, 1, keys]` from a 0/1 mask, or None when nothing is masked (fast SDPA path).
    While compiling or capturing a CUDA graph the mask is built even when it hides nothing (the check is a sync)."""
    if attention_mask is None or (not host_sync_forbidden(attention_mask) and bool(attention_mask.all())):
        return None
    return additive_mask(attention_mask.bool()[:, None, None, :], dtype)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = may attend) as the additive logit mask: 0 where allowed, the dtype's minimum else."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def _layerdrop_skips(module: nn.Module, layerdrop: float) -> bool:
    return module.training and layerdrop > 0.0 and bool(torch.rand([]) < layerdrop)


class _TransformerStack(nn.Module):
    """What fairseq's encoder and decoder share: scaled token embeddings + positions (+ optional LayerNorm) →
    dropout, a stack of blocks, and a final LayerNorm for pre-norm."""

    side: str = ""
    input_name: str = "input_ids"
    #: What `output_hidden_states` / `output_attentions` collect, for Transformers' `capture_outputs` (as BART's
    #: stacks declare it). The recorders sit on the blocks, not on the attention modules: a block's weights are whole
    #: only once it returns them — IOT's per-row orders run an attention once per row group, and the block puts
    #: the groups' weights together.
    _can_record_outputs: dict = {}

    def __init__(self, config: FlexformerConfig, embed_tokens: nn.Embedding, components: BackboneComponents):
        super().__init__()
        # `capture_outputs` looks the recorders up by class in Transformers' registry, which a `PreTrainedModel`
        # fills when built; a stack is a plain module, so it registers its own.
        _CAN_RECORD_REGISTRY[self] = self._can_record_outputs
        self.config = config
        dim = getattr(config, f"{self.side}_embed_dim")
        self.padding_idx = config.pad_token_id
        self.dropout = config.dropout
        self.layerdrop = getattr(config, f"{self.side}_layerdrop")
        self.embed_scale = 1.0 if config.no_scale_embedding else math.sqrt(dim)
        self.embed_tokens = embed_tokens
        self.embed_positions = build_positional_embedding(config, self.side, dim)
        self.layernorm_embedding = nn.LayerNorm(dim) if config.layernorm_embedding else None
        layer_class = getattr(components, f"{self.side}_layer")
        self.layers = nn.ModuleList(
            [layer_class(config, i, components) for i in range(getattr(config, f"{self.side}_layers"))]
        )
        self.layer_norm = nn.LayerNorm(dim) if getattr(config, f"{self.side}_normalize_before") else None

    def _embed(
        self, input_ids, inputs_embeds, past_length: int | torch.Tensor, max_length: int | None = None,
        attention_mask: torch.Tensor | None = None,
    ):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError(f"pass exactly one of {self.input_name} and inputs_embeds to the {self.side}")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        # Passed-in embeddings are scaled like the model's own (fairseq's `forward_embedding`): `inputs_embeds` =
        # `embed_tokens(ids)` (PEFT prompt tuning, soft prompts, `generate(inputs_embeds=...)`) is `input_ids=ids`.
        hidden_states = inputs_embeds * self.embed_scale
        if self.embed_positions is not None:
            hidden_states = hidden_states + self.embed_positions(
                self._position_tokens(input_ids, inputs_embeds, attention_mask), past_length,
                dtype=hidden_states.dtype, max_length=max_length,
            )
        if self.layernorm_embedding is not None:
            hidden_states = self.layernorm_embedding(hidden_states)
        return dropout(hidden_states, self.dropout, self.training)

    def _position_tokens(self, input_ids, inputs_embeds, attention_mask) -> torch.Tensor:
        """What the positions are numbered from (padding keeps no position): the ids, or for passed-in embeddings
        stand-in ids where the 2-D padding mask (its last columns) has padding; no mask: every position is a token."""
        if input_ids is not None:
            return input_ids
        if attention_mask is None or attention_mask.dim() != 2:
            return inputs_embeds.new_full(inputs_embeds.shape[:2], self.padding_idx + 1, dtype=torch.long)
        is_token = attention_mask[:, -inputs_embeds.shape[1] :].bool()
        return torch.where(is_token, self.padding_idx + 1, self.padding_idx)


class FlexformerEncoder(_TransformerStack):
    """fairseq's `TransformerEncoder`: scaled token embeddings + positions → dropout → blocks → (pre-norm) LayerNorm."""

    side = "encoder"
    _can_record_outputs = {
        "hidden_states": OutputRecorder(FlexformerEncoderLayer, index=0, num_hidden_layers_key="encoder_layers"),
        "attentions": OutputRecorder(FlexformerEncoderLayer, index=1),
    }

    def embed(
        self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Scaled token embeddings (of `input_ids`, or the given unscaled `inputs_embeds`) + positions."""
        return self._embed(input_ids, inputs_embeds, 0, attention_mask=attention_mask)

    @records_block_outputs
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        sublayer_order=None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | list[int] | None = None,
    ) -> BaseModelOutput:
        """The encoder's states; `output_hidden_states` / `output_attentions` (collected by `capture_outputs`, see
        `_can_record_outputs`): the embeddings and every block's output (the last one through the final LayerNorm),
        every block's self-attention weights."""
        if output_attentions is None:
            output_attentions = self.config.output_attentions
        if attention_mask is None and input_ids is not None:
            attention_mask = input_ids.ne(self.padding_idx).long()
        hidden_states = self.embed(input_ids, inputs_embeds, attention_mask)
        mask = padding_mask(attention_mask, hidden_states.dtype)
        for layer in self.layers:
            if _layerdrop_skips(self, self.layerdrop):
                continue
            hidden_states, _ = layer(
                hidden_states, attention_mask=mask, sublayer_order=sublayer_order, output_attentions=output_attentions
            )
        if self.layer_norm is not None:
            hidden_states = self.layer_norm(hidden_states)
        return BaseModelOutput(last_hidden_state=hidden_states)


class FlexformerDecoder(_TransformerStack):
    """fairseq's `TransformerDecoder` without the output projection (the LM head lives in the top model).

    Its pieces — `embed`, `self_attention_mask`, `run_layer`, `finalize` — are public so a method can write its own
    layer loop (Depth-Adaptive early exit) without copying them.
    """

    side = "decoder"
    input_name = "decoder_input_ids"
    _can_record_outputs = {
        "hidden_states": OutputRecorder(FlexformerDecoderLayer, index=0, num_hidden_layers_key="decoder_layers"),
        "attentions": OutputRecorder(FlexformerDecoderLayer, index=1),
        "cross_attentions": OutputRecorder(FlexformerDecoderLayer, index=2),
    }

    def embed(
        self, input_ids: torch.Tensor | None, past_length: int | torch.Tensor = 0, inputs_embeds=None,
        max_length: int | None = None, attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Scaled token embeddings (of `input_ids`, or the given unscaled `inputs_embeds`) + positions after
        `past_length` cached tokens (a device tensor for a static cache, whose capacity `max_length` then bounds the
        positions); `attention_mask` marks the padding of passed-in embeddings."""
        return self._embed(input_ids, inputs_embeds, past_length, max_length, attention_mask)

    @staticmethod
    def self_attention_mask(
        batch_size: int, query_length: int, past_length: int | torch.Tensor, decoder_attention_mask, dtype, device,
        key_length: int | None = None,
    ) -> torch.Tensor | None:
        """Additive causal (+ padding) mask `[batch, 1, q, past+q]`; None when SDPA's own causal path is exact
        (no padding and either no past or a single query).

        `key_length`: a static cache's capacity. Its keys are always the whole buffer, so the mask is always built,
        `[batch, 1, q, key_length]`, hiding the slots not written yet; `past_length` may then be a device tensor,
        and no host sync is made (the decoding step compiles into one graph).

        A 4-D `decoder_attention_mask` is taken as already prepared (`[batch, 1, q, keys]`, boolean or additive):
        `generate()` builds one itself for a static cache."""
        if decoder_attention_mask is not None and decoder_attention_mask.dim() == 4:
            return decoder_attention_mask
        written = None  # [batch, key_length]: which key slots hold real (non-padding) tokens, None = all
        if key_length is None:  # a cache holding exactly the past: the keys are past + new, right-aligned in the mask
            key_length = past_length + query_length
            if decoder_attention_mask is not None and not bool(decoder_attention_mask[:, -key_length:].all()):
                written = decoder_attention_mask[:, -key_length:].bool()
            if written is None and (past_length == 0 or query_length == 1):
                return None
        elif decoder_attention_mask is not None:  # static: slots past the mask's end are hidden by the causal part
            written = decoder_attention_mask[:, :key_length].bool()
            written = torch.cat([written, written.new_ones(written.shape[0], key_length - written.shape[1])], dim=1)
        query_positions = (torch.arange(query_length, device=device) + past_length)[:, None]
        allowed = (torch.arange(key_length, device=device)[None, :] <= query_positions)[None, None]
        if written is not None:
            allowed = allowed & written[:, None, None, :]
        return additive_mask(allowed.expand(batch_size, 1, query_length, key_length), dtype)

    def run_layer(
        self, layer_idx: int, hidden_states: torch.Tensor, attention_mask=None, encoder_hidden_states=None,
        **layer_kwargs,
    ):
        """Run block `layer_idx`; returns (hidden_states, self-attention weights, cross-attention weights).

        The tensors the block differentiates through (its input and the encoder states) go in positionally: a
        reentrant checkpoint (`use_reentrant=True`) treats only positional tensors as the block's inputs, and would
        otherwise back-propagate into the encoder once per block while recomputing."""
        return self.layers[layer_idx](hidden_states, attention_mask, encoder_hidden_states, **layer_kwargs)

    def finalize(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The pre-norm stack's final LayerNorm (identity for post-norm)."""
        return hidden_states if self.layer_norm is None else self.layer_norm(hidden_states)

    @records_block_outputs
    @accepts_cache_argument
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool = False,
        sublayer_order=None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | list[int] | None = None,
        **attention_kwargs,
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        """The decoder's states (and cache, with `use_cache`); `output_hidden_states` / `output_attentions` (collected
        by `capture_outputs`, see `_can_record_outputs`): the embeddings and every block's output (the last one through
        the final LayerNorm), every block's self- and cross-attention weights."""
        if output_attentions is None:
            output_attentions = self.config.output_attentions
        if use_cache and past_key_values is None:
            past_key_values = new_decoder_cache(self.config)
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        capacity = static_cache_capacity(past_key_values)
        hidden_states = self.embed(
            input_ids, past_length, inputs_embeds, max_length=capacity, attention_mask=attention_mask
        )
        batch, q_len = hidden_states.shape[:2]
        self_mask = self.self_attention_mask(
            batch, q_len, past_length, attention_mask, hidden_states.dtype, hidden_states.device, key_length=capacity
        )
        cross_mask = padding_mask(encoder_attention_mask, hidden_states.dtype)
        for idx in range(len(self.layers)):
            # LayerDrop only while training, where no cache is kept (a skipped layer's cache would fall behind).
            if past_key_values is None and _layerdrop_skips(self, self.layerdrop):
                continue
            hidden_states, _, _ = self.run_layer(
                idx,
                hidden_states,
                attention_mask=self_mask,
                encoder_hidden_states=encoder_hidden_states,
                encoder_attention_mask=cross_mask,
                past_key_values=past_key_values,
                sublayer_order=sublayer_order,
                output_attentions=output_attentions,
                **attention_kwargs,
            )
        hidden_states = self.finalize(hidden_states)
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states, **cache_field(past_key_values if use_cache else None)
        )


@dataclass(frozen=True)
class BackboneComponents:
    """The classes the backbone is built from. A method replaces the ones it changes:
    `components = BackboneComponents(decoder_self_attention=MyAttention)` on its model class."""

    encoder_self_attention: type = FlexformerAttention
    decoder_self_attention: type = FlexformerAttention
    cross_attention: type = FlexformerAttention
    feed_forward: type = FlexformerFeedForward
    encoder_layer: type = FlexformerEncoderLayer
    decoder_layer: type = FlexformerDecoderLayer
    encoder: type = FlexformerEncoder
    decoder: type = FlexformerDecoder


# --------------------------------------------------------------------------------------------------------------------
# Teacher forcing
# --------------------------------------------------------------------------------------------------------------------


def _needs_init(tensor) -> bool:
    """Whether `_init_weights` should set ``tensor``: it exists and `from_pretrained` did not load it."""
    return tensor is not None and not getattr(tensor, "_is_hf_initialized", False)


def _init_branch_biases(branch_biases: torch.Tensor | None) -> None:
    """The per-branch biases of a multi-branch merge (`merge_projection`) start at zero, as fairseq's output
    projections' biases; its weight is initialised as a Linear, one branch's block at a time."""
    if _needs_init(branch_biases):
        nn.init.zeros_(branch_biases)


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Teacher-forcing decoder input: `</s>` (fairseq's decoder start), then the labels without their last token."""
    shifted = labels.new_zeros(labels.shape)
    shifted[:, 1:] = labels[:, :-1].clone()
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted == -100, pad_token_id)


# --------------------------------------------------------------------------------------------------------------------
# Pretrained models
# --------------------------------------------------------------------------------------------------------------------


class FlexformerPreTrainedModel(PreTrainedModel):
    config_class = FlexformerConfig
    config: FlexformerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["FlexformerEncoderLayer", "FlexformerDecoderLayer"]
    _skip_keys_device_placement = [CACHE_NAME]
    _supports_sdpa = True
    _supports_attention_backend = True
    components: BackboneComponents = BackboneComponents()
    # {model type of a checkpoint: what to call instead} for the mix-ups a method class can name a fix for.
    other_model_type_hints: dict[str, str] = {}

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`PreTrainedModel.from_pretrained`, refusing a checkpoint of another model type when the config comes
        from the checkpoint itself: Transformers would only warn and initialise the weights the checkpoint lacks
        at random. Passing `config=` loads across types deliberately; the Auto classes always pick the class that
        matches."""
        if kwargs.get("config") is None and pretrained_model_name_or_path is not None:
            cls._check_checkpoint_model_type(pretrained_model_name_or_path, kwargs)
        # A folder saved before the branch merges became plain `nn.Linear`s loads through an upgraded copy.
        with tempfile.TemporaryDirectory(prefix="flexformers-upgrade-") as workspace:
            folder = checkpoint_in_current_layout(pretrained_model_name_or_path, workspace)
            model = super().from_pretrained(folder, *model_args, **kwargs)
            if folder != pretrained_model_name_or_path:
                loaded = model[0] if isinstance(model, tuple) else model
                loaded.name_or_path = loaded.config._name_or_path = str(pretrained_model_name_or_path)
            return model

    @classmethod
    def _check_checkpoint_model_type(cls, pretrained_model_name_or_path, kwargs) -> None:
        from transformers import PreTrainedConfig

        expected = cls.config_class.model_type
        lookup = {key: kwargs[key] for key in ("cache_dir", "force_download", "local_files_only", "token", "revision",
                                               "subfolder", "proxies") if key in kwargs}
        try:
            config_dict, _ = PreTrainedConfig.get_config_dict(pretrained_model_name_or_path, **lookup)
        except (OSError, ValueError):
            return  # no readable config.json: from_pretrained's own error says so
        found = config_dict.get("model_type")
        if not found:
            raise ValueError(
                f"{cls.__name__}.from_pretrained({str(pretrained_model_name_or_path)!r}): its config.json has no "
                f"'model_type', so it cannot be checked to hold a {expected!r} model; add \"model_type\": "
                f"\"{expected}\" if it does, or pass config="
            )
        if found == expected:
            return
        hint = cls.other_model_type_hints.get(found)
        raise ValueError(
            f"{cls.__name__}.from_pretrained({str(pretrained_model_name_or_path)!r}): the checkpoint is of model "
            f"type {found!r}, not {expected!r}; loading it here would initialise the weights it lacks at random. "
            "AutoModelForSeq2SeqLM.from_pretrained picks the class from config.json"
            + (f"; {hint}" if hint else "; pass config= to convert it deliberately")
        )

    @torch.no_grad()
    def _init_weights(self, module: nn.Module):
        """fairseq's initialisation, but for q/k/v: xavier-uniform projections with zero biases (a multi-branch
        merge per branch), token embeddings N(0, d^-0.5) with a zero padding row, LayerNorm (1, 0), an untied output
        layer N(0, d^-0.5).

        Known deviation: fairseq's `MultiheadAttention` draws q/k/v with gain 1/√2 and keeps `nn.Linear`'s uniform
        biases; here they get gain 1 and zero biases, as every model trained so far (the zoo's included) did —
        Transformers never visited the attention-level code that meant to do it. Changing it changes what every
        seeded model draws, so it is left to the fidelity work, not done silently."""
        # Each tensor is checked on its own: a checkpoint may hold a projection's weight but lack its bias, which
        # must then start as fairseq's, not as the uninitialised memory `from_pretrained` allocated for it.
        if isinstance(module, FlexformerAttention):
            # Transformers visits a layer of these (remote-code) classes only when it holds parameters of its own:
            # a multi-branch layer's per-branch merge biases. Its projections are initialised on their own visits,
            # as Linears, like every layer's (re-initialising them here would change what a seeded model draws).
            _init_branch_biases(module.out_proj_branch_bias)
        elif isinstance(module, FlexformerFeedForward):
            _init_branch_biases(module.fc2_branch_bias)
        elif isinstance(module, LearnedPositionalEmbedding):
            if _needs_init(module.weight):
                nn.init.normal_(module.weight, mean=0.0, std=module.embedding_dim**-0.5)
                module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.Embedding):
            if _needs_init(module.weight):
                nn.init.normal_(module.weight, mean=0.0, std=module.embedding_dim**-0.5)
                if module.padding_idx is not None:
                    module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            if _needs_init(module.weight):
                nn.init.ones_(module.weight)
            if _needs_init(module.bias):
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear) and getattr(module, "num_branches", 1) > 1:  # a multi-branch merge
            if _needs_init(module.weight):
                init_branched_linear(module.weight, module.num_branches, module.in_features // module.num_branches, 1, 1.0)
        elif isinstance(module, nn.Linear):
            if _needs_init(module.weight):
                if module.bias is None:  # an output projection (untied LM head): fairseq's N(0, d^-0.5)
                    nn.init.normal_(module.weight, mean=0.0, std=module.in_features**-0.5)
                else:
                    nn.init.xavier_uniform_(module.weight)
            if _needs_init(module.bias):
                nn.init.zeros_(module.bias)

    # ---- vocabulary size -----------------------------------------------------------------------------------------
    def vocabulary_projections(self) -> list[nn.Linear]:
        """The projections onto the target vocabulary: the output layer (Depth-Adaptive adds its exit classifiers)."""
        head = self.get_output_embeddings()
        return [] if head is None else [head]

    def _resize_token_embeddings(self, new_num_tokens, pad_to_multiple_of=None, mean_resizing=True):
        """The step of Transformers' `resize_token_embeddings` that resizes the modules (it then sets
        `config.vocab_size` and ties the shared tables again): the source table and, when both sides share one
        vocabulary (`target_vocab_size` None), the decoder's table and every output projection too. A separate
        target vocabulary is resized by `resize_decoder_token_embeddings`."""
        table = self._get_resized_embeddings(
            self.get_input_embeddings(), new_num_tokens, pad_to_multiple_of, mean_resizing
        )
        self.set_input_embeddings(table)
        if self.config.target_vocab_size is None:
            self._resize_target_vocabulary(table.weight.shape[0], None, mean_resizing)
        return self.get_input_embeddings()

    def resize_decoder_token_embeddings(
        self, new_num_tokens: int, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
    ) -> nn.Embedding:
        """Resize the target vocabulary alone — the decoder's table, every output projection and
        `config.target_vocab_size` (Marian's method); the source side keeps its size."""
        if self.config.share_all_embeddings:
            raise ValueError(
                "resize_decoder_token_embeddings: with share_all_embeddings=True source and target share one table; "
                "use resize_token_embeddings"
            )
        table = self._resize_target_vocabulary(new_num_tokens, pad_to_multiple_of, mean_resizing)
        self.config.target_vocab_size = table.weight.shape[0]
        self.tie_weights()
        return table

    def _resize_target_vocabulary(self, new_num_tokens, pad_to_multiple_of, mean_resizing) -> nn.Embedding:
        # Both helpers are Transformers' own; the tables are resized in place (a shared table only once), and a
        # projection keeps its module (and whatever wraps it) with the resized parameters.
        decoder = self.get_decoder()
        decoder.embed_tokens = self._get_resized_embeddings(
            decoder.embed_tokens, new_num_tokens, pad_to_multiple_of, mean_resizing
        )
        new_num_tokens = decoder.embed_tokens.weight.shape[0]
        for projection in self.vocabulary_projections():
            resized = self._get_resized_lm_head(projection, new_num_tokens, mean_resizing=mean_resizing)
            if resized is not projection:
                for name in ("weight", "bias"):
                    parameter = getattr(resized, name)
                    if parameter is not None:
                        parameter.requires_grad_(getattr(projection, name).requires_grad)
                    setattr(projection, name, parameter)
                projection.out_features = new_num_tokens
        return decoder.embed_tokens

    @property
    def dummy_inputs(self):
        pad = self.config.pad_token_id
        input_ids = torch.tensor([[5, 6, 10, 4, 2], [8, 12, 7, 2, pad]], device=self.device)
        return {"input_ids": input_ids, "attention_mask": input_ids.ne(pad).long()}


class FlexformerModel(FlexformerPreTrainedModel):
    """Encoder + decoder (no LM head). With `share_all_embeddings` both use one embedding matrix."""

    def __init__(self, config: FlexformerConfig):
        super().__init__(config)
        components = type(self).components
        pad = config.pad_token_id
        encoder_embeddings = nn.Embedding(config.vocab_size, config.encoder_embed_dim, pad)
        if config.share_all_embeddings:
            # One table tied by parameter, as Transformers ties (BART's way): the decoder has a module of its own
            # whose weight `tie_weights()` makes the encoder's. One module on both sides would not do: Transformers
            # builds the model on the meta device and marks the tie's target as loaded, which would mark the
            # source too, so a checkpoint without the table would leave it on the meta device, unreported.
            # Until the tie, the decoder's weight is a stand-in sharing the encoder's storage, left out of the
            # initialisation as Transformers leaves a tie's target (no random draw: seeded models are unchanged).
            decoder_embeddings = nn.Embedding(
                config.vocab_size, config.decoder_embed_dim, pad, _weight=encoder_embeddings.weight
            )
            decoder_embeddings.weight._is_hf_initialized = True
            # The encoder registers the shared table first, so `named_parameters()` and the checkpoint call it by the
            # encoder's name: that name is the source of the tie (checkpoints saved under the decoder's name still
            # load: Transformers ties either way round).
            self._tied_weights_keys = {"decoder.embed_tokens.weight": "encoder.embed_tokens.weight"}
        else:
            decoder_embeddings = nn.Embedding(config.decoder_vocab_size, config.decoder_embed_dim, pad)
            self._tied_weights_keys = {}
        self.encoder = components.encoder(config, encoder_embeddings, components)
        self.decoder = components.decoder(config, decoder_embeddings, components)
        self.post_init()

    def get_input_embeddings(self):
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value):
        self.encoder.embed_tokens = value
        if self.config.share_all_embeddings:
            self.decoder.embed_tokens = value

    def get_encoder(self):
        return self.encoder

    def get_decoder(self):
        return self.decoder

    @can_return_tuple
    @accepts_cache_argument
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        encoder_sublayer_order=None,
        decoder_sublayer_order=None,
        **decoder_attention_kwargs,
    ) -> Seq2SeqModelOutput | tuple:
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if attention_mask is None and input_ids is not None:
            attention_mask = input_ids.ne(self.config.pad_token_id).long()
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                inputs_embeds=inputs_embeds,
                sublayer_order=encoder_sublayer_order,
                output_attentions=output_attentions,
                output_hidden_states=output_hidden_states,
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(
                last_hidden_state=encoder_outputs[0],
                hidden_states=encoder_outputs[1] if len(encoder_outputs) > 1 else None,
                attentions=encoder_outputs[2] if len(encoder_outputs) > 2 else None,
            )
        if self.training and self.is_activation_checkpointing and use_cache:
            use_cache = False
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask,
            inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            sublayer_order=decoder_sublayer_order,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            cache=past_key_values,
            **decoder_attention_kwargs,
        )
        return Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            **cache_field(output_cache(decoder_outputs)),
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )


class FlexformerForConditionalGeneration(FlexformerPreTrainedModel, FlexformerGenerationMixin):
    """The baseline seq2seq model: `FlexformerModel` + output projection, label-smoothed loss, `generate()`."""

    base_model_class = FlexformerModel
    # `forward(**kwargs)` receives Trainer's `num_items_in_batch` and normalises the loss by it itself.
    accepts_loss_kwargs = True

    def __init__(self, config: FlexformerConfig):
        super().__init__(config)
        self.model = type(self).base_model_class(config)
        self.lm_head = nn.Linear(config.decoder_embed_dim, config.decoder_vocab_size, bias=False)
        if config.share_decoder_input_output_embed:
            table = "encoder" if config.share_all_embeddings else "decoder"  # the name named_parameters() reports
            self._tied_weights_keys = {"lm_head.weight": f"model.{table}.embed_tokens.weight"}
        else:
            self._tied_weights_keys = {}
        self.post_init()

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def get_encoder(self):
        return self.model.encoder

    def get_decoder(self):
        return self.model.decoder

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    def compute_loss(self, logits, labels, num_items_in_batch=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Label-smoothed NLL with ε = `config.label_smoothing` (see `label_smoothed_nll_loss`)."""
        return label_smoothed_nll_loss(
            logits, labels, self.config.label_smoothing, num_items_in_batch=num_items_in_batch
        )

    @can_return_tuple
    @accepts_cache_argument
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,
    ) -> Seq2SeqLMOutput | tuple:
        """`labels` (pad = -100) give the label-smoothed loss; `logits_to_keep=k` computes only the last k logits
        (generation needs one). Extra keyword arguments (`encoder_sublayer_order`, `decoder_sublayer_order`,
        attention kwargs of a method) go to the backbone."""
        if labels is not None:
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        drop_generation_position_arguments(kwargs)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            cache=past_key_values,
            **kwargs,
        )
        return self.language_model_output(outputs, labels, num_items_in_batch, logits_to_keep)

    def language_model_output(
        self,
        outputs: Seq2SeqModelOutput,
        labels: torch.Tensor | None,
        num_items_in_batch=None,
        logits_to_keep: int = 0,
        output_class: type = Seq2SeqLMOutput,
        **extra_fields,
    ) -> Seq2SeqLMOutput:
        """The output projection, the loss when `labels` are given, and the output object (`output_class`, with any
        method-specific `extra_fields`) from the backbone's outputs — shared by every method's `forward`."""
        hidden_states = outputs.last_hidden_state
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        logits = project_vocabulary(self.lm_head, hidden_states)
        loss = None
        if labels is not None:
            loss, _ = self.compute_loss(logits, labels, num_items_in_batch)
        return output_class(
            loss=loss,
            logits=logits,
            **cache_field(output_cache(outputs)),
            decoder_hidden_states=outputs.decoder_hidden_states,
            decoder_attentions=outputs.decoder_attentions,
            cross_attentions=outputs.cross_attentions,
            encoder_last_hidden_state=outputs.encoder_last_hidden_state,
            encoder_hidden_states=outputs.encoder_hidden_states,
            encoder_attentions=outputs.encoder_attentions,
            **extra_fields,
        )


__all__ = [
    "BackboneComponents",
    "FlexformerAttention",
    "FlexformerDecoder",
    "FlexformerDecoderLayer",
    "FlexformerEncoder",
    "FlexformerEncoderLayer",
    "FlexformerFeedForward",
    "FlexformerForConditionalGeneration",
    "FlexformerModel",
    "FlexformerPreTrainedModel",
    "host_sync_forbidden",
    "shift_tokens_right",
]
