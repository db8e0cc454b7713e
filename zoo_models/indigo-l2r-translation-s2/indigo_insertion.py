"""InDIGO's insertion orders as data (Gu, Liu & Cho, TACL 2019, Sec. 3): relative positions (Eq. 3, 5) and the
absolute positions they imply, the slots and gaps of the pointer (Eq. 9, 11), teacher-forcing batches for a given
generation order, and the weights of the orders SAO finds (Eq. 12).

The conventions (insertion sequences, ``relative_positions``, pointer slots, gaps) are those of
:mod:`modeling_indigo`'s docstring.
"""

from __future__ import annotations

import torch

#: The side of an insertion, and the relation r of Eq. 3 of a word to the left / right of another.
LEFT = -1
RIGHT = 1
#: Insertion decoding starts from ``<s> </s>`` (Sec. 3.1), so a sequence of T words is T + 2 decoder inputs.
START_PAIR_LENGTH = 2


def max_insertion_steps(config) -> int:
    """The most insertion steps one decode may run. Each step ends by reading its new word (the next step's
    pointer needs its state), so after k steps the decoder has read the start pair and k words: with absolute
    insertion-step positions (the ``decoder_use_positions`` ablation) those must fit in ``max_target_positions``,
    as a training target of k words must; without them the table bounds the words alone."""
    if config.decoder_use_positions:
        return config.max_target_positions - START_PAIR_LENGTH
    return config.max_target_positions


def relative_positions_from_absolute(positions: torch.Tensor) -> torch.Tensor:
    """Eq. 3: ``r_{i,j} = -1`` if ``z_j > z_i`` (i left of j), ``0`` if equal, ``+1`` if ``z_j < z_i``.

    ``positions`` ``[..., n]`` (absolute positions z) → ``[..., n, n]`` int8.
    """
    return torch.sign(positions.unsqueeze(-1) - positions.unsqueeze(-2)).to(torch.int8)


def absolute_positions_from_relative(relative_positions: torch.Tensor) -> torch.Tensor:
    """Eq. 4: ``z_i = Σ_j max(0, r_{i,j})`` — the number of words left of word i. ``[..., n, n]`` → ``[..., n]``."""
    return relative_positions.clamp(min=0).sum(-1, dtype=torch.long)


