"""Mutation score of the modules that carry the numbers, each against its own test files (mutmut 3).

Each group below (modules + the test files that own them) is staged in its own folder, laid out as the installed
package (``flexformers/modeling/...``, so mutmut's module names are the ones the tests import), and mutated there
with ``mutmut run``; the repository itself is never touched. mutmut runs, for every mutant, only the tests that
reached the mutated function (fastest first, stopping at the first failure), forking from a server that has
imported torch once, so a group takes minutes rather than hours.

Lines that only build an error or warning message (``raise ...``, ``warnings.warn(...)``, ``logger.*``) are not
mutated: a changed message is not a wrong number, and the checks that decide *whether* to raise are still mutated.

Survivors judged equivalent (no input can tell them from the original) are listed, with why, in
``benchmarks/mutation_equivalent.json`` and left out of the score: score = (killed + timed out) / (checked -
equivalent); a mutant that makes the tests hang counts as caught, as in mutmut.

    pip install "mutmut>=3.8,<4"
    python benchmarks/mutation_score.py --sample 30 --seed 1 --label after_seed1   # a sample of each module
    python benchmarks/mutation_score.py --group iot --sample 30 --seed 0 --survivors   # one group, surviving diffs
    python benchmarks/mutation_score.py --count_only          # how many mutants each module has

Not part of CI: every mutant (about 14,000) takes about four hours on 2 cores, a sample of 30 a module about one.
Results: ``benchmarks/results/mutation_score.json``; the rules and the tables: ``docs/MUTATION.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EQUIVALENT_FILE = REPO / "benchmarks" / "mutation_equivalent.json"
RESULTS_FILE = REPO / "benchmarks" / "results" / "mutation_score.json"

# The repository's top-level folders and where setup.cfg installs them.
PACKAGE_LAYOUT = {
    "flexformers": "flexformers",
    "configuration": "flexformers/configuration",
    "modeling": "flexformers/modeling",
    "training_scripts": "flexformers/training_scripts",
    "metrics": "flexformers/metrics",
    "hub_cards": "flexformers/hub_cards",
}

# Test files that check several groups' modules: independent references and stored outputs, the random paths and
# every option of the methods.
REFERENCES = "tests/test_reference_maths.py"
RANDOM_PATHS = "tests/test_random_paths_and_options.py"

# group -> (modules to mutate, relative to the repository; the test files that own them)
GROUPS: dict[str, tuple[list[str], list[str]]] = {
    "backbone": (
        [
            "modeling/modeling_flexformer.py",
            "modeling/backbone_blocks.py",
            "modeling/backbone_sublayers.py",
            "modeling/positional_embeddings.py",
            "modeling/kv_caches.py",
            "modeling/cpu_kernels.py",
            "modeling/transformers_compat.py",
            "modeling/generation_hooks.py",
            "modeling/output_recording.py",
        ],
        ["tests/test_backbone.py", "tests/test_backbone_seams.py", "tests/test_backbone_generation.py",
         "tests/test_conformance.py", "tests/test_generate_options.py",
         "tests/test_output_capture.py", REFERENCES],
    ),
    # The metric modules under metrics/ are not here: `evaluate.load` runs a copy of each script from its own module
    # cache, which mutmut's switch never reaches (every mutant reads "no tests"). tests/test_metric_values.py was
    # checked against 50 hand-made breakages of them instead (docs/MUTATION.md).
    "losses": (["modeling/losses.py"], ["tests/test_backbone.py", REFERENCES]),
    "iot": (
        ["modeling/modeling_iot.py", "modeling/iot_all_paths.py", "modeling/iot_generation.py",
         "modeling/iot_equations.py", "modeling/sublayer_order.py", "modeling/iot_order_statistics.py"],
        ["tests/test_iot.py", "tests/test_iot_edge_cases.py", REFERENCES, RANDOM_PATHS],
    ),
    "mat": (
        ["modeling/modeling_mat.py", "modeling/branch_merge.py"],
        ["tests/test_mat.py", "tests/test_mat_edge_cases.py", REFERENCES, RANDOM_PATHS],
    ),
    "indigo": (
        ["modeling/modeling_indigo.py", "modeling/indigo_order_search.py", "modeling/indigo_decoding.py",
         "modeling/indigo_insertion.py", "modeling/indigo_search_state.py"],
        ["tests/test_indigo.py", "tests/test_indigo_decoding.py", REFERENCES, RANDOM_PATHS],
    ),
    "depth_adaptive": (
        ["modeling/modeling_depth_adaptive.py", "modeling/depth_adaptive_training.py",
         "modeling/depth_adaptive_generation.py", "modeling/depth_adaptive_halting.py",
         "modeling/depth_adaptive_outputs.py", "modeling/depth_adaptive_cache.py",
         "modeling/depth_adaptive_decoder.py", "modeling/depth_adaptive_equations.py",
         "modeling/depth_adaptive_flops.py"],
        ["tests/test_depth_adaptive.py", "tests/test_depth_adaptive_equations.py", REFERENCES, RANDOM_PATHS],
    ),
    "decode": (["training_scripts/decode.py"], ["tests/test_decode_safety.py", "tests/test_conformance.py",
                                             "tests/test_metric_values.py"]),
    "checkpoints": (["training_scripts/checkpoints.py"], ["tests/test_run_folders.py", "tests/test_training.py"]),
    "data": (["training_scripts/data.py"], ["tests/test_data.py"]),
}

# What the tests read besides the package and themselves (setup.cfg is written with the run's settings appended).
STAGED_EXTRAS = ("README.md", "pyproject.toml", "docs", "benchmarks")

# Lines that only word a message (see the module docstring).
MESSAGE_ONLY_LINES = [r"^\s*raise\s", r"^\s*warnings\.warn\(", r"^\s*logger\.(debug|info|warning|error)\("]

# torch.compile / torch.export trace through mutmut's trampolines (a ContextVar.set dynamo cannot trace), so the
# tests that compile or export are left out of the runs; they still run in the suite.
UNTRACEABLE_TESTS = "not compile and not export"

# Functions that run only while the package is imported (decorator factories, applied when the classes are defined).
# mutmut switches a mutant on after the fork server has imported the package, so their mutants can never act: they
# are counted apart ("import time"), not as survivors. What their wrappers do at call time lives in module-level
# functions that are measured.
IMPORT_TIME_FUNCTIONS = ("x_accepts_cache_argument__mutmut_", "x_records_block_outputs__mutmut_")

# mutmut's exit-code classes (mutmut.stats.status_by_exit_code)
KILLED = {1, 3}
SURVIVED = {0}
NO_TESTS = {5, 33}
TIMEOUT = {36, 24, -24, 152, 255}


def installed_path(repo_path: str) -> str:
    top, _, rest = repo_path.partition("/")
    return f"{PACKAGE_LAYOUT[top]}/{rest}"


def source_tree(workdir: Path, revision: str | None) -> Path:
    """The working tree, or ``revision``'s files (``git archive``) to score an earlier commit's tests."""
    if revision is None:
        return REPO
    tree = workdir / f"source-{revision}"
    if not tree.exists():
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", revision], cwd=REPO, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def stage_group(group: str, workdir: Path, source: Path, timeout_multiplier: float = 3) -> Path:
    """A copy of ``source`` laid out as the installed package, with a [mutmut] section for ``group``."""
    modules, test_files = GROUPS[group]
    stage = workdir / group
    marker = stage / ".mutation-stage"
    if stage.exists():
        if not marker.exists():
            raise SystemExit(f"{stage} exists and is not a stage this script made; choose another --workdir")
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    marker.touch()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for top, target in PACKAGE_LAYOUT.items():
        if top == "flexformers":
            (stage / target).mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / "flexformers" / "__init__.py", stage / target / "__init__.py")
        else:
            shutil.copytree(source / top, stage / target, ignore=ignore)
    shutil.copytree(source / "tests", stage / "tests", ignore=ignore)
    for name in STAGED_EXTRAS:  # some tests read the project's files, documentation and benchmark scripts
        if (source / name).is_dir():
            shutil.copytree(source / name, stage / name, ignore=ignore)
        else:
            shutil.copy2(source / name, stage / name)
    only_mutate = "\n    ".join(installed_path(m) for m in modules)
    # An earlier revision (--revision) may predate some of the test files: it is scored with those it has.
    selection = "\n    ".join(name for name in test_files if (source / name).exists())
    patterns = "\n    ".join(MESSAGE_ONLY_LINES)
    also_copy = "\n    ".join(STAGED_EXTRAS)
    # The project's own setup.cfg (the tests read it), with the run's settings appended.
    (stage / "setup.cfg").write_text(
        (source / "setup.cfg").read_text() + "\n"
        "[mutmut]\n"
        "source_paths = flexformers\n"
        f"only_mutate =\n    {only_mutate}\n"
        f"also_copy =\n    {also_copy}\n"
        f"pytest_add_cli_args_test_selection =\n    {selection}\n"
        f"pytest_add_cli_args =\n    -p\n    no:cacheprovider\n    -m\n    not slow\n    -k\n    {UNTRACEABLE_TESTS}\n"
        f"do_not_mutate_patterns =\n    {patterns}\n"
        "process_isolation = forkserver\n"
        # A mutant that makes the tests hang is stopped at 3x the covering tests' clean time by default (mutmut's
        # default 15x spends minutes on each such mutant here; a survivor's full run stays well under 3x on an idle
        # machine). A working run on a shared machine raises it, or load reads as hangs.
        f"timeout_multiplier = {timeout_multiplier}\n"
        "use_git_change_detection = false\n"
    )
    return stage


def mutant_results(stage: Path, group: str) -> dict[str, dict[str, int | None]]:
    """{repo module path: {mutant name: exit code}} from mutmut's .meta files."""
    results = {}
    for module in GROUPS[group][0]:
        meta = stage / "mutants" / (installed_path(module) + ".meta")
        results[module] = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
    return results


