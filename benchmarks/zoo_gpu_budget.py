"""The budget in updates of the zoo's GPU recipes from a speed probe (benchmarks/zoo_gpu.sh, step 1).

    python3 benchmarks/zoo_gpu_budget.py LOG_DIR TRAIN_SECONDS PROBE_BUDGET EVAL_EVERY RECIPE [RECIPE ...]

reads ``LOG_DIR/probe-<recipe>.log`` (the output of ``flexformers-zoo run <recipe>`` while the recipes trained side by
side), takes each recipe's updates per second from its training progress bar, and prints the budget that the
slowest of them trains within ``TRAIN_SECONDS`` (with a 10% margin, rounded down to a multiple of ``EVAL_EVERY`` so
that the last update is a curve point). The rates go to standard error.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

#: tqdm's training bar, "<done>/<total> [<elapsed><<left>, <rate>]"
_BAR = re.compile(r"(\d+)/(\d+) \[(\d+(?::\d+)+)<")


def training_rate(log_text: str, probe_budget: int) -> float:
    """Updates per second over the training so far: the last training bar's updates over its elapsed time (the
    other bars of a zoo log, corpus maps and evaluation batches, have other totals)."""
    bars = [(int(done), elapsed) for done, total, elapsed in _BAR.findall(log_text.replace("\r", "\n"))
            if int(total) == probe_budget]
    if not bars or bars[-1][0] == 0:
        raise ValueError(f"no training progress (a bar counting to {probe_budget} updates) in the probe's log")
    done, elapsed = bars[-1]
    seconds = 0
    for part in elapsed.split(":"):
        seconds = 60 * seconds + int(part)
    return done / max(1, seconds)


def budget_for(rates: dict[str, float], train_seconds: float, eval_every: int, margin: float = 0.9) -> int:
    """The updates the slowest recipe trains in ``train_seconds``, less the margin, in whole curve intervals."""
    if not rates:
        raise ValueError("no probe rates")
    updates = int(margin * min(rates.values()) * train_seconds) // eval_every * eval_every
    return max(eval_every, updates)


def main(argv: list[str]) -> int:
    if len(argv) < 5:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    log_dir, train_seconds, probe_budget, eval_every, names = Path(argv[0]), float(argv[1]), int(argv[2]), \
        int(argv[3]), argv[4:]
    rates = {}
    for name in names:
        path = log_dir / f"probe-{name}.log"
        try:
            rates[name] = training_rate(path.read_text(errors="replace"), probe_budget)
        except (OSError, ValueError) as error:
            print(f"zoo_gpu_budget: {path}: {error}", file=sys.stderr)
            return 1
        print(f"probe: {name} {rates[name]:.2f} updates/s", file=sys.stderr)
    print(budget_for(rates, train_seconds, eval_every))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
