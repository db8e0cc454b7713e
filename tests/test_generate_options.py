"""Every `generate()` / `GenerationConfig` option that BART's `generate()` takes either acts, or is refused by name, for
every model type -- never silently ignored (issue 61, item 6) -- and InDIGO's insertion decoding gives Transformers'
per-step outputs: scores, logits, `compute_transition_scores`, a streamer and stopping criteria.

The walk takes its list of options from the running Transformers (`GenerationConfig().to_dict()` and the parameters
of `GenerationMixin.generate`), so an option a new release adds fails here until it has a case below. For each one it
calls `generate` with a non-default value beside the same call without it, on a tiny model of each type and on a tiny
`BartForConditionalGeneration`, and classifies the result: it acts (the output differs), it is refused (a
`ValueError` / `TypeError` / `NotImplementedError`), or it has no effect. Then:

* BART either acts, refuses, or the option is in an allow-list below that says why it has no effect on these calls.
* A flexformers model acts, or refuses naming the option (or with BART's own refusal, word for word), or the option
  is allow-listed. An option BART shows to be lossless (`LOSSLESS`: the same tokens by design, e.g. `use_cache`)
  must give the default output exactly, or be refused by name.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import BartConfig, BartForConditionalGeneration, CompileConfig, GenerationConfig, GenerationMixin
from transformers.generation import (
    BaseStreamer,
    LogitsProcessor,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
)

from tests.test_conformance import LEFT_TO_RIGHT_TYPES, MODEL_TYPES, source_batch, tiny_model

MAX_NEW_TOKENS = 6

#: Options that are no options: metadata a saved GenerationConfig carries.
NOT_OPTIONS = {
    "_from_model_config": "metadata: whether the config was derived from the model's config",
    "transformers_version": "metadata: the release that saved the config",
    "is_assistant": "internal: Transformers sets it on the assistant model of assisted decoding",
}

#: Options that change nothing on these calls by design: the same tokens, whatever the value (checked: a model
#: whose output differs under one of them fails).
LOSSLESS = {
    "use_cache": "the cache only saves recomputation (InDIGO always keeps its own insertion state)",
    "cache_implementation": "a static cache holds the same keys/values as the dynamic one",
    "cache_config": "options of a cache implementation; the default cache reads none",
    "max_cache_len": "the size of a static cache; the default cache ignores it (Transformers warns)",
    "compile_config": "how a static-cache step is compiled on a GPU; these CPU calls do not compile",
    "disable_compile": "turns off the compilation these CPU calls do not do",
    "prefill_chunk_size": "chunks a decoder-only prompt's prefill; an encoder-decoder decoder prompt is one token",
    "continuous_batching_config": "read by generate_batch / continuous batching only, not by generate()",
    "assistant_model": "assisted decoding verifies the assistant's drafts: greedy's tokens exactly",
    "prompt_lookup_num_tokens": "prompt-lookup decoding verifies its drafts: greedy's tokens exactly",
    "assistant_early_exit": "self-speculative decoding verifies its drafts: greedy's tokens exactly",
    "bos_token_id": "an encoder-decoder starts from decoder_start_token_id; bos only matters without inputs",
}

#: Options with no effect on these inputs, though not lossless: each says which inputs it would act on.
NO_EFFECT_HERE = {
    "pad_token_id": "fills only the tail of rows that end before the others; these rows end together",
    "num_assistant_tokens": "tunes assisted decoding, which these calls do not run",
    "num_assistant_tokens_schedule": "tunes assisted decoding, which these calls do not run",
    "assistant_confidence_threshold": "tunes assisted decoding, which these calls do not run",
    "assistant_lookbehind": "tunes assisted decoding with a different tokenizer, which these calls do not run",
    "target_lookbehind": "tunes assisted decoding with a different tokenizer, which these calls do not run",
    "max_matching_ngram_size": "tunes prompt-lookup decoding, which these calls do not run",
    "assistant_ensemble_weight": "tunes assisted decoding, which these calls do not run",
    "speculation_type": "selects a kind of assisted decoding, which these calls do not run",
    "remove_invalid_values": "replaces NaN/inf logits; these models give none where it changes the argmax",
    "negative_prompt_attention_mask": "the mask of negative_prompt_ids, read only with classifier-free guidance",
    "synced_gpus": "without torch.distributed there are no other ranks to keep in step",
    "diversity_penalty": "acts only within group beam search (num_beam_groups > 1)",
}


def tiny_bart() -> BartForConditionalGeneration:
    """A BART of the flexformers tiny size and special ids (larger initial weights: varied, not constant, output)."""
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=60, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
        init_std=0.3,
    )
    return BartForConditionalGeneration(config).eval()


def model_of(model_type: str):
    return tiny_bart() if model_type == "bart" else tiny_model(model_type)


def end_token(model) -> int:
    """The token that ends a hypothesis: `<eod>` for insertion decoding, `</s>` otherwise."""
    return getattr(model.config, "eod_token_id", model.config.eos_token_id)


class EndBias(LogitsProcessor):
    """Raise the ending token's score, so rows end at different lengths (random tiny models rarely end)."""

    def __init__(self, token: int, bias: float = 3.0):
        self.token, self.bias = token, bias

    def __repr__(self):
        return f"EndBias({self.token}, {self.bias})"

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.token] += self.bias
        return scores