def classify(exit_code: int | None, name: str = "") -> str:
    if any(marker in name for marker in IMPORT_TIME_FUNCTIONS):
        return "import time"
    if exit_code is None:
        return "not run"
    if exit_code in KILLED:
        return "killed"
    if exit_code in SURVIVED:
        return "survived"
    if exit_code in NO_TESTS:
        return "no tests"
    if exit_code in TIMEOUT:
        return "timeout"  # a mutant that makes the tests hang is caught too
    if exit_code in (-11, -9):
        return "killed"  # the mutant crashed the test process: a failure the suite reports
    return f"exit {exit_code}"  # interrupted or suspicious: neither caught nor survived


def score_module(codes: dict[str, int | None], equivalent: dict[str, str]) -> dict:
    status = {name: classify(code, name) for name, code in codes.items()}
    counts = Counter(status.values())
    equivalent_here = sorted(name for name in codes if name in equivalent and status[name] in ("survived", "no tests"))
    caught = counts["killed"] + counts["timeout"]
    judged = len(codes) - len(equivalent_here) - counts["import time"] - counts["not run"]
    return {
        "total": len(codes),
        "killed": counts["killed"],
        "timeout": counts["timeout"],
        "survived": counts["survived"],
        "no_tests": counts["no tests"],
        "not_run": counts["not run"],
        "import_time": counts["import time"],
        "equivalent": len(equivalent_here),
        "score": round(caught / judged, 4) if judged else None,
        "survivors": sorted(n for n in codes if status[n] in ("survived", "no tests") and n not in equivalent),
    }


