"""Generic checks every model type passes, from one table of tiny configs: what a Transformers user expects of any
model (a sixth model type added to `MODEL_TYPES` gets them for free).

Runs on every supported Transformers release (CI runs this module on the newest release and on the floor)."""

from __future__ import annotations

import pytest
import torch

from flexformers import (
    DepthAdaptiveConfig,
    DepthAdaptiveForConditionalGeneration,
    FlexformerConfig,
    FlexformerForConditionalGeneration,
    InDIGOConfig,
    InDIGOForConditionalGeneration,
    IOTConfig,
    IOTForConditionalGeneration,
    MATConfig,
    MATForConditionalGeneration,
)
from flexformers.modeling.transformers_compat import CACHE_NAME, NEW_CACHE_ARGUMENT, output_cache
from tests.conftest import tiny_config_kwargs

#: model type -> (config class, model class, the tiny config's method fields)
MODEL_TYPES = {
    "flexformer": (FlexformerConfig, FlexformerForConditionalGeneration, {}),
    # four decoder orders and the predictor: beams of one batch decode under different orders
    "iot": (IOTConfig, IOTForConditionalGeneration, {"decoder_orders": [1, 2, 4, 6]}),
    "mat": (MATConfig, MATForConditionalGeneration, {"encoder_attention_branches": 2, "decoder_attention_branches": 2}),
    "indigo": (InDIGOConfig, InDIGOForConditionalGeneration, {}),
    # early exits by confidence: most tokens leave below the top block, so copied states are exercised
    "depth_adaptive": (
        DepthAdaptiveConfig,
        DepthAdaptiveForConditionalGeneration,
        {"exit_strategy": "confidence", "exit_thresholds": [0.02]},
    ),
}
#: the types whose generation is Transformers' `GenerationMixin` loop. InDIGO inserts words with its own loop and
#: state (no Transformers cache); its cached-vs-recomputed equivalence is test_indigo.py's
#: `test_incremental_decoding_equals_full_forward` and `test_greedy_equals_teacher_forced_argmax`.
LEFT_TO_RIGHT_TYPES = [name for name in MODEL_TYPES if name != "indigo"]


def tiny_model(model_type: str, seed: int = 0, **overrides):
    config_class, model_class, method_fields = MODEL_TYPES[model_type]
    torch.manual_seed(seed)
    config = config_class(**tiny_config_kwargs(**{**method_fields, **overrides}))
    return model_class(config).eval()


def source_batch(rows: int = 3, length: int = 7, seed: int = 1) -> torch.Tensor:
    """A padded batch of source ids (ids 5.. are words; 1 is padding, 2 is </s>)."""
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(5, 60, (rows, length), generator=generator)
    source[:, -1] = 2
    source[0, :2] = 1  # one left-padded row
    return source


@pytest.mark.parametrize("model_type", LEFT_TO_RIGHT_TYPES)
@pytest.mark.parametrize("options", [{"num_beams": 1}, {"num_beams": 3}], ids=["greedy", "beam3"])
def test_generation_with_the_cache_equals_generation_without_it(model_type, options):
    """The cache `generate()` builds and passes back under the running release's name (`past_key_values` up to
    5.23, `cache` from 5.24) is read by every step: the tokens equal recomputing the whole prefix each step."""
    model = tiny_model(model_type)
    source = source_batch()
    with torch.no_grad():
        cached = model.generate(source, max_new_tokens=8, min_new_tokens=8, **options)
        recomputed = model.generate(source, max_new_tokens=8, min_new_tokens=8, use_cache=False, **options)
    assert cached.shape[1] > 2
    assert torch.equal(cached, recomputed)


@pytest.mark.parametrize("model_type", LEFT_TO_RIGHT_TYPES)
@pytest.mark.parametrize("name", ["past_key_values", NEW_CACHE_ARGUMENT])
def test_forward_takes_the_cache_under_either_name_and_returns_it_under_the_releases(model_type, name):
    """A step-by-step forward continues from the cache whichever name it is passed under, and the output carries
    it in the field the running Transformers reads."""
    model = tiny_model(model_type)
    source = source_batch()
    target = torch.randint(5, 60, (source.shape[0], 4), generator=torch.Generator().manual_seed(2))
    target[:, 0] = 2
    with torch.no_grad():
        full = model(input_ids=source, decoder_input_ids=target, use_cache=False).logits
        first = model(input_ids=source, decoder_input_ids=target[:, :2], use_cache=True)
        cache = output_cache(first)
        assert cache is not None and CACHE_NAME in first.keys()
        step = model(input_ids=source, decoder_input_ids=target[:, 2:], use_cache=True, **{name: cache})
    torch.testing.assert_close(step.logits, full[:, 2:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not both"):
        model(input_ids=source, decoder_input_ids=target[:, 2:], past_key_values=cache, **{NEW_CACHE_ARGUMENT: cache})



@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_generation_never_continues_a_hypothesis_with_the_padding_token(model_type):
    """As in fairseq's generator, `<pad>` is never generated, even where the model ranks it first: later steps would
    read it as padding, so the hypothesis would not be the one that was scored."""
    from flexformers.modeling.cpu_kernels import VocabularyProjection

    model = tiny_model(model_type)
    pad = model.config.pad_token_id

    def rank_padding_first(module, inputs, logits):
        logits = logits.clone()
        logits[..., pad] = logits.max() + 10.0
        return logits

    projections = [m for m in model.modules() if isinstance(m, VocabularyProjection)]
    assert projections
    for projection in projections:
        projection.register_forward_hook(rank_padding_first)
    with torch.no_grad():
        for options in ({"num_beams": 1}, {"num_beams": 3}):
            sequences = model.generate(source_batch(), max_new_tokens=5, min_new_tokens=5, **options)
            assert sequences.shape[1] >= 6
            assert not (sequences == pad).any(), (options, sequences)