class OnlyToken(LogitsProcessor):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores):
        kept = torch.full_like(scores, float("-inf"))
        kept[:, self.token] = scores[:, self.token]
        return kept


class StopAfter(StoppingCriteria):
    """Stops every row once its decoder sequence is `length` tokens long."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended = True


class Context:
    """What the cases need to know of a model's default output."""

    def __init__(self, model_type: str, model):
        self.model_type, self.model, self.end = model_type, model, end_token(model)
        with torch.no_grad():
            output = model.generate(source_batch(), max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True)
        generation_order = getattr(output, "insertion_ids", None)
        first = generation_order[:, 2] if generation_order is not None else output.sequences[:, 1]
        self.first_words = sorted(set(first.tolist()))
        words = output.sequences[output.sequences >= 5]
        self.word = int(words.mode().values) if words.numel() else 7  # the most frequent generated word
        self.defaults = {}  # base kwargs -> the output without the option

    def default(self, base: dict):
        key = repr(sorted((name, repr(value)) for name, value in base.items()))
        if key not in self.defaults:
            self.defaults[key] = run(self.model, {}, base)
        return self.defaults[key]


SAMPLE = {"do_sample": True}
BEAMS = {"num_beams": 3}
DICT = {"return_dict_in_generate": True}
SCORES = {"return_dict_in_generate": True, "output_scores": True}


def ending(ctx, **base):
    return {"logits_processor": LogitsProcessorList([EndBias(ctx.end)]), **base}


