"""Decoding constrained to a permutation of the source's words (word-order recovery).

Word-order recovery asks for the input's words in their original order, so every correct output is a permutation
of the input's whitespace-separated words. :class:`SourceWordPermutation`, a ``prefix_allowed_tokens_fn`` for
``generate()``, lets a left-to-right decoder emit exactly that: at each step only tokens that continue a word
still left in the source's bag, or start one, are allowed, and ``</s>`` only once every word is placed. The model
still chooses the order; the constraint removes dropped, repeated and invented words (a small model's typical
errors, e.g. ``free GPLvribute``).

The words are matched as the target tokenizer writes them in running text: the first word of the output as
``tokenize(word)``, every later word as ``tokenize(" " + word)`` (byte-level BPE marks a leading space, so the two
differ). It works with greedy and beam search of every left-to-right flexformers model (IOT, which regroups a
batch by decoder order inside ``generate()``, passes each hypothesis's original sentence index).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

#: One partial reading of a hypothesis: (counts of each source word type still to place, the word being written
#: (its type index, or -1 before the first word), how many of its tokens are written, whether it is the first word).
_Reading = tuple[tuple[int, ...], int, int, bool]


def _token_ids(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


class _SourceBag:
    """The words of one source: their distinct forms, counts, and token sequences as first / later word."""

    def __init__(self, source: str, tokenizer):
        counts = Counter(source.split())
        self.words = list(counts)
        self.counts = tuple(counts[word] for word in self.words)
        self.first_tokens = [_token_ids(tokenizer, word) for word in self.words]
        self.later_tokens = [_token_ids(tokenizer, " " + word) for word in self.words]

    def tokens(self, word: int, first: bool) -> tuple[int, ...]:
        return self.first_tokens[word] if first else self.later_tokens[word]


class SourceWordPermutation:
    """Allow only outputs that are a permutation of each source's whitespace-separated words: a
    ``prefix_allowed_tokens_fn`` for ``generate()`` (Transformers' per-sentence constraint hook).

    ``model.generate(**batch, prefix_allowed_tokens_fn=SourceWordPermutation(sources, tokenizer, eos_token_id))``

    Args:
        sources: the source texts of the batch, in batch order (``generate`` passes each hypothesis's sentence index).
        tokenizer: the target tokenizer (it must write every word as its own tokens, as byte-level BPE does).
        eos_token_id: the end-of-sequence id, allowed only when every source word is placed.
        prompt_length: tokens at the start of each decoder sequence that are not output (the decoder start token).
    """

    def __init__(self, sources: Sequence[str], tokenizer, eos_token_id: int, prompt_length: int = 1):
        if not sources:
            raise ValueError("SourceWordPermutation needs at least one source text")
        empty = [index for index, source in enumerate(sources) if not source.split()]
        if empty:
            raise ValueError(f"source {empty[0] + 1} has no words; a permutation of its words is empty")
        self.bags = [_SourceBag(source, tokenizer) for source in sources]
        self.eos_token_id = eos_token_id
        self.prompt_length = prompt_length
        self._readings: dict[tuple[int, tuple[int, ...]], frozenset[_Reading]] = {}

    def _advance(self, bag: _SourceBag, readings: frozenset[_Reading], token: int) -> frozenset[_Reading]:
        following = set()
        for remaining, word, written, first in readings:
            if word >= 0:
                tokens = bag.tokens(word, first)
                if written < len(tokens):
                    if tokens[written] == token:
                        following.add((remaining, word, written + 1, first))
                    continue
            starts_first = word < 0
            for candidate, count in enumerate(remaining):
                if count and bag.tokens(candidate, starts_first)[0] == token:
                    left = remaining[:candidate] + (count - 1,) + remaining[candidate + 1:]
                    following.add((left, candidate, 1, starts_first))
        return frozenset(following)

    def readings(self, sentence: int, output: tuple[int, ...]) -> frozenset[_Reading]:
        """Every way ``output`` (tokens after the prompt) can be read as words of source ``sentence``; empty when it
        cannot. Memoised by prefix, so each step of a hypothesis costs one token's transition."""
        key = (sentence, output)
        cached = self._readings.get(key)
        if cached is not None:
            return cached
        bag = self.bags[sentence]
        if output:
            readings = self._advance(bag, self.readings(sentence, output[:-1]), output[-1])
        else:
            readings = frozenset({(bag.counts, -1, 0, True)})
        self._readings[key] = readings
        return readings

    def allowed_tokens(self, sentence: int, output: tuple[int, ...]) -> set[int] | None:
        """Token ids that may follow ``output`` for source ``sentence``; ``None`` when ``output`` is not a reading
        of the source (a hypothesis that already ended, with padding after its ``</s>``)."""
        readings = self.readings(sentence, output)
        if not readings:
            return None
        bag = self.bags[sentence]
        allowed: set[int] = set()
        for remaining, word, written, first in readings:
            if word >= 0:
                tokens = bag.tokens(word, first)
                if written < len(tokens):
                    allowed.add(tokens[written])
                    continue
            for candidate, count in enumerate(remaining):
                if count:
                    allowed.add(bag.tokens(candidate, word < 0)[0])
            if word >= 0 and not any(remaining):
                allowed.add(self.eos_token_id)
        return allowed

    def __call__(self, batch_id: int, input_ids: torch.Tensor) -> list[int]:
        """``prefix_allowed_tokens_fn``: the tokens allowed after one hypothesis (``input_ids``, prompt included)
        of sentence ``batch_id``; only ``</s>`` once it has ended."""
        if batch_id >= len(self.bags):
            raise ValueError(f"sentence {batch_id} of the batch, but only {len(self.bags)} sources were given: pass "
                             "the batch's sources in order")
        output = tuple(input_ids[self.prompt_length:].tolist())
        if self.eos_token_id in output:
            return [self.eos_token_id]
        allowed = self.allowed_tokens(batch_id, output)
        return sorted(allowed) if allowed else [self.eos_token_id]


def uses_permutation_of_source(requested: bool | None, task: str, model_type: str) -> bool:
    """Whether outputs are constrained to permutations of the source words: ``requested`` if given, else on for
    word-order recovery with a decoder that writes left to right (its ``MethodSpec.decodes_left_to_right``). A
    prefix constraint does not apply to one that does not (InDIGO inserts tokens anywhere): asking for it there is a
    ``ValueError``."""
    from flexformers.training_scripts.model_registry import get_method_spec

    spec = get_method_spec(model_type)
    if requested is None:
        return task == "word_order" and spec.decodes_left_to_right
    if requested and not spec.decodes_left_to_right:
        raise ValueError(f"--permutation_of_source constrains left-to-right decoding; {spec.name} ({model_type}) does "
                         "not write its output left to right, so it cannot be used with it")
    return requested
