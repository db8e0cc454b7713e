"""Byte-level BPE tokenizers trained with ``tokenizers`` and wrapped as ``PreTrainedTokenizerFast``.

Every tokenizer has the special tokens ``<s>``=0, ``<pad>``=1, ``</s>``=2, ``<unk>``=3, ``<eod>``=4 (InDIGO's
end-of-decoding) and appends ``</s>`` to every encoded text (fairseq's convention for source and target).
Byte-level pre-tokenisation keeps whitespace and newlines, so code round-trips exactly (indentation included)
and there are no unknown characters.

Joint vocabulary (default, the papers' setting for IWSLT-sized data: one 10k BPE for both sides): a single
tokenizer saved in the model directory. Separate vocabularies: the *target* tokenizer is saved in the model
directory (it decodes generations) and the source tokenizer in ``<model dir>/source_tokenizer``;
:func:`load_tokenizers` returns both.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>", "<eod>")
SOURCE_TOKENIZER_SUBDIR = "source_tokenizer"


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int = 10000, min_frequency: int = 2, model_max_length: int = 1024
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` (an iterable of strings, e.g. a training split)."""
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + 256} (specials + 256 bytes), got {vocab_size}")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    eos_id = backend.token_to_id("</s>")
    backend.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos_id)]
    )
    tokenizer = wrap_tokenizer(backend, model_max_length)
    check_special_ids(tokenizer)
    return tokenizer


def wrap_tokenizer(backend: Tokenizer, model_max_length: int = 1024) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=["<eod>"],
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


def check_special_ids(tokenizer) -> None:
    """Raise ``ValueError`` unless the tokenizer maps the special tokens to the ids every model expects."""
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        actual = tokenizer.convert_tokens_to_ids(token)
        if actual != expected_id:
            raise ValueError(f"tokenizer maps {token!r} to id {actual}; flexformers needs {expected_id}")


def build_tokenizers(
    source_texts: Iterable[str],
    target_texts: Iterable[str],
    joint: bool = True,
    vocab_size: int = 10000,
    target_vocab_size: int | None = None,
    min_frequency: int = 2,
) -> tuple[PreTrainedTokenizerFast, PreTrainedTokenizerFast]:
    """(source tokenizer, target tokenizer); the same object twice for a joint vocabulary of ``vocab_size``.
    Separate vocabularies use ``vocab_size`` for the source and ``target_vocab_size`` (default: the same) for the
    target."""
    source_texts, target_texts = list(source_texts), list(target_texts)
    if joint:
        tokenizer = train_bpe_tokenizer(source_texts + target_texts, vocab_size, min_frequency)
        return tokenizer, tokenizer
    source = train_bpe_tokenizer(source_texts, vocab_size, min_frequency)
    target = train_bpe_tokenizer(target_texts, target_vocab_size or vocab_size, min_frequency)
    return source, target


def save_tokenizers(output_dir: str | os.PathLike, source_tokenizer, target_tokenizer) -> None:
    """Save beside the model: target (or joint) tokenizer in ``output_dir``, a separate source tokenizer in
    ``output_dir/source_tokenizer``."""
    output_dir = Path(output_dir)
    target_tokenizer.save_pretrained(str(output_dir))
    if source_tokenizer is not target_tokenizer:
        source_tokenizer.save_pretrained(str(output_dir / SOURCE_TOKENIZER_SUBDIR))


def separate_vocabularies(path: str | os.PathLike) -> bool | None:
    """Whether the model saved in ``path`` has separate source and target vocabularies (its ``config.json`` sets
    ``target_vocab_size`` without ``share_all_embeddings``, as ``--joint_vocab false`` does); ``None`` when ``path``
    holds no readable model config (a tokenizer-only directory)."""
    config_path = Path(path) / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(config, dict) or "model_type" not in config:
        return None
    return config.get("target_vocab_size") is not None and not config.get("share_all_embeddings", False)


def check_tokenizer_layout(path: str | os.PathLike) -> None:
    """Raise ``ValueError`` when the tokenizers saved in ``path`` do not match the vocabularies of the model saved
    there: a separate-vocabulary model without ``source_tokenizer/`` (it would encode its inputs with the target
    vocabulary: wrong ids, no error), or a joint-vocabulary model with a stray ``source_tokenizer/``. A directory
    without a model config is not checked."""
    path = Path(path)
    source_dir = path / SOURCE_TOKENIZER_SUBDIR
    separate = separate_vocabularies(path)
    if separate and not (source_dir / "tokenizer.json").is_file():
        raise ValueError(
            f"{path}: config.json says the model has separate source and target vocabularies, but "
            f"{SOURCE_TOKENIZER_SUBDIR}/tokenizer.json is missing; the target tokenizer cannot stand in for the "
            f"source one (restore {source_dir} from the training run)"
        )
    if separate is False and source_dir.exists():
        raise ValueError(
            f"{path}: config.json says the model has one joint vocabulary, but {source_dir} exists; it belongs to "
            f"another model (remove or move it)"
        )


def load_tokenizers(path: str | os.PathLike) -> tuple[PreTrainedTokenizerFast, PreTrainedTokenizerFast]:
    """(source tokenizer, target tokenizer) saved by :func:`save_tokenizers` (the same object when joint); when
    ``path`` also holds the model's ``config.json`` they must match its vocabularies
    (:func:`check_tokenizer_layout`)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"{path} has no tokenizer.json (train a model with flexformers-train, which saves one)")
    check_tokenizer_layout(path)
    source_dir = path / SOURCE_TOKENIZER_SUBDIR
    target = PreTrainedTokenizerFast.from_pretrained(str(path))
    check_special_ids(target)
    if source_dir.is_dir():
        source = PreTrainedTokenizerFast.from_pretrained(str(source_dir))
        check_special_ids(source)
        return source, target
    return target, target
