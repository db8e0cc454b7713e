"""How the flexformers models plug into Transformers' `generate()`: the cache they decode with, the source mask,
and the logits processors. Every model type's `*ForConditionalGeneration` inherits it through the backbone's."""

from __future__ import annotations

import torch
from transformers import GenerationMixin
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    SuppressTokensLogitsProcessor,
)

from .kv_caches import (
    SourceGroupedCache,
    static_cache_capacity,
    use_preallocated_layers,
)
from .transformers_compat import generation_cache, set_generation_cache


def check_generate_arguments(model, input_ids, generation_config=None, kwargs: dict | None = None) -> None:
    """A `ValueError` naming the argument for what `generate()` cannot decode -- an empty batch, zero-length
    sources, ids outside the source vocabulary, a `decoder_start_token_id` outside the target vocabulary,
    `num_beams` / `num_return_sequences` below 1 -- instead of a reshape `RuntimeError`, a `ZeroDivisionError`, a
    bare `IndexError` (BART's too) or (InDIGO) silently greedy decoding."""
    kwargs = kwargs or {}
    resolved = generation_config if generation_config is not None else model.generation_config
    for name in ("num_beams", "num_return_sequences"):
        value = kwargs.get(name)
        value = getattr(resolved, name, None) if value is None else value
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"generate(): {name} must be an integer >= 1, got {value!r}")
    check_decoder_start_token_id(model, kwargs.get("decoder_start_token_id",
                                                   getattr(resolved, "decoder_start_token_id", None)))
    if input_ids is None:
        encoder_outputs = kwargs.get("encoder_outputs")
        states = getattr(encoder_outputs, "last_hidden_state", None)
        if states is None and isinstance(encoder_outputs, (tuple, list)) and encoder_outputs:
            states = encoder_outputs[0]
        if isinstance(states, torch.Tensor) and states.shape[0] == 0:
            raise ValueError("generate(): encoder_outputs hold an empty batch; give at least one source sequence")
        return
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"generate(): input_ids must be a tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dim() == 0 or input_ids.shape[0] == 0:
        raise ValueError(f"generate(): input_ids is an empty batch (shape {tuple(input_ids.shape)}); give at least "
                         "one source sequence")
    if input_ids.is_floating_point():
        return  # embeddings passed as `inputs`: no ids to check
    if input_ids.dim() != 2:
        raise ValueError(f"generate(): input_ids must be 2-D (batch, length), got shape {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError(f"generate(): input_ids has sources of length 0 (shape {tuple(input_ids.shape)}); every "
                         "source needs at least its </s>")
    vocab_size = model.config.vocab_size
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"generate(): input_ids holds the id {bad}, outside the source vocabulary [0, {vocab_size})")


def check_decoder_start_token_id(model, value) -> None:
    """A `ValueError` naming `decoder_start_token_id` (an id, a list of ids or a tensor of them, one per source) and
    the target vocabulary when it is not a token id of the decoder's vocabulary."""
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        ids = value.flatten().tolist()
    else:
        ids = list(value) if isinstance(value, (list, tuple)) else [value]
    vocab_size = getattr(model.config, "decoder_vocab_size", model.config.vocab_size)
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int):
            raise ValueError(f"generate(): decoder_start_token_id must be a token id (an integer), got {value!r}")
        if not 0 <= token < vocab_size:
            raise ValueError(f"generate(): decoder_start_token_id {token} is outside the target vocabulary "
                             f"[0, {vocab_size})")


def requested_option(model, generation_config, kwargs: dict, name: str):
    """The value `generate()` will use for the GenerationConfig option `name`: the keyword, else the config's."""
    if kwargs.get(name) is not None:
        return kwargs[name]
    resolved = generation_config if generation_config is not None else model.generation_config
    return getattr(resolved, name, None)


