"""Configuration of InDIGO, insertion-based decoding with inferred generation order (Gu et al., TACL 2019)."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict

from .configuration_flexformer import FlexformerConfig

POINTER_DECISIONS = ("position", "slot")


@strict(accept_kwargs=True)
class InDIGOConfig(FlexformerConfig):
    r"""Configuration of :class:`InDIGOForConditionalGeneration` (model type ``indigo``).

    All :class:`FlexformerConfig` fields apply (fairseq names). ``decoder_use_positions`` defaults to ``False``: the
    decoder sees only the ternary relative positions of Eq. 3/7, as in the paper. ``True`` (an ablation, not the
    paper's model) adds the backbone's absolute embedding of each word's *insertion step* — its index in generation
    order, which later insertions never change, so cached states stay valid (Sec. 3.2's reason for relative positions
    is that a word's place in the sentence does change). Under the L2R order the insertion step is the word's place,
    as the baseline's decoder positions are; it isolates the positional cue when comparing L2R-InDIGO with the
    baseline. InDIGO adds:

    - ``eod_token_id`` (default 4): the end-of-decoding token ``<eod>`` (Eq. 2), always inserted immediately left
      of ``</s>``, last in every order. ``bos_token_id`` (``<s>``, 0) and ``eos_token_id`` (``</s>``, 2) are the
      left and right boundaries, the initial partial sequence of Algorithm 1.
    - ``encoder_use_positions``: set ``False`` for word order recovery (the source is a bag of words, Sec. 5.1).
    - ``pointer_decision``: how decoding picks the insertion place. ``"position"`` (default) uses the model's
      probability of a relative position, the sum of its two equivalent slots (Eq. 11, the same quantity the
      training loss and SAO score); ``"slot"`` takes the arg-max pointer slot k of Eq. 9 as in Algorithm 1
      (both slots of one gap give the same sequence).
    - ``word_query_projection`` (default ``True``): the matrix F of Eq. 8 between the last state and the output
      embedding; ``False`` drops it (the plain Transformer output layer).
    """

    model_type = "indigo"

    decoder_use_positions: bool = False
    eod_token_id: int = 4
    pointer_decision: str = "position"
    word_query_projection: bool = True

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.validate_indigo_fields()

    def validate_indigo_fields(self) -> None:
        """InDIGO's own fields; raises a ``ValueError`` naming the field."""
        if self.pointer_decision not in POINTER_DECISIONS:
            raise ValueError(f"pointer_decision must be one of {POINTER_DECISIONS}, got {self.pointer_decision!r}")
        vocab = min(self.vocab_size, self.decoder_vocab_size)
        for field in ("eod_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, field)
            if not isinstance(value, int) or not 0 <= value < vocab:
                raise ValueError(f"{field}={value!r} is invalid: InDIGO needs it as one id inside the vocabulary")
        special = {"bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id, "eod_token_id": self.eod_token_id}
        if len(set(special.values())) != 3 or self.pad_token_id in special.values():
            raise ValueError(f"InDIGO's <s>, </s>, <eod> and <pad> ids must differ, got {special} and pad={self.pad_token_id}")


__all__ = ["InDIGOConfig"]
