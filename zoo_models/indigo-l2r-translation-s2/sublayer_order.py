"""The order of sub-layers inside a block as data (the seam IOT extends): the names of the sub-layers, an order
per batch row, and the schedule that runs rows of different orders together."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# Sub-layers that run once per contiguous row block rather than once on gathered rows: only self-attention,
# whose growing cache a gather would copy. Cross-attention's fixed-size source keys are cheaper to gather than a
# second call (IOT's 4 mixed orders, 32 rows: greedy 1.33× → 1.20× the baseline).
SPLIT_ATTENTION_NAMES = ("self_attn",)


ENCODER_SUBLAYERS = ("self_attn", "ffn")


DECODER_SUBLAYERS = ("self_attn", "encoder_attn", "ffn")


@dataclass
class PerRowSublayerOrder:
    """A sub-layer order per batch row: row r runs `orders[order_index[r]]`.

    Build it once per batch (e.g. once per `generate()` call) and pass the same object to every layer and step:
    the grouping of rows by stage is computed once and kept on it.

    `row_blocks`, when the caller knows the rows' layout on the host, is that layout as consecutive
    `(candidate, row count)` blocks, in row order (IOT training stacks its order paths this way). The plan is
    then built from these numbers alone: no host sync on `order_index`, so a compiled training step stays one
    graph (`torch.compile(fullgraph=True)`).
    """

    order_index: torch.LongTensor
    orders: Sequence[tuple[str, ...]]
    row_blocks: tuple[tuple[int, int], ...] | None = None
    # Not functools.cached_property: its lock (Python < 3.12) is a context manager torch.compile cannot trace.
    _plan: list | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_row_blocks(
        cls, row_blocks: Sequence[tuple[int, int]], orders: Sequence[tuple[str, ...]], device=None
    ) -> PerRowSublayerOrder:
        """Rows laid out as consecutive `(candidate, row count)` blocks; `order_index` is built from them."""
        row_blocks = tuple((int(candidate), count) for candidate, count in row_blocks)
        order_index = torch.cat(
            [torch.full((count,), candidate, dtype=torch.long, device=device) for candidate, count in row_blocks]
        )
        return cls(order_index, orders, row_blocks)

    @property
    def stage_plan(self) -> list[list[tuple[str, torch.Tensor | slice | None]]]:
        """The steps that run every row's sub-layers in its own order: each step is one sub-layer, applied to the
        rows whose *next* sub-layer it is, as a list of (sub-layer, rows) entries; `rows=None` = every row.

        The sequence of sub-layers is a shortest common supersequence of the orders present in the batch
        (`shortest_common_schedule`): the default 4 decoder orders of IOT need 5 sub-layer calls per block this
        way, against 8 when rows are grouped stage by stage. Rows that form one contiguous block are a `slice`
        (views instead of copies of the hidden states, the cache and the encoder states; sort the batch by order
        to get them); a self-attention sub-layer whose rows form a few (≤ number of orders) contiguous blocks runs
        once per block, so its cache rows are never copied (`SPLIT_ATTENTION_NAMES`). While `torch.export` traces,
        rows are a boolean row mask instead (`_masked_plan`).
        """
        if self._plan is None:
            self._plan = self._build_plan()
        return self._plan

    def _build_plan(self) -> list[list[tuple[str, torch.Tensor | slice | None]]]:
        num_stages = len(self.orders[0])
        if any(len(order) != num_stages for order in self.orders):
            raise ValueError(f"orders must all have the same length, got {list(self.orders)}")
        if self.row_blocks is None and torch.compiler.is_exporting():
            return self._masked_plan()
        if self.row_blocks is not None:
            spans: dict[int, list[tuple[int, int]]] = {}
            start = 0
            for candidate, count in self.row_blocks:
                spans.setdefault(candidate, []).append((start, start + count))
                start += count
            present = sorted(spans)
        else:
            present = sorted(set(self.order_index.tolist()))
            order_rows = {i: torch.nonzero(self.order_index == i).squeeze(1) for i in present}
        schedule = shortest_common_schedule([tuple(self.orders[i]) for i in present])
        progress = {i: 0 for i in present}
        plan = []
        for name in schedule:
            movers = [i for i in present if progress[i] < num_stages and self.orders[i][progress[i]] == name]
            for i in movers:
                progress[i] += 1
            if len(movers) == len(present):
                plan.append([(name, None)])
                continue
            if self.row_blocks is not None:
                blocks = _merged_spans([span for i in movers for span in spans[i]])
                rows = None
            else:
                rows = torch.sort(torch.cat([order_rows[i] for i in movers])).values
                blocks = contiguous_blocks(rows)
            if len(blocks) == 1 or (name in SPLIT_ATTENTION_NAMES and len(blocks) <= len(self.orders)):
                plan.append([(name, block) for block in blocks])
            else:
                if rows is None:
                    rows = torch.cat(
                        [torch.arange(block.start, block.stop, device=self.order_index.device) for block in blocks]
                    )
                plan.append([(name, rows)])
        return plan

    def _masked_plan(self) -> list[list[tuple[str, torch.Tensor | None]]]:
        """The plan for `torch.export`, built without reading `order_index` on the host (which orders are present,
        which rows share one: data-dependent control flow an exported graph cannot hold). Its steps follow a
        shortest common schedule of *every* candidate order; a step runs its sub-layer on every row and keeps the
        result only in the rows whose next sub-layer it is, given as a boolean row mask `[batch]` (IOT's 4 default
        decoder orders: 5 sub-layer calls per block on all rows, against 3 on their own rows in eager mode)."""
        candidates = range(len(self.orders))
        num_stages = len(self.orders[0])
        schedule = shortest_common_schedule([tuple(order) for order in self.orders])
        progress = [0 for _ in candidates]
        plan = []
        for name in schedule:
            movers = [i for i in candidates if progress[i] < num_stages and self.orders[i][progress[i]] == name]
            for i in movers:
                progress[i] += 1
            if len(movers) == len(self.orders):
                plan.append([(name, None)])
                continue
            moving = torch.tensor([i in movers for i in candidates], device=self.order_index.device)
            plan.append([(name, moving[self.order_index])])
        return plan

    def select(self, rows: torch.Tensor) -> "PerRowSublayerOrder":
        return PerRowSublayerOrder(self.order_index.index_select(0, rows), self.orders)


def _merged_spans(spans: list[tuple[int, int]]) -> list[slice]:
    """Row spans `[start, stop)` → the maximal runs of consecutive rows, as slices (`contiguous_blocks` on the
    host-side layout)."""
    spans = sorted(spans)
    blocks = [list(spans[0])]
    for start, stop in spans[1:]:
        if start == blocks[-1][1]:
            blocks[-1][1] = stop
        else:
            blocks.append([start, stop])
    return [slice(start, stop) for start, stop in blocks]


def shortest_common_schedule(orders: Sequence[tuple[str, ...]]) -> tuple[str, ...]:
    """A shortest sequence of sub-layer names that contains every order as a subsequence (breadth-first over the
    rows' progress, so the first complete sequence found is a shortest one; ≤ 7 steps for any set of 3-sub-layer
    orders). Running its steps in turn, each on the rows whose next sub-layer it is, applies every order."""
    orders = [tuple(order) for order in orders]
    names = sorted({name for order in orders for name in order})
    start = tuple(0 for _ in orders)
    goal = tuple(len(order) for order in orders)
    frontier, seen = [(start, ())], {start}
    while frontier:
        next_frontier = []
        for progress, schedule in frontier:
            if progress == goal:
                return schedule
            for name in names:
                advanced = tuple(
                    step + 1 if step < len(order) and order[step] == name else step
                    for order, step in zip(orders, progress)
                )
                if advanced != progress and advanced not in seen:
                    seen.add(advanced)
                    next_frontier.append((advanced, schedule + (name,)))
        frontier = next_frontier
    raise ValueError(f"no schedule for orders {orders}")


def contiguous_blocks(rows: torch.Tensor) -> list[slice]:
    """Sorted row indices → the maximal runs of consecutive rows, as slices (one host sync, at planning time)."""
    values = rows.tolist()
    blocks, start = [], values[0]
    for previous, current in zip(values, values[1:]):
        if current != previous + 1:
            blocks.append(slice(start, previous + 1))
            start = current
    blocks.append(slice(start, values[-1] + 1))
    return blocks


def check_order(order: Sequence[str], allowed: tuple[str, ...]) -> None:
    if sorted(order) != sorted(allowed):
        raise ValueError(f"sublayer_order {tuple(order)} must be a permutation of {allowed}")