#: option -> ctx -> (the option's kwargs, the base kwargs both calls share, source rows)
CASES = {
    # ---- GenerationConfig: lengths and ending
    "max_length": lambda ctx: ({"max_length": 4}, {"max_new_tokens": None}),
    "max_new_tokens": lambda ctx: ({"max_new_tokens": 2}, {}),
    "min_length": lambda ctx: ({"min_length": MAX_NEW_TOKENS + 2}, ending(ctx)),
    "min_new_tokens": lambda ctx: ({"min_new_tokens": MAX_NEW_TOKENS}, ending(ctx)),
    "max_time": lambda ctx: ({"max_time": 1e-9}, {}),  # always spent after the first step
    "stop_strings": lambda ctx: ({"stop_strings": ["a"]}, {}),
    "eos_token_id": lambda ctx: ({"eos_token_id": ctx.word}, {}),
    "early_stopping": lambda ctx: ({"early_stopping": True}, ending(ctx, **BEAMS, **SCORES)),
    "length_penalty": lambda ctx: ({"length_penalty": -2.0}, ending(ctx, **BEAMS, **SCORES)),
    "exponential_decay_length_penalty": lambda ctx: ({"exponential_decay_length_penalty": (1, 100.0)}, {}),
    # ---- strategies
    "do_sample": lambda ctx: ({"do_sample": True}, {}),
    "num_beams": lambda ctx: ({"num_beams": 3}, SCORES),
    "num_return_sequences": lambda ctx: ({"num_return_sequences": 2}, BEAMS),
    "num_beam_groups": lambda ctx: ({"num_beam_groups": 3, "diversity_penalty": 1.0}, BEAMS),
    "diversity_penalty": lambda ctx: ({"diversity_penalty": 1.0}, BEAMS),
    "penalty_alpha": lambda ctx: ({"penalty_alpha": 0.6, "top_k": 4}, {}),
    "dola_layers": lambda ctx: ({"dola_layers": "low"}, {}),
    "low_memory": lambda ctx: ({"low_memory": True}, BEAMS),
    "force_words_ids": lambda ctx: ({"force_words_ids": [[ctx.word]]}, BEAMS),
    "constraints": lambda ctx: ({"constraints": []}, BEAMS),
    "guidance_scale": lambda ctx: ({"guidance_scale": 3.0}, {}),
    "use_mtp": lambda ctx: ({"use_mtp": True}, {}),
    "token_healing": lambda ctx: ({"token_healing": True}, {}),
    # ---- sampling
    "temperature": lambda ctx: ({"temperature": 0.05}, SAMPLE),
    "top_k": lambda ctx: ({"top_k": 1}, SAMPLE),
    "top_p": lambda ctx: ({"top_p": 0.01}, SAMPLE),
    "min_p": lambda ctx: ({"min_p": 0.9}, SAMPLE),
    "top_h": lambda ctx: ({"top_h": 0.1}, SAMPLE),
    "typical_p": lambda ctx: ({"typical_p": 0.01}, SAMPLE),
    "epsilon_cutoff": lambda ctx: ({"epsilon_cutoff": 0.5}, SAMPLE),
    "eta_cutoff": lambda ctx: ({"eta_cutoff": 0.5}, SAMPLE),
    # ---- logits processors
    "repetition_penalty": lambda ctx: ({"repetition_penalty": 100.0}, {}),
    "encoder_repetition_penalty": lambda ctx: ({"encoder_repetition_penalty": 100.0}, {}),
    "no_repeat_ngram_size": lambda ctx: ({"no_repeat_ngram_size": 1}, {}),
    "encoder_no_repeat_ngram_size": lambda ctx: ({"encoder_no_repeat_ngram_size": 1}, {"vocabulary_source": True}),
    "bad_words_ids": lambda ctx: ({"bad_words_ids": [[ctx.word]]}, {}),
    "sequence_bias": lambda ctx: ({"sequence_bias": {(ctx.word,): -100.0}}, {}),
    "suppress_tokens": lambda ctx: ({"suppress_tokens": [ctx.word]}, {}),
    "begin_suppress_tokens": lambda ctx: ({"begin_suppress_tokens": ctx.first_words}, {}),
    "forced_bos_token_id": lambda ctx: ({"forced_bos_token_id": ctx.word}, {}),
    "forced_eos_token_id": lambda ctx: ({"forced_eos_token_id": ctx.word}, {}),
    "renormalize_logits": lambda ctx: ({"renormalize_logits": True}, SCORES),
    "remove_invalid_values": lambda ctx: ({"remove_invalid_values": True}, {}),
    "watermarking_config": lambda ctx: ({"watermarking_config": {"greenlist_ratio": 0.5, "bias": 100.0}}, {}),
    # ---- outputs
    "return_dict_in_generate": lambda ctx: ({"return_dict_in_generate": True}, {}),
    "output_scores": lambda ctx: ({"output_scores": True}, DICT),
    "output_logits": lambda ctx: ({"output_logits": True}, DICT),
    "output_attentions": lambda ctx: ({"output_attentions": True}, DICT),
    "output_hidden_states": lambda ctx: ({"output_hidden_states": True}, DICT),
    # ---- special tokens
    "pad_token_id": lambda ctx: ({"pad_token_id": 7}, {}),
    "bos_token_id": lambda ctx: ({"bos_token_id": 7}, {}),
    "decoder_start_token_id": lambda ctx: ({"decoder_start_token_id": 7}, {}),
    # ---- cache and compilation (lossless)
    "use_cache": lambda ctx: ({"use_cache": False}, {}),
    "cache_implementation": lambda ctx: ({"cache_implementation": "static"}, {}),
    "cache_config": lambda ctx: ({"cache_config": {"max_cache_len": 32}}, {}),
    "max_cache_len": lambda ctx: ({"max_cache_len": 32}, {}),
    "compile_config": lambda ctx: ({"compile_config": CompileConfig(fullgraph=False)}, {}),
    "disable_compile": lambda ctx: ({"disable_compile": True}, {}),
    "prefill_chunk_size": lambda ctx: ({"prefill_chunk_size": 1}, {}),
    "continuous_batching_config": lambda ctx: ({"continuous_batching_config": {}}, {}),
    # ---- assisted decoding (one source row: Transformers assists batches of one)
    "prompt_lookup_num_tokens": lambda ctx: ({"prompt_lookup_num_tokens": 3}, {"rows": 1}),
    "assistant_early_exit": lambda ctx: ({"assistant_early_exit": 1}, {"rows": 1}),
    "num_assistant_tokens": lambda ctx: ({"num_assistant_tokens": 2}, {}),
    "num_assistant_tokens_schedule": lambda ctx: ({"num_assistant_tokens_schedule": "constant"}, {}),
    "assistant_confidence_threshold": lambda ctx: ({"assistant_confidence_threshold": 0.9}, {}),
    "assistant_lookbehind": lambda ctx: ({"assistant_lookbehind": 3}, {}),
    "target_lookbehind": lambda ctx: ({"target_lookbehind": 3}, {}),
    "max_matching_ngram_size": lambda ctx: ({"max_matching_ngram_size": 1}, {}),
    "assistant_ensemble_weight": lambda ctx: ({"assistant_ensemble_weight": 0.5}, {}),
    "speculation_type": lambda ctx: ({"speculation_type": "x"}, {}),
    # ---- not options
    "_from_model_config": lambda ctx: ({"_from_model_config": True}, {}),
    "transformers_version": lambda ctx: ({"transformers_version": "0.0.1"}, {}),
    "is_assistant": lambda ctx: ({"is_assistant": True}, {}),
    # ---- generate()'s own parameters
    "generation_config": lambda ctx: (
        {"generation_config": GenerationConfig(max_new_tokens=2)}, {"max_new_tokens": None}
    ),
    "logits_processor": lambda ctx: ({"logits_processor": LogitsProcessorList([OnlyToken(7)])}, {}),
    "stopping_criteria": lambda ctx: ({"stopping_criteria": StoppingCriteriaList([StopAfter(3)])}, {}),
    "prefix_allowed_tokens_fn": lambda ctx: ({"prefix_allowed_tokens_fn": lambda batch_id, ids: [7, ctx.end]}, {}),
    "synced_gpus": lambda ctx: ({"synced_gpus": True}, {}),
    "assistant_model": lambda ctx: ({"assistant_model": model_of(ctx.model_type)}, {"rows": 1}),
    "streamer": lambda ctx: ({"streamer": RecordingStreamer()}, {}),
    "negative_prompt_ids": lambda ctx: ({"negative_prompt_ids": source_batch()[:, 2:], "guidance_scale": 3.0}, {}),
    "negative_prompt_attention_mask": lambda ctx: (
        {"negative_prompt_attention_mask": torch.ones(3, 5, dtype=torch.long)}, {}
    ),
    "custom_generate": lambda ctx: ({"custom_generate": lambda model, *args, **kwargs: torch.zeros(1, 1).long()}, {}),
}


