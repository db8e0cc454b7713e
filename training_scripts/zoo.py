"""The zoo (``flexformers-zoo``): the recipes of ``zoo_recipes.yaml`` in, trained models and ``docs/ZOO.md`` out.

    flexformers-zoo list                       # every recipe and how far it got
    flexformers-zoo run --all                  # train what is not finished (resuming), evaluate, export
    flexformers-zoo run --all --max_minutes 150  # ... stopping cleanly before a session's end; the next run goes on
    flexformers-zoo run baseline-translation-s1 iot-translation-s1
    flexformers-zoo reevaluate depth-adaptive-translation-s1  # a finished recipe's evaluation again, no training
    flexformers-zoo render                     # docs/ZOO.md: the table and the plots, from the finished runs
    flexformers-zoo run --all --smoke          # every recipe for a few updates (CI)
    flexformers-zoo ship baseline-word-order-s1  # a finished recipe's model into zoo_models/, proving its card
    flexformers-zoo verify                     # each shipped model decodes its card's slice to the card's score
    flexformers-zoo publish --namespace me --dry_run  # what uploading the shipped models to the Hub would send

A recipe is trained by ``flexformers-train`` for its budget in updates, saving a checkpoint at every curve point so
that a run cut off (a session ends, the machine restarts) goes on from there: ``run --all`` skips finished recipes
and resumes the others. Each session's wall time and updates are written to the run's ``zoo_progress.json`` at every
checkpoint, so a run cut off still counts the time its checkpoints hold. A finished recipe is decoded on the whole
test split (BLEU / chrF / TER with the sacrebleu signature, beside copying the input), analysed by its method (IOT
order usage, Depth-Adaptive exits and a threshold sweep, InDIGO's insertion order) and exported as a Hub folder whose
card carries the same numbers; its ``zoo_result.json`` is what ``render`` reads.

A session's machine keeps only what is committed, so a finished recipe's result is also written to the records
folder (``docs/zoo/results/<recipe>.json``, committed with ``docs/ZOO.md``): ``run`` counts a recorded recipe as
finished and ``render`` reads the records of runs that are no longer on this machine. The weights are not in the
record (``*.safetensors`` is not committed): a recipe that initialises another (MAT's proximal initialisation,
InDIGO's SAO) needs its run folder on the machine.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from flexformers.training_scripts.zoo_comparisons import load_comparisons
from flexformers.training_scripts.zoo_recipes import DEFAULT_RECIPES, SMOKE_UPDATES, budget, load_recipes
from flexformers.training_scripts.zoo_report import render
from flexformers.training_scripts.zoo_runner import (
    DEFAULT_RECORDS_DIR,
    cuda_available,
    recipe_status,
    reevaluate,
    run_recipe,
    trained_updates,
)
from flexformers.training_scripts.zoo_shipping import (
    DEFAULT_SHIPPED_DIR,
    publish,
    read_ship_record,
    ship_recipe,
    shipped_folders,
    verify_shipped,
)

logger = logging.getLogger("flexformers.zoo")


def verify_command(shipped_dir: Path, python: str | None) -> int:
    folders = shipped_folders(shipped_dir)
    if not folders:
        raise ValueError(f"{shipped_dir} holds no shipped models (`flexformers-zoo ship RECIPE` ships one)")
    failed = 0
    for folder in folders:
        problems = verify_shipped(folder, python)
        bleu = read_ship_record(folder)["slice"]["metrics"]["bleu"]
        print(f"{folder}: " + ("; ".join(problems) if problems else f"slice BLEU {bleu:.2f}, as its card says"),
              flush=True)
        failed += bool(problems)
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexformers-zoo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default=str(DEFAULT_RECIPES), help="recipe file (default: the package's)")
    parser.add_argument("--runs_dir", default="runs/zoo", help="where runs go (default: %(default)s)")
    parser.add_argument("--records_dir", default=DEFAULT_RECORDS_DIR,
                        help="committed results of finished recipes, read by `run`, `list` and `render` "
                             "(default: %(default)s)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="every recipe and how far it got")
    run = commands.add_parser("run", help="train (resuming), evaluate and export recipes")
    run.add_argument("names", nargs="*", help="recipes to run (see `list`)")
    run.add_argument("--all", action="store_true", help="every recipe not finished, in file order")
    run.add_argument("--smoke", action="store_true", help=f"{SMOKE_UPDATES} updates per recipe on a tiny subset (CI)")
    run.add_argument("--no_export", action="store_true", help="skip the Hub folders")
    run.add_argument("--max_minutes", type=float, default=None,
                     help="stop training cleanly after this many minutes (a checkpoint is saved; the next `run` "
                          "resumes it); a recipe whose test evaluation has started still finishes it (a few minutes)")
    again = commands.add_parser("reevaluate", help="evaluate finished recipes again from their trained models "
                                                   "(after the evaluation or a method's analysis changed)")
    again.add_argument("names", nargs="+", help="finished recipes whose run folders are here (see `list`)")
    again.add_argument("--no_export", action="store_true", help="skip the Hub folders")
    ship = commands.add_parser("ship", help="copy finished recipes' exported models into the repository's shipped "
                                            "models, half-precision storage measured and the card slice scored")
    ship.add_argument("names", nargs="+", help="finished recipes whose run and export folders are here")
    ship.add_argument("--shipped_dir", default=DEFAULT_SHIPPED_DIR, help="(default: %(default)s)")
    ship.add_argument("--replace", action="store_true",
                      help="replace a shipped model whose recipe has changed since (never one of the same recipe)")
    verify = commands.add_parser("verify", help="decode every shipped model's card slice again and compare")
    verify.add_argument("--shipped_dir", default=DEFAULT_SHIPPED_DIR, help="(default: %(default)s)")
    verify.add_argument("--python", default=None,
                        help="decode in this interpreter through the folders' remote code (e.g. a clean venv's "
                             "python holding only torch, transformers, tokenizers and safetensors)")
    publish_parser = commands.add_parser("publish", help="upload every shipped model to a Hub namespace")
    publish_parser.add_argument("--namespace", required=True, help="Hub user or organisation: <namespace>/<recipe>")
    publish_parser.add_argument("--shipped_dir", default=DEFAULT_SHIPPED_DIR, help="(default: %(default)s)")
    publish_parser.add_argument("--dry_run", action="store_true", help="list what would be uploaded; upload nothing")
    publish_parser.add_argument("--private", action="store_true", help="create the repositories as private")
    render_parser = commands.add_parser("render", help="write docs/ZOO.md and its plots from the finished runs")
    render_parser.add_argument("--docs", default="docs/ZOO.md", help="(default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "publish":  # nothing else reaches the network; publishing is what the network is for
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    try:
        recipes = load_recipes(args.recipes)
        runs_dir, records_dir = Path(args.runs_dir), Path(args.records_dir)
        if args.command == "list":
            for recipe in recipes:
                print(f"{recipe.name:36} {recipe.model_type:15} {recipe.task:12} "
                      f"{recipe_status(recipe, runs_dir, records_dir)}")
            return 0
        if args.command == "render":
            path = render(recipes, runs_dir, Path(args.docs), records_dir, load_comparisons(recipes, args.recipes))
            print(f"wrote {path}")
            return 0
        if args.command == "verify":
            return verify_command(Path(args.shipped_dir), args.python)
        if args.command == "publish":
            for line in publish(Path(args.shipped_dir), args.namespace, dry_run=args.dry_run, private=args.private):
                print(line, flush=True)
            return 0
        known = {recipe.name: recipe for recipe in recipes}
        unknown = [name for name in args.names if name not in known]
        if unknown:
            raise ValueError(f"no recipe named {', '.join(unknown)} (see `flexformers-zoo list`)")
        if args.command == "ship":
            for name in args.names:
                record = ship_recipe(known[name], runs_dir, Path(args.shipped_dir), replace=args.replace)
                storage = record["storage"]
                print(f"{name}: shipped to {Path(args.shipped_dir) / name} ({storage['dtype']} weights: whole-test BLEU "
                      f"{storage['float32_bleu']:.2f} in float32, {storage['float16_bleu']} from float16); card slice "
                      f"BLEU {record['slice']['metrics']['bleu']:.2f} on {record['slice']['examples']} examples "
                      f"(copying {record['slice']['copy_baseline']['bleu']:.2f})", flush=True)
            return 0
        if args.command == "reevaluate":
            for name in args.names:
                result = reevaluate(known[name], runs_dir, records_dir, export=not args.no_export)
                print(f"{name}: test BLEU {result['test']['metrics']['bleu']:.2f} (copying "
                      f"{result['test']['copy_baseline']['bleu']:.2f}), evaluated again", flush=True)
            return 0
        if bool(args.names) == args.all:
            raise ValueError("name the recipes to run, or pass --all (not both)")
        chosen = recipes if args.all else [known[name] for name in args.names]
        if args.all and not args.smoke:
            gpu_only = [recipe.name for recipe in chosen if recipe.trains_on_gpu]
            if gpu_only and not cuda_available():
                print(f"skipping the recipes trained on a CUDA GPU (this machine has none): {', '.join(gpu_only)}",
                      flush=True)
                chosen = [recipe for recipe in chosen if recipe.name not in gpu_only]
        if args.all:
            # a recipe whose method needs an optional dependency this machine lacks (spaCy for InDIGO's SYN order,
            # the `.[syn]` extra) is left for a machine that has it
            records = None if args.smoke else records_dir
            cannot_train: dict[str, list[str]] = {}
            for recipe in chosen:
                if not recipe_status(recipe, runs_dir, records).startswith("finished"):
                    if (missing := recipe.missing_requirement()) is not None:
                        cannot_train.setdefault(missing, []).append(recipe.name)
            for missing, skipped in cannot_train.items():
                print(f"skipping the recipes that cannot train on this machine ({', '.join(skipped)}): {missing}",
                      flush=True)
                chosen = [recipe for recipe in chosen if recipe.name not in skipped]
        if args.max_minutes is not None and args.max_minutes <= 0:
            raise ValueError(f"--max_minutes must be positive, got {args.max_minutes:g}")
        deadline = None if args.max_minutes is None else time.monotonic() + 60 * args.max_minutes
        from tqdm.auto import tqdm

        for recipe in tqdm(chosen, desc="zoo recipes", unit="recipe"):
            result = run_recipe(recipe, runs_dir, smoke=args.smoke, export=not args.no_export, deadline=deadline,
                                records_dir=None if args.smoke else records_dir)
            if result is None:
                print(f"--max_minutes reached: {recipe.name} is at {trained_updates(runs_dir / recipe.name)} of "
                      f"{budget(recipe, args.smoke)} updates; `flexformers-zoo run` again "
                      f"resumes it", flush=True)
                break
            test = result["test"]
            print(f"{recipe.name}: test BLEU {test['metrics']['bleu']:.2f} "
                  f"(copying {test['copy_baseline']['bleu']:.2f}) after {result['updates']} updates", flush=True)
    except ValueError as error:
        print(f"flexformers-zoo: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
