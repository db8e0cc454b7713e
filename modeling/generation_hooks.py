"""How the flexformers models plug into Transformers' `generate()`: the cache they decode with, the source mask,
and the logits processors. Every model type's `*ForConditionalGeneration` inherits it through the backbone's."""

from __future__ import annotations

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


class FlexformerGenerationMixin(GenerationMixin):
    """`GenerationMixin` with the backbone's decoding cache (preallocated self-attention layers, cross-attention
    stored once per source sentence), an inferred source padding mask and fairseq's never-generate-`<pad>`."""

    # A decoding step with a static cache is one graph: `generate(cache_implementation="static")` compiles it on a
    # GPU (CUDA graphs). A method whose decoding cannot run on a static cache names why here (and sets the flag off).
    _can_compile_fullgraph = True
    static_cache_unsupported_reason: str | None = None

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