def options_of_running_transformers() -> list[str]:
    generate_parameters = [
        name for name, parameter in inspect.signature(GenerationMixin.generate).parameters.items()
        if name not in ("self", "inputs") and parameter.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    return sorted(set(GenerationConfig().to_dict()) | set(generate_parameters))


def vocabulary_source() -> torch.Tensor:
    """Row 0 holds every word id once (an encoder-side n-gram ban then bans every word), the others as usual."""
    source = source_batch(length=56)
    source[0] = torch.cat([torch.arange(5, 60), torch.tensor([2])])
    return source


def run(model, options: dict, base: dict):
    base = dict(base)
    rows = base.pop("rows", 3)
    source = vocabulary_source() if base.pop("vocabulary_source", False) else source_batch()[:rows]
    kwargs = {"max_new_tokens": MAX_NEW_TOKENS, **base, **options}
    if kwargs["max_new_tokens"] is None:
        del kwargs["max_new_tokens"]
    torch.manual_seed(0)
    with torch.no_grad():
        return model.generate(source, **kwargs)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(
            torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, equal_nan=True))
        )
    if isinstance(a, dict) or isinstance(b, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def outcome(model, ctx: Context, name: str) -> tuple[str, str]:
    """('acts' | 'refused' | 'crashed' | 'no effect', the error's message)."""
    options, base = CASES[name](ctx)
    try:
        output = run(model, options, base)
    except (ValueError, TypeError, NotImplementedError) as error:
        return "refused", str(error)
    except Exception as error:  # noqa: BLE001 -- anything else is a crash: reported with the option's name
        return "crashed", f"{type(error).__name__}: {error}"
    streamer = options.get("streamer")
    if streamer is not None:
        return ("acts" if streamer.puts and streamer.ended else "no effect"), ""
    return ("no effect" if same(output, ctx.default(base)) else "acts"), ""


@pytest.fixture(scope="module")
def bart_outcomes():
    model = tiny_bart()
    ctx = Context("bart", model)
    return {name: outcome(model, ctx, name) for name in options_of_running_transformers()}


def test_every_option_of_the_running_transformers_has_a_case():
    missing = [name for name in options_of_running_transformers() if name not in CASES]
    assert not missing, f"add a case (and, if it has no effect, an allow-list entry with the reason) for {missing}"


@pytest.mark.slow  # ~85 options x 2 generate calls (about a minute on a quiet machine)
def test_bart_acts_on_refuses_or_allow_lists_every_option(bart_outcomes):
    """The reference: every option BART neither acts on nor refuses is allow-listed, with the reason."""
    silent = [name for name, (result, _) in bart_outcomes.items()
              if result == "no effect" and name not in {**NOT_OPTIONS, **LOSSLESS, **NO_EFFECT_HERE}]
    assert not silent, f"BART ignores {silent} on these calls: give each a value that acts, or allow-list it"


@pytest.mark.slow  # ~85 options x 2 generate calls per type
@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_every_option_acts_or_is_refused_by_name(model_type, bart_outcomes):
    model = model_of(model_type)
    ctx = Context(model_type, model)
    problems = []
    for name in options_of_running_transformers():
        result, message = outcome(model, ctx, name)
        bart_result, bart_message = bart_outcomes[name]
        if result == "crashed" and message != bart_message:
            problems.append(f"{name}: crashed: {message[:200]}")
        elif result == "refused":
            if name not in message and message != bart_message:
                problems.append(f"{name}: refused without naming it: {message[:200]}")
        elif result == "no effect" and name not in {**NOT_OPTIONS, **LOSSLESS, **NO_EFFECT_HERE}:
            problems.append(f"{name}: silently ignored (BART: {bart_result})")
        elif result == "acts" and name in LOSSLESS:
            problems.append(f"{name}: changes the output, but it is lossless (BART: {bart_result})")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------------------------------------------------
# Per-step outputs, streamers and stopping criteria, for every type beside BART
# --------------------------------------------------------------------------------------------------------------------

ALL_TYPES = ["bart", *MODEL_TYPES]


def generation_order(model, output) -> torch.Tensor:
    """The decoder's tokens in the order they were produced: insertion decoding's `insertion_ids`, else the
    sequences."""
    return output.insertion_ids if hasattr(output, "insertion_ids") else output.sequences


@pytest.mark.parametrize("model_type", ALL_TYPES)
@pytest.mark.parametrize("num_beams", [1, 3], ids=["greedy", "beam3"])
def test_scores_give_the_transition_scores_that_add_up_to_the_sequence_scores(model_type, num_beams):
    """`output_scores` / `output_logits` give one tensor per step and `compute_transition_scores` the chosen tokens'
    scores: in beam search they add up to `sequences_scores` (x length ** length_penalty), as for BART; in insertion
    decoding with the position log-probabilities (`position_scores`), and in greedy decoding too."""
    model = model_of(model_type)
    with torch.no_grad():
        output = model.generate(source_batch(), max_new_tokens=MAX_NEW_TOKENS, num_beams=num_beams,
                                length_penalty=1.0, return_dict_in_generate=True, output_scores=True,
                                output_logits=True)
    assert output.scores is not None and output.logits is not None
    assert len(output.scores) == len(output.logits) and 1 <= len(output.scores) <= MAX_NEW_TOKENS
    assert output.scores[0].shape == (3 * num_beams, model.config.vocab_size)
    insertion = hasattr(output, "insertion_ids")
    beam_indices = output.beam_indices if num_beams > 1 else None
    transition = model.compute_transition_scores(
        generation_order(model, output), output.scores, beam_indices, normalize_logits=num_beams == 1
    )
    assert transition.shape == (3, len(output.scores)) and torch.isfinite(transition[:, 0]).all()
    if insertion or num_beams > 1:  # (greedy left to right: a row's padding after its </s> scores -inf, as BART's)
        assert torch.isfinite(transition).all()
    step_scores = transition + output.position_scores if insertion else transition
    if num_beams > 1:
        lengths = output.beam_indices.ge(0).sum(-1)
        torch.testing.assert_close(step_scores.sum(-1) / lengths, output.sequences_scores, rtol=1e-4, atol=1e-4)
    elif insertion:
        torch.testing.assert_close(step_scores.sum(-1), output.sequences_scores, rtol=1e-4, atol=1e-4)
    else:  # greedy: each step's score is the log-probability of the token that step chose
        chosen = output.sequences[:, -len(output.scores):]
        expected = torch.stack([s.log_softmax(-1).gather(1, chosen[:, [t]]).squeeze(1)
                                for t, s in enumerate(output.scores)], 1)
        torch.testing.assert_close(transition, expected)
    if insertion:
        with pytest.raises(ValueError, match="insertion_ids"):
            model.compute_transition_scores(output.sequences, output.scores, beam_indices)


@pytest.mark.parametrize("model_type", ALL_TYPES)
def test_a_streamer_receives_every_token_as_it_is_produced(model_type):
    """Greedy: the streamer gets the decoder's start, then each step's token (insertion decoding: `<s> </s>`, then
    each inserted word, `<eod>` when a row ends), then `end()`; beam search refuses it by name, as BART's does."""
    model = model_of(model_type)
    streamer = RecordingStreamer()
    with torch.no_grad():
        output = model.generate(source_batch(), max_new_tokens=MAX_NEW_TOKENS, streamer=streamer,
                                return_dict_in_generate=True)
    assert streamer.ended and len(streamer.puts) >= 2
    streamed = torch.cat([put.view(3, -1) for put in streamer.puts], 1)
    produced = generation_order(model, output)
    special = [model.config.pad_token_id, end_token(model)] if hasattr(output, "insertion_ids") else []
    for streamed_row, produced_row in zip(streamed.tolist(), produced.tolist()):
        assert [t for t in streamed_row if t not in special] == [t for t in produced_row if t not in special]
    with pytest.raises(ValueError, match="streamer"):
        model.generate(source_batch(), max_new_tokens=3, num_beams=2, streamer=RecordingStreamer())


@pytest.mark.parametrize("model_type", ALL_TYPES)
@pytest.mark.parametrize("num_beams", [1, 3], ids=["greedy", "beam3"])
def test_a_stopping_criterion_ends_decoding(model_type, num_beams):
    """A custom criterion that stops once the decoder sequence holds 4 tokens: 3 generated tokens for a
    left-to-right model (its start token, then 3), 2 inserted words for insertion decoding (`<s> </s>`, then 2)."""
    model = model_of(model_type)
    with torch.no_grad():
        sequences = model.generate(source_batch(), max_new_tokens=MAX_NEW_TOKENS, num_beams=num_beams,
                                   stopping_criteria=StoppingCriteriaList([StopAfter(4)]))
    assert sequences.shape[1] == 4


def test_indigo_takes_a_max_length_criterion_on_its_insertion_sequence():
    model = tiny_model("indigo")
    with torch.no_grad():
        output = model.generate(source_batch(), max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True,
                                stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(max_length=5)]))
    assert output.insertion_ids.shape[1] == 5 and output.sequences.shape[1] == 5