def sample_mutants(stage: Path, group: str, per_module: int, seed: int) -> list[str]:
    """A seeded random sample of ``per_module`` mutant names from each module (all of a smaller module's)."""
    rng = random.Random(seed)
    chosen = []
    for codes in mutant_results(stage, group).values():
        names = sorted(codes)
        chosen += names if len(names) <= per_module else sorted(rng.sample(names, per_module))
    return chosen


def run_group(group: str, workdir: Path, source: Path, max_children: int, count_only: bool, sample: int | None,
              seed: int, timeout_multiplier: float = 3) -> tuple[Path, list[str] | None]:
    stage = stage_group(group, workdir, source, timeout_multiplier)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    if count_only or sample:
        code = ("import mutmut.__main__ as m; m.copy_src_dir(); m.copy_also_copy_files(); "
                "m.setup_source_paths(); m.store_lines_covered_by_tests(); m.create_mutants(2)")
        subprocess.run([sys.executable, "-c", code], cwd=stage, env=env, check=True,
                       stdout=subprocess.DEVNULL)
    if count_only:
        return stage, None
    names = sample_mutants(stage, group, sample, seed) if sample else None
    log = workdir / f"{group}.log"
    with log.open("w") as out:
        completed = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children),
                                    *(names or [])],
                                   cwd=stage, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    if completed.returncode != 0:
        tail = re.sub(r"\x1b\[[0-9;]*[A-Za-z]|[^\n]*\r", "", log.read_text())[-1500:]
        print(f"mutmut failed for group {group!r} (log {log}):\n{tail}", file=sys.stderr, flush=True)
    return stage, names


