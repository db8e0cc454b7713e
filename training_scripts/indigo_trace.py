"""Render InDIGO insertion traces like Fig. 5 of the paper (``flexformers-indigo-trace``).

    flexformers-indigo-trace --model_dir runs/indigo-sao --source "order words these recover" \\
        --png trace.png --json trace.json

Every decoding step is shown as the partial sequence *in reading order* with the word inserted at that step
marked: ``[word]`` in text (red and underlined on a terminal with ``--color``), red and underlined in the
picture, as in the paper's figure. ``--json`` writes the raw trace (token, anchor, side, position per step).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from flexformers.modeling.indigo_insertion import absolute_positions_from_relative, reading_order_from_positions


def partial_sequences(insertion_ids: Sequence[int], relative_positions: torch.Tensor) -> list[tuple[list[int], int]]:
    """For each insertion step: (insertion indices of the words present, in reading order; reading position of the
    word just inserted). Uses only R (Eq. 4 on each leading block, which is append-only, Eq. 5); boundaries
    ``<s>``/``</s>`` are included."""
    steps = []
    for count in range(3, len(insertion_ids) + 1):
        positions = absolute_positions_from_relative(relative_positions[:count, :count])
        steps.append((reading_order_from_positions(positions).tolist(), int(positions[count - 1])))
    return steps


def render_text(
    insertion_ids: Sequence[int], relative_positions: torch.Tensor, token_text: Callable[[int], str],
    color: bool = False, show_boundaries: bool = False,
) -> str:
    """One line per step: ``step | partial sequence`` with the new word in brackets (or red + underlined)."""
    lines = []
    for step, (reading, new_position) in enumerate(partial_sequences(insertion_ids, relative_positions), start=1):
        words = []
        for position, index in enumerate(reading):
            if not show_boundaries and index in (0, 1):
                continue
            text = token_text(int(insertion_ids[index]))
            if position == new_position:
                text = f"\033[4;31m{text}\033[0m" if color else f"[{text}]"
            words.append(text)
        lines.append(f"{step:>3} | " + " ".join(words))
    return "\n".join(lines)


def render_png(
    insertion_ids: Sequence[int], relative_positions: torch.Tensor, token_text: Callable[[int], str], path: str | Path,
    title: str | None = None,
) -> Path:
    """Fig. 5 style picture: one row per step, words in reading order, the inserted word red and underlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = partial_sequences(insertion_ids, relative_positions)
    height = 0.38 * (len(steps) + 1) + 0.6
    figure = plt.figure(figsize=(12, height))
    axes = figure.add_axes([0, 0, 1, 1])
    axes.set_axis_off()
    renderer = figure.canvas.get_renderer()
    line_height = 1.0 / (len(steps) + 2)
    if title:
        axes.text(0.01, 1 - 0.6 * line_height, title, fontsize=11, weight="bold", va="center", transform=axes.transAxes)
    for row, (reading, new_position) in enumerate(steps):
        y = 1 - (row + 1.6) * line_height
        axes.text(0.01, y, f"{row + 1:>2}", fontsize=9, color="gray", va="center", family="monospace",
                  transform=axes.transAxes)
        x = 0.05
        for position, index in enumerate(reading):
            if index in (0, 1):
                continue
            inserted = position == new_position
            label = axes.text(x, y, token_text(int(insertion_ids[index])), fontsize=10, va="center",
                              color="red" if inserted else "black", transform=axes.transAxes)
            box = label.get_window_extent(renderer=renderer).transformed(axes.transAxes.inverted())
            if inserted:
                axes.plot([box.x0, box.x1], [box.y0 - 0.1 * line_height] * 2, color="red", linewidth=1,
                          transform=axes.transAxes)
            x = box.x1 + 0.008
    path = Path(path)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def trace_to_json(result, row: int, token_text: Callable[[int], str]) -> dict:
    """The trace of one generated sequence as plain data."""
    return {
        "output": [token_text(int(t)) for t in result.sequences[row].tolist() if t not in (0, 1, 2)],
        "steps": [
            {"token": token_text(token), "token_id": token, "anchor": anchor, "side": side, "position": position}
            for token, anchor, side, position in result.insertion_trace[row]
        ],
    }


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: 0 on success; bad input (e.g. another type's model) prints one line, returns 1."""
    from flexformers.training_scripts.decode import run_tool

    return run_tool("flexformers-indigo-trace", run_from_argv, argv)


def run_from_argv(argv: list[str] | None = None) -> list[dict]:
    """Decode sources with an InDIGO checkpoint and print/draw their insertion traces; returns the traces."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", required=True, help="an InDIGO directory written by flexformers-train")
    parser.add_argument("--source", action="append", default=[], help="a source sentence (repeatable)")
    parser.add_argument("--input_file", help="one source sentence per line")
    parser.add_argument("--num_beams", type=int, default=1)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--png", help="write the picture here (several sources: NAME-0.png, NAME-1.png, ...)")
    parser.add_argument("--json", help="write the traces here")
    parser.add_argument("--color", action="store_true", help="ANSI red/underline instead of [brackets]")
    args = parser.parse_args(argv)

    from flexformers.modeling.modeling_indigo import InDIGOForConditionalGeneration
    from flexformers.training_scripts.decode import load_method_model

    model, source_tokenizer, target_tokenizer = load_method_model(
        args.model_dir, InDIGOForConditionalGeneration, "flexformers-indigo-trace", "an InDIGO")
    sources = list(args.source)
    if args.input_file:
        sources += [line.strip() for line in Path(args.input_file).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not sources:
        raise ValueError("give --source or --input_file")
    batch = source_tokenizer(sources, return_tensors="pt", padding=True)
    result = model.generate(
        batch["input_ids"], attention_mask=batch["attention_mask"], num_beams=args.num_beams,
        max_new_tokens=args.max_new_tokens, return_insertion_trace=True,
    )

    def token_text(token_id: int) -> str:
        return target_tokenizer.decode([token_id]).strip() or target_tokenizer.convert_ids_to_tokens(token_id)

    traces = []
    for row, source in enumerate(sources):
        ids = result.insertion_ids[row]
        n = len(result.insertion_trace[row]) + 2
        relations = result.relative_positions[row, :n, :n]
        print(f"source: {source}")
        print(render_text(ids[:n].tolist(), relations, token_text, color=args.color))
        print(f"output: {target_tokenizer.decode(result.sequences[row], skip_special_tokens=True)}\n")
        if args.png:
            target = Path(args.png) if len(sources) == 1 else Path(args.png).with_name(f"{Path(args.png).stem}-{row}.png")
            render_png(ids[:n].tolist(), relations, token_text, target, title=f"source: {source}")
            print(f"picture: {target}")
        traces.append(dict(trace_to_json(result, row, token_text), source=source))
    if args.json:
        Path(args.json).write_text(json.dumps(traces, indent=1, ensure_ascii=False), encoding="utf-8")
    return traces


if __name__ == "__main__":
    sys.exit(main())