@pytest.mark.parametrize("name, value", [("force_words_ids", [[7]]), ("constraints", []),
                                         ("num_beam_groups", 3), ("forced_bos_token_id", 7)])
def test_indigo_refuses_left_to_right_only_options_by_name(name, value):
    model = tiny_model("indigo")
    with pytest.raises(ValueError, match=f"InDIGO generate\\(\\): {name}="):
        model.generate(source_batch(), max_new_tokens=3, num_beams=3, **{name: value})


def test_indigo_refuses_decoder_input_ids_but_sets_a_training_batchs_aside():
    """A left-to-right prefix cannot be continued by insertions: refused; a training batch's teacher-forced inputs
    (with its labels, as Seq2SeqTrainer's evaluation passes them) are set aside."""
    model = tiny_model("indigo")
    source = source_batch()
    prefix = torch.tensor([[0, 2, 7]] * 3)
    with pytest.raises(ValueError, match="decoder_input_ids"):
        model.generate(source, max_new_tokens=3, decoder_input_ids=prefix)
    with torch.no_grad():
        expected = model.generate(source, max_new_tokens=3)
        assert torch.equal(model.generate(source, max_new_tokens=3, decoder_input_ids=prefix, labels=prefix), expected)


@pytest.mark.parametrize("model_type", LEFT_TO_RIGHT_TYPES)
@pytest.mark.parametrize(
    "name, value", [("assistant_early_exit", 1), ("guidance_scale", 3.0), ("prefill_chunk_size", 1)]
)
def test_left_to_right_types_refuse_by_name_what_transformers_loop_would_run_wrongly(model_type, name, value):
    """Self-speculative early exit (drafted with every block against a cache sized for fewer: an IndexError that left
    `config.num_hidden_layers` lowered), classifier-free guidance (a decoder call without encoder states) and chunked
    prefill (which dropped the source mask: padded sources changed their output) are refused by name, and the model
    decodes as before afterwards."""
    model = tiny_model(model_type)
    source = source_batch()[:1]
    with torch.no_grad():
        before = model.generate(source, max_new_tokens=3)
        with pytest.raises(ValueError, match=f"generate\\(\\): {name}="):
            model.generate(source, max_new_tokens=3, **{name: value})
        assert torch.equal(model.generate(source, max_new_tokens=3), before)