def show_survivors(stage: Path, names: list[str]) -> None:
    for name in names:
        shown = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=stage,
                               capture_output=True, text=True, check=False)
        print(shown.stdout)


def markdown_table(scores: dict[str, dict]) -> str:
    header = "| module | mutants in module | sampled | checked | killed (timeout) | survived | no tests | equivalent | score |"
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for module, s in scores.items():
        score = "—" if s["score"] is None else f"{100 * s['score']:.1f}%"
        checked = s["total"] - s["not_run"] - s["import_time"]
        lines.append(f"| `{module}` | {s.get('mutants_in_module', s['total'])} | {s['total']} | {checked} | "
                     f"{s['killed'] + s['timeout']} ({s['timeout']}) | {s['survived']} | {s['no_tests']} | "
                     f"{s['equivalent']} | {score} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", action="append", choices=sorted(GROUPS),
                        help="only these groups (repeatable; default: all)")
    parser.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "flexformers-mutation")
    parser.add_argument("--max_children", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--timeout_multiplier", type=float, default=3,
                        help="stop a mutant's tests at this many times their clean time (3 on an idle machine, as "
                             "the recorded runs; raise it for a working run beside other work)")
    parser.add_argument("--count_only", action="store_true", help="generate the mutants and count them; run nothing")
    parser.add_argument("--sample", type=int, default=None,
                        help="run a seeded random sample of this many mutants per module instead of all")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed")
    parser.add_argument("--revision", default=None,
                        help="score this commit's code and tests (git archive) instead of the working tree")
    parser.add_argument("--rescore", action="store_true",
                        help="score the stages an earlier run left in --workdir (same --sample/--seed) without running")
    parser.add_argument("--survivors", action="store_true", help="print each surviving mutant's diff")
    parser.add_argument("--label", default="after", help="key under which the scores are stored in the JSON")
    args = parser.parse_args(argv)
    try:
        import mutmut  # noqa: F401
    except ImportError:
        raise SystemExit('mutation_score.py needs mutmut: pip install "mutmut>=3.8,<4"') from None

    equivalent = json.loads(EQUIVALENT_FILE.read_text()) if EQUIVALENT_FILE.exists() else {}
    groups = args.group or list(GROUPS)
    args.workdir.mkdir(parents=True, exist_ok=True)
    source = None if args.rescore else source_tree(args.workdir, args.revision)
    scores: dict[str, dict] = {}
    for group in groups:
        started = time.time()
        if args.rescore:  # score the stage an earlier run left, without running anything
            stage = args.workdir / group
            sampled = sample_mutants(stage, group, args.sample, args.seed) if args.sample else None
        else:
            stage, sampled = run_group(group, args.workdir, source, args.max_children, args.count_only, args.sample,
                                       args.seed, args.timeout_multiplier)
        for module, codes in mutant_results(stage, group).items():
            in_run = codes if sampled is None else {name: codes[name] for name in sampled if name in codes}
            scores[module] = score_module(in_run, equivalent)
            scores[module].update(group=group, mutants_in_module=len(codes), sample_seed=args.seed if sampled else None,
                                  timeout_multiplier=None if args.rescore else args.timeout_multiplier)
        print(f"[{group}] {time.time() - started:.0f} s", file=sys.stderr, flush=True)
        if args.survivors:
            show_survivors(stage, [n for m in GROUPS[group][0] for n in scores[m]["survivors"]])
    print(markdown_table(scores))
    if args.count_only:
        return
    stored = json.loads(RESULTS_FILE.read_text()) if RESULTS_FILE.exists() else {}
    stored.setdefault(args.label, {}).update(scores)
    RESULTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_FILE.write_text(json.dumps(stored, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