def check_left_to_right_options(model, generation_config=None, kwargs: dict | None = None) -> None:
    """A `ValueError` naming the `generate()` options Transformers' loop would run wrongly on a flexformers model."""
    kwargs = kwargs or {}
    early_exit = requested_option(model, generation_config, kwargs, "assistant_early_exit")
    if early_exit is not None:
        # Transformers' self-speculative decoding lowers `config.num_hidden_layers` for its drafts, which the
        # backbone's decoder does not read (it would draft with every block against a cache sized for fewer, fail,
        # and leave the lowered count in the config).
        raise ValueError(
            f"generate(): assistant_early_exit={early_exit!r} cannot be used: the flexformers decoders run all their "
            "blocks whatever config.num_hidden_layers says (Depth-Adaptive exits by its own exit_strategy); pass "
            "an assistant_model instead"
        )
    chunk = requested_option(model, generation_config, kwargs, "prefill_chunk_size")
    if chunk is not None:
        # Transformers' chunked prefill takes `attention_mask` as the decoder's: for an encoder-decoder it is the
        # source mask, which every later step would then decode without (padded sources attend to their padding)
        raise ValueError(
            f"generate(): prefill_chunk_size={chunk!r} cannot be used with an encoder-decoder flexformers model: it "
            "chunks a decoder-only prompt (the decoder here starts from one token), and Transformers' chunked "
            "prefill drops the source mask"
        )
    guidance = requested_option(model, generation_config, kwargs, "guidance_scale")
    if guidance is not None and guidance != 1:
        # Transformers' classifier-free guidance doubles the decoder batch with an unconditional half, which an
        # encoder-decoder's step cannot build (it needs encoder states for every row)
        raise ValueError(
            f"generate(): guidance_scale={guidance!r} (classifier-free guidance, with negative_prompt_ids / "
            "negative_prompt_attention_mask as its unconditional prompt) cannot be used with an encoder-decoder "
            "flexformers model: Transformers' guidance step runs the decoder without the encoder states"
        )


class FlexformerGenerationMixin(GenerationMixin):
    """`GenerationMixin` with the backbone's decoding cache (preallocated self-attention layers, cross-attention
    stored once per source sentence), an inferred source padding mask and fairseq's never-generate-`<pad>`."""

    # A decoding step with a static cache is one graph: `generate(cache_implementation="static")` compiles it on a
    # GPU (CUDA graphs). A method whose decoding cannot run on a static cache names why here (and sets the flag off).
    _can_compile_fullgraph = True
    static_cache_unsupported_reason: str | None = None

    def generate(self, inputs=None, generation_config=None, *args, **kwargs):
        """`GenerationMixin.generate` after :func:`check_generate_arguments`."""
        check_generate_arguments(self, inputs if inputs is not None else kwargs.get("input_ids"), generation_config, kwargs)
        check_left_to_right_options(self, generation_config, kwargs)
        return super().generate(inputs, generation_config, *args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """Use a `SourceGroupedCache` when `generate()` repeats each source (beams or several samples); refuse a
        static cache where the method's decoding cannot use one."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = generation_cache(model_kwargs)
        if self.static_cache_unsupported_reason is not None and static_cache_capacity(cache) is not None:
            raise ValueError(
                f"{type(self).__name__} cannot generate with a static cache (cache_implementation="
                f"{generation_config.cache_implementation!r} or a StaticCache passed in): "
                f"{self.static_cache_unsupported_reason}. Use the default cache."
            )
        if (
            type(cache) is EncoderDecoderCache
            and not getattr(cache, "_is_user_defined", False)
            and type(cache.self_attention_cache) is DynamicCache
        ):
            cache.self_attention_cache = self._generation_self_attention_cache(cache.self_attention_cache)
        group = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        if type(cache) is EncoderDecoderCache and group > 1 and not getattr(cache, "_is_user_defined", False):
            set_generation_cache(
                model_kwargs, SourceGroupedCache(cache.self_attention_cache, cache.cross_attention_cache, group)
            )

    def _generation_self_attention_cache(self, cache: DynamicCache) -> Cache:
        """The decoder self-attention cache `generate()` runs with, given the fresh `DynamicCache` Transformers
        built: its layers become `PreallocatedKVLayer`s. Seam: Depth-Adaptive returns a `CopiedStateCache`."""
        return use_preallocated_layers(cache)

    def _prepare_text_encoder_decoder_kwargs_for_generation(self, inputs_tensor, model_kwargs, *args, **kwargs):
        """Transformers v5 builds no source mask for encoder-decoder models: infer it from the padding index, so a
        padded batch's cross-attention ignores the padding at every decoding step (as fairseq does)."""
        if model_kwargs.get("attention_mask") is None and inputs_tensor is not None and not inputs_tensor.is_floating_point():
            model_kwargs["attention_mask"] = inputs_tensor.ne(self.config.pad_token_id).long()
        return super()._prepare_text_encoder_decoder_kwargs_for_generation(inputs_tensor, model_kwargs, *args, **kwargs)

    def _get_logits_processor(self, generation_config, *args, **kwargs) -> LogitsProcessorList:
        """Transformers' processors, after one that never lets a hypothesis continue with the padding token, as
        fairseq's generator does: a generated `<pad>` would read as padding to every later step (positions, the
        decoder's padding mask), so the hypothesis would mean something else than it scored."""
        processors = super()._get_logits_processor(generation_config, *args, **kwargs)
        device = kwargs.get("device") or self.device
        processors.insert(0, SuppressTokensLogitsProcessor([self.config.pad_token_id], device=device))
        return processors