def insertion_relative_position(relative_positions: torch.Tensor, anchor: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
    """Eq. 6: the relative position of a word inserted on ``side`` (-1 left, +1 right) of word ``anchor``.

    ``r_{t+1,j} = s`` for ``j = k`` and ``r_{k,j}`` otherwise: the new word relates to every other word as its
    anchor does. ``relative_positions`` ``[b, n, n]``, ``anchor``/``side`` ``[b]`` → ``[b, n]`` int8.
    """
    rows = relative_positions[torch.arange(relative_positions.shape[0], device=anchor.device), anchor].clone()
    rows.scatter_(1, anchor[:, None], side[:, None].to(rows.dtype))
    return rows


def append_relative_position(relative_positions: torch.Tensor, new_row: torch.Tensor) -> torch.Tensor:
    """Eq. 5: ``R^{t+1}`` = ``R^t`` bordered by the new row ``r_{t+1}``, its negation as the new column and 0.

    ``relative_positions`` ``[b, n, n]``, ``new_row`` ``[b, n]`` → ``[b, n+1, n+1]``. Earlier entries never change
    (append-only), which is what lets the decoder keep its cache.
    """
    batch, n = new_row.shape
    grown = relative_positions.new_zeros(batch, n + 1, n + 1)
    grown[:, :n, :n] = relative_positions
    grown[:, n, :n] = new_row
    grown[:, :n, n] = -new_row
    return grown


def insertion_neighbors(positions: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For every word n of an insertion sequence, its nearest left and right neighbours among the words
    inserted before it (the two equivalent pointer targets of Eq. 11: right of the left neighbour, left of the
    right neighbour).

    ``positions`` ``[b, L]`` final absolute positions (any order-preserving numbers), ``valid`` ``[b, L]`` bool.
    Returns ``(left, right)`` ``[b, L]`` insertion indices; ``-1`` for index 0 and 1 (the boundaries, never inserted)
    and for invalid words.
    """
    length = positions.shape[1]
    index = torch.arange(length, device=positions.device)
    earlier = (index[None, :] < index[:, None])[None] & valid[:, None, :]  # [b, n, j]: j inserted before n
    z_new = positions[:, :, None]
    z_old = positions[:, None, :].expand(-1, length, -1)
    big = torch.iinfo(torch.long).max
    left_candidates = earlier & (z_old < z_new)
    right_candidates = earlier & (z_old > z_new)
    left = torch.where(left_candidates, z_old, torch.full_like(z_old, -big)).argmax(-1)
    right = torch.where(right_candidates, z_old, torch.full_like(z_old, big)).argmin(-1)
    defined = valid & (index[None, :] >= 2) & left_candidates.any(-1) & right_candidates.any(-1)
    return left.masked_fill(~defined, -1), right.masked_fill(~defined, -1)


def gap_log_probs(slot_log_probs: torch.Tensor, reading_order: torch.Tensor) -> torch.Tensor:
    """Eq. 11: log p of each relative position (gap) = log(p_right(word at g-1) + p_left(word at g)).

    ``slot_log_probs`` ``[..., 2n]`` (layout of Eq. 9 described in the module docstring), ``reading_order``
    ``[..., n]`` (insertion index of the word at each reading position) → ``[..., n-1]`` for gaps ``1..n-1``.
    """
    n = reading_order.shape[-1]
    left, right = slot_log_probs[..., :n], slot_log_probs[..., n:]
    return torch.logaddexp(right.gather(-1, reading_order[..., :-1]), left.gather(-1, reading_order[..., 1:]))


def reading_order_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """Algorithm 1's final reordering: insertion indices sorted by absolute position (``[..., n]``)."""
    return positions.argsort(dim=-1)


def build_insertion_batch(
    target_ids: torch.Tensor,
    target_lengths: torch.Tensor,
    orders: torch.Tensor,
    bos_token_id: int = 0,
    eos_token_id: int = 2,
    eod_token_id: int = 4,
    pad_token_id: int = 1,
    check_orders: bool = True,
) -> dict[str, torch.Tensor]:
    """Teacher-forcing tensors for targets generated in given orders (Sec. 4.2, pre-defined orders and SAO).

    ``target_ids`` ``[b, T]`` reading order (padded), ``target_lengths`` ``[b]``, ``orders`` ``[b, T]`` with
    ``orders[i, :len_i]`` a permutation of ``0..len_i-1`` (the reading index generated at each step).
    Returns, for ``L = T + 2``:

    - ``decoder_input_ids`` ``[b, L]``: ``<s> </s> y_order[0] .. y_order[len-1]`` then padding;
    - ``decoder_attention_mask`` ``[b, L]``;
    - ``relative_positions`` ``[b, L, L]`` int8 (Eq. 3 from the final positions, which every step agrees with);
    - ``insertion_targets`` ``[b, L]``: at index i the word inserted next (Eq. 8 targets), ``<eod>`` after the last
      word, ``-100`` elsewhere;
    - ``pointer_targets`` ``[b, L, 2]``: at index i the left and right neighbour (insertion indices) of the word
      inserted next (Eq. 11 targets), ``-100`` where no word is inserted.

    ``check_orders=False`` skips checking that the orders are permutations (a host sync) for orders that are by
    construction.
    """
    batch, max_len = target_ids.shape
    if orders.shape != target_ids.shape:
        raise ValueError(f"orders {tuple(orders.shape)} must have the shape of target_ids {tuple(target_ids.shape)}")
    device = target_ids.device
    steps = torch.arange(max_len, device=device)
    in_target = steps[None, :] < target_lengths[:, None]
    safe_orders = torch.where(in_target, orders, steps[None, :].expand(batch, -1))
    if check_orders and bool((safe_orders.sort(-1).values != steps[None, :]).any()):
        raise ValueError("orders: every row must be a permutation of 0..length-1 over its target length")
    length = max_len + START_PAIR_LENGTH
    generated = target_ids.gather(1, safe_orders).masked_fill(~in_target, pad_token_id)
    decoder_input_ids = torch.cat(
        [torch.full((batch, 1), bos_token_id, device=device), torch.full((batch, 1), eos_token_id, device=device), generated],
        dim=1,
    ).long()
    valid = torch.cat([torch.ones(batch, 2, dtype=torch.bool, device=device), in_target], dim=1)
    # Padding words get positions beyond </s> so the relations of real words are untouched.
    positions = torch.cat(
        [
            torch.zeros(batch, 1, dtype=torch.long, device=device),
            (target_lengths + 1)[:, None].long(),
            torch.where(in_target, safe_orders + 1, target_lengths[:, None] + 2 + steps[None, :]),
        ],
        dim=1,
    )
    relative_positions = relative_positions_from_absolute(positions)
    insertion_targets = torch.full((batch, length), -100, dtype=torch.long, device=device)
    insertion_targets[:, 1:-1] = torch.where(in_target, generated, torch.full_like(generated, -100))
    insertion_targets.scatter_(1, (target_lengths + 1)[:, None].long(), eod_token_id)
    left, right = insertion_neighbors(positions, valid)
    pointer_targets = torch.full((batch, length, 2), -100, dtype=torch.long, device=device)
    pointer_targets[:, :-1, 0] = left[:, 1:].masked_fill(left[:, 1:] < 0, -100)
    pointer_targets[:, :-1, 1] = right[:, 1:].masked_fill(right[:, 1:] < 0, -100)
    return {
        "decoder_input_ids": decoder_input_ids,
        "decoder_attention_mask": valid.long(),
        "relative_positions": relative_positions,
        "insertion_targets": insertion_targets,
        "pointer_targets": pointer_targets,
    }


SAO_ORDER_WEIGHTINGS = ("uniform", "posterior")


def sao_order_weights(scores: torch.Tensor, weighting: str = "uniform") -> torch.Tensor:
    """Weights of the orders found by SAO in the training loss, per sentence (``scores`` ``[b, B]`` = log p(y_π|x),
    ``-inf`` for missing beams).

    ``"uniform"``: Eq. 12, ``q(π|x, y) = 1/B`` on the beam (the paper). ``"posterior"``: ``q ∝ p_θ(y_π|x)`` on the
    beam — the exact posterior restricted to the found orders (a tighter ELBO); it keeps very unlikely orders from
    dominating the gradient when the model is already confident (an option, not in the paper).
    """
    if weighting not in SAO_ORDER_WEIGHTINGS:
        raise ValueError(f"sao_order_weighting must be one of {SAO_ORDER_WEIGHTINGS}, got {weighting!r}")
    finite = torch.isfinite(scores)
    if weighting == "uniform":
        return finite.float() / finite.sum(-1, keepdim=True).clamp(min=1)
    return scores.float().masked_fill(~finite, float("-inf")).softmax(-1)


def replay_insertions(tokens: list[int], anchors: list[int], sides: list[int]) -> list[int]:
    """Plain-list reference of Algorithm 1: insert ``tokens[s]`` on ``sides[s]`` of the word with insertion index
    ``anchors[s]``, starting from ``[<s>, </s>]`` (insertion indices 0, 1). Returns insertion indices in reading order."""
    reading = [0, 1]
    for step, (anchor, side) in enumerate(zip(anchors, sides)):
        at = reading.index(anchor) + (1 if side == RIGHT else 0)
        reading.insert(at, step + 2)
    if len(tokens) != len(anchors):
        raise ValueError("replay_insertions: one anchor and one side per token")
    return reading
