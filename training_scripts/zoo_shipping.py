"""Shipped zoo models: finished recipes' Hub folders kept in the repository (``zoo_models/``), each proving its card.

    flexformers-zoo ship baseline-word-order-s1        # runs/zoo/hub/<recipe> -> zoo_models/<recipe>
    flexformers-zoo verify                             # decode each shipped folder's card slice again, compare
    flexformers-zoo publish --namespace me --dry_run   # what an upload would send
    flexformers-zoo publish --namespace me             # upload every shipped folder (a network and a token)

Shipping a recipe's exported folder measures what half-precision storage does to its test score: the whole test
split is decoded with the float32 weights and with the weights rounded to float16 and loaded back as float32; the
smaller form is shipped when BLEU moves by less than :data:`HALF_PRECISION_TOLERANCE`. The first
:data:`SLICE_EXAMPLES` test examples are then decoded with the stored weights and the folder's own generation config
(:mod:`~flexformers.training_scripts.slice_decoding`, what ``model.generate`` does for a user) and scored with
sacrebleu; the sources, references, hypotheses and score go into the folder's :data:`SHIP_RECORD` and its card, so
``verify`` (and the test suite, in a clean environment too) can check that the folder still decodes to its card.

A shipped folder is replaced only when its recipe changes (``--replace``), never by another run of the same recipe,
so the repository's history does not fill with weights; all shipped weights together stay within
:data:`SHIPPED_SIZE_LIMIT`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from flexformers.training_scripts.zoo_recipes import ZooRecipe, recipe_changes
from flexformers.training_scripts.zoo_runner import RESULT_FILE, is_finished

DEFAULT_SHIPPED_DIR = "zoo_models"
#: The record a shipped folder carries (recipe, storage measurement, card slice); its presence marks the folder as
#: one ``ship`` made, the only kind ``ship --replace`` may replace.
SHIP_RECORD = "zoo_shipped.json"
#: The card's slice: the first this many test examples.
SLICE_EXAMPLES = 200
#: BLEU points half-precision storage may move the whole test's score by and still be shipped.
HALF_PRECISION_TOLERANCE = 0.1
#: All shipped folders together (weights, tokenizer, code, card).
SHIPPED_SIZE_LIMIT = 64 * 2**20
CARD_SECTION = "## The zoo's shipped model"


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def shipped_folders(shipped_dir: str | os.PathLike) -> list[Path]:
    """The folders ``ship`` made in ``shipped_dir``, by name."""
    shipped_dir = Path(shipped_dir)
    if not shipped_dir.is_dir():
        return []
    return sorted(folder for folder in shipped_dir.iterdir() if (folder / SHIP_RECORD).is_file())


def read_ship_record(folder: Path) -> dict[str, Any]:
    path = folder / SHIP_RECORD
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} cannot be read as a shipped model's record ({error})") from error


def _test_split(output_dir: Path) -> tuple[list[str], list[str], bool]:
    """The test sources and references of the data a run was trained on (its ``data_args.json``)."""
    from flexformers.training_scripts.arguments import DataArguments
    from flexformers.training_scripts.data import load_corpus

    data_args = DataArguments.load(output_dir)
    if data_args is None:
        raise ValueError(f"{output_dir} records no training data (data_args.json): not a flexformers run")
    test = load_corpus(data_args)["test"]
    return list(test["source"]), list(test["target"]), data_args.is_code


def _decode_folder(folder: Path, sources: list[str]) -> list[str]:
    import flexformers.modeling  # noqa: F401  (registers the Auto classes: the folder loads without remote code)
    from flexformers.training_scripts.slice_decoding import decode_sources, load_folder

    tokenizer, model = load_folder(str(folder))
    return decode_sources(tokenizer, model, sources)


def write_half_precision_weights(folder: Path) -> bool:
    """Round ``folder``'s floating-point weights to float16 in place, keeping the safetensors metadata, and record
    float32 as the config's dtype so that ``from_pretrained`` computes in float32 as before. False (nothing changed)
    when a weight does not fit in float16."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    weight_files = sorted(folder.glob("*.safetensors"))
    converted = {}
    for path in weight_files:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata()
            tensors = {name: file.get_tensor(name) for name in file.keys()}
        for name, tensor in tensors.items():
            if tensor.is_floating_point():
                half = tensor.to(torch.float16)
                if not torch.isfinite(half).all() and torch.isfinite(tensor).all():
                    return False
                tensors[name] = half
        converted[path] = (tensors, metadata)
    for path, (tensors, metadata) in converted.items():
        save_file(tensors, str(path), metadata=metadata)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["dtype"] = "float32"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return True


def _card_section(record: dict[str, Any]) -> str:
    row, storage, slice_ = record["zoo_row"], record["storage"], record["slice"]
    recipe = record["recipe"]
    flags = " ".join(recipe.get("flags") or []) or "none"
    constraint = (f", outputs kept to a {row['output_constraint']} as the zoo decodes this task"
                  if row.get("output_constraint") else "")
    smoke = ("\n**A smoke run** (a few updates on a tiny subset, for tests): its scores show nothing learned.\n"
             if record.get("smoke") else "")
    if storage["dtype"] == "float16":
        stored = (f"float16 (loaded as float32): on the whole test split ({storage['examples']} examples) BLEU "
                  f"{storage['float16_bleu']:.2f} against {storage['float32_bleu']:.2f} with the float32 weights "
                  f"(a change of {storage['difference']:+.2f}, under the {HALF_PRECISION_TOLERANCE} allowed)")
    else:
        stored = (f"float32: float16 storage moved the whole test split's BLEU from {storage['float32_bleu']:.2f} to "
                  f"{storage['float16_bleu']} ({storage['examples']} examples), not under the "
                  f"{HALF_PRECISION_TOLERANCE} allowed")
    return f"""
{CARD_SECTION}
{smoke}
This folder ships with flexformers (`zoo_models/{record['name']}`): the model of the zoo recipe `{record['name']}`
(`docs/ZOO.md`), seed {recipe.get('seed')}, trained for {row['updates']:,} updates.

| | value |
|---|---|
| recipe | `{record['name']}`: {recipe.get('model_type')} on {recipe.get('task')}, flags `{flags}` |
| seed | {recipe.get('seed')} |
| parameters | {record['parameters']:,} |
| test BLEU (whole split, {row['num_examples']} examples, beam {row['num_beams']}{constraint}) | {row['bleu']:.2f} |
| copying the input, same examples | {row['copy_bleu']:.2f} |
| sacrebleu signature | `{row['sacrebleu_signature']}` |
| BLEU on the first {slice_['examples']} test examples with this card's decoding settings | {slice_['metrics']['bleu']:.2f} |
| copying the input, same {slice_['examples']} examples | {slice_['copy_baseline']['bleu']:.2f} |
| weights stored as | {stored} |

The slice score is what `model.generate(**inputs)` gives with `generation_config.json` as it is, {slice_['batch_size']}
sentences a batch in order (`zoo_shipped.json` holds the sources, references and hypotheses); the whole-split score is
the zoo's evaluation (`flexformers-decode`: sentences batched by length{"; plain `generate()` has no output constraint" if constraint else ""}).
`flexformers-zoo verify` decodes the slice again and compares.
"""


def _check_destination(target: Path, recipe: ZooRecipe, replace: bool) -> None:
    if not target.exists():
        return
    if not (target / SHIP_RECORD).is_file():
        raise ValueError(f"{target} exists and is not a folder `ship` made (no {SHIP_RECORD}); move it away first")
    shipped = read_ship_record(target)
    changed = recipe_changes(shipped["recipe"], recipe)
    if not changed:
        raise ValueError(f"{target} already ships recipe {recipe.name!r} as it is: a shipped model is replaced only "
                         f"when its recipe changes")
    if not replace:
        raise ValueError(f"recipe {recipe.name!r} changed since {target} was shipped ({', '.join(changed)} differ): "
                         f"pass --replace to ship the new model in its place")
    added = sorted(set(_relative_files(target)) - set(shipped.get("files") or ()) - {SHIP_RECORD})
    if added:
        raise ValueError(f"{target} holds files `ship` did not write ({', '.join(added[:5])}): move them away before "
                         f"replacing it")


def _relative_files(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file())


def ship_recipe(recipe: ZooRecipe, runs_dir: Path, shipped_dir: Path, replace: bool = False,
                allow_smoke: bool = False, measure_examples: int | None = None) -> dict[str, Any]:
    """Copy a finished recipe's exported Hub folder into ``shipped_dir`` with its storage measured, its card slice
    decoded and scored and its card extended (see the module docstring); returns the record written.

    ``measure_examples`` limits the half-precision measurement to the first test examples (default: all);
    ``allow_smoke`` ships a smoke run (tests only: its card says so)."""
    from flexformers.training_scripts.arguments import DATA_ARGS_FILE
    from flexformers.training_scripts.decode import score_hypotheses
    from flexformers.training_scripts.export_to_hub import EXPORT_MARKER
    from flexformers.training_scripts.slice_decoding import SLICE_BATCH_SIZE

    output_dir, hub_dir = runs_dir / recipe.name, runs_dir / "hub" / recipe.name
    result_path = output_dir / RESULT_FILE
    if not result_path.is_file():
        raise ValueError(f"recipe {recipe.name!r} has no finished run in {output_dir} "
                         f"(`flexformers-zoo run {recipe.name}` trains, evaluates and exports it)")
    result = json.loads(result_path.read_text(encoding="utf-8"))
    if not is_finished(result, recipe):
        raise ValueError(f"recipe {recipe.name!r}'s run in {output_dir} is not finished as the recipe is today")
    if result["smoke"] and not allow_smoke:
        raise ValueError(f"{output_dir} is a smoke run: only a full run of {recipe.name!r} is shipped")
    if not (hub_dir / "config.json").is_file():
        raise ValueError(f"recipe {recipe.name!r} has no exported folder {hub_dir} (`flexformers-zoo reevaluate "
                         f"{recipe.name}` exports it)")
    target = shipped_dir / recipe.name
    _check_destination(target, recipe, replace)

    sources, references, is_code = _test_split(output_dir)
    measured = len(sources) if measure_examples is None else min(measure_examples, len(sources))
    shipped_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{recipe.name}-", dir=shipped_dir))
    try:
        folder = staging / recipe.name
        shutil.copytree(hub_dir, folder)
        # the export's marker names the run folder on this machine; the ship record marks a shipped folder instead
        (folder / EXPORT_MARKER).unlink(missing_ok=True)
        # the corpus options it was trained with (the zoo's corpora are built from what a machine has, no paths of
        # this one): `flexformers-decode` on the shipped folder then decodes as the zoo did — its task, lengths and
        # word order's permutation constraint — without the user naming them
        shutil.copy2(output_dir / DATA_ARGS_FILE, folder / DATA_ARGS_FILE)
        float32_bleu = score_hypotheses(sources[:measured], references[:measured],
                                        _decode_folder(folder, sources[:measured]), is_code)["metrics"]["bleu"]
        half = staging / "float16"
        shutil.copytree(folder, half)
        fits = write_half_precision_weights(half)
        float16_bleu = (score_hypotheses(sources[:measured], references[:measured],
                                         _decode_folder(half, sources[:measured]), is_code)["metrics"]["bleu"]
                        if fits else None)
        difference = None if float16_bleu is None else round(float16_bleu - float32_bleu, 2)
        if difference is not None and abs(difference) < HALF_PRECISION_TOLERANCE:
            shutil.rmtree(folder)
            half.rename(folder)
        else:
            shutil.rmtree(half)
        count = min(SLICE_EXAMPLES, len(sources))
        hypotheses = _decode_folder(folder, sources[:count])
        slice_score = score_hypotheses(sources[:count], references[:count], hypotheses, is_code)
        test = result["test"]
        record = {
            "name": recipe.name,
            "recipe": result["recipe"],
            "smoke": result["smoke"],
            "parameters": result["parameters"],
            "zoo_row": {"updates": result["updates"], "num_examples": test["num_examples"],
                        "num_beams": test["num_beams"], "bleu": test["metrics"]["bleu"],
                        "copy_bleu": test["copy_baseline"]["bleu"],
                        "sacrebleu_signature": test["sacrebleu_signature"],
                        "output_constraint": test.get("output_constraint")},
            "storage": {"dtype": "float16" if difference is not None and abs(difference) < HALF_PRECISION_TOLERANCE
                        else "float32", "examples": measured, "float32_bleu": float32_bleu,
                        "float16_bleu": float16_bleu, "difference": difference},
            "slice": {"examples": count, "batch_size": SLICE_BATCH_SIZE, "metrics": slice_score["metrics"],
                      "copy_baseline": slice_score["copy_baseline"],
                      "sacrebleu_signature": slice_score["sacrebleu_signature"], "is_code": is_code,
                      "sources": sources[:count], "references": references[:count], "hypotheses": hypotheses},
        }
        card = folder / "README.md"
        card.write_text(card.read_text(encoding="utf-8").rstrip("\n") + "\n" + _card_section(record),
                        encoding="utf-8")
        # what `ship` wrote: a later --replace removes a folder holding nothing else
        record["files"] = sorted({*_relative_files(folder), SHIP_RECORD})
        (folder / SHIP_RECORD).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        others = sum(folder_bytes(other) for other in shipped_folders(shipped_dir) if other.name != recipe.name)
        if others + folder_bytes(folder) > SHIPPED_SIZE_LIMIT:
            raise ValueError(f"shipping {recipe.name!r} ({folder_bytes(folder) / 2**20:.1f} MiB) would bring the "
                             f"shipped models to {(others + folder_bytes(folder)) / 2**20:.1f} MiB, over the "
                             f"{SHIPPED_SIZE_LIMIT / 2**20:.0f} MiB allowed")
        if target.exists():  # checked above: a folder `ship` made, of an earlier version of the recipe, unchanged
            # moved into the staging folder (removed with it) only once the new folder is in its place
            replaced = staging / "replaced"
            target.rename(replaced)
            try:
                folder.rename(target)
            except OSError:
                replaced.rename(target)
                raise
        else:
            folder.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return record


def verify_shipped(folder: Path, python: str | None = None, timeout: float = 900) -> list[str]:
    """Decode ``folder``'s card slice again and compare with its record: the problems found (none: it proves its
    card). With ``python``, in that interpreter through the folder's remote code (``trust_remote_code=True``) and
    :mod:`slice_decoding` run by its path, so flexformers need not be importable there."""
    import subprocess
    import sys

    from flexformers.training_scripts import slice_decoding
    from flexformers.training_scripts.decode import score_hypotheses

    record = read_ship_record(folder)
    slice_ = record["slice"]
    if python is None:
        hypotheses = _decode_folder(folder, slice_["sources"])
    else:
        with tempfile.TemporaryDirectory() as scratch:
            sources_file = Path(scratch) / "sources.json"
            sources_file.write_text(json.dumps(slice_["sources"], ensure_ascii=False), encoding="utf-8")
            env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
            env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_MODULES_CACHE=str(Path(scratch) / "modules"))
            # -I: the interpreter's own site-packages only (no PYTHONPATH, no script directory, no user site)
            done = subprocess.run([python, "-I", slice_decoding.__file__, str(folder.resolve()), str(sources_file),
                                   "--trust_remote_code"], capture_output=True, text=True, env=env, cwd=scratch,
                                  timeout=timeout, check=False)
        if done.returncode != 0:
            return [f"decoding in {python} failed: {done.stderr.strip()[-2000:]}"]
        decoded = json.loads(done.stdout.strip().splitlines()[-1])
        if not decoded["model_module"].startswith("transformers_modules."):
            return [f"{python} loaded {decoded['model_module']}, not the folder's remote code"]
        hypotheses = decoded["hypotheses"]
    problems = []
    differing = [index for index, (got, want) in enumerate(zip(hypotheses, slice_["hypotheses"])) if got != want]
    if len(hypotheses) != len(slice_["hypotheses"]):
        problems.append(f"{len(hypotheses)} hypotheses for {len(slice_['hypotheses'])} recorded")
    if differing:
        first = differing[0]
        problems.append(f"{len(differing)} of {len(hypotheses)} hypotheses differ from the record (first, example "
                        f"{first + 1}: {hypotheses[first]!r} for {slice_['hypotheses'][first]!r})")
    score = score_hypotheses(slice_["sources"], slice_["references"], hypotheses, slice_["is_code"])
    if score["metrics"]["bleu"] != slice_["metrics"]["bleu"]:
        problems.append(f"slice BLEU {score['metrics']['bleu']} where the card says {slice_['metrics']['bleu']}")
    card = (folder / "README.md").read_text(encoding="utf-8")
    if f"| {slice_['metrics']['bleu']:.2f} |" not in card.split(CARD_SECTION, 1)[-1]:
        problems.append(f"the card does not state the slice BLEU {slice_['metrics']['bleu']:.2f}")
    return problems


def publish_plan(shipped_dir: Path, namespace: str) -> list[tuple[Path, str, int]]:
    """(folder, Hub repository id, bytes) of every shipped folder."""
    if not namespace or "/" in namespace:
        raise ValueError(f"--namespace must be a Hub user or organisation name (no '/'), got {namespace!r}")
    folders = shipped_folders(shipped_dir)
    if not folders:
        raise ValueError(f"{shipped_dir} holds no shipped models (`flexformers-zoo ship RECIPE` ships one)")
    return [(folder, f"{namespace}/{folder.name}", folder_bytes(folder)) for folder in folders]


def hub_unavailable_reason(token: str | None) -> str | None:
    """Why an upload cannot happen here (offline, no token, no network), or None."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set: unset it to upload"
    from huggingface_hub import HfApi, get_token

    token = token or get_token()
    if token is None:
        return "no Hub token: log in with `hf auth login` or set HF_TOKEN"
    try:
        HfApi().whoami(token=token)
    except Exception as error:  # noqa: BLE001  (no network, a revoked token: either way nothing can be uploaded)
        return f"the Hub cannot be reached with this token ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
    return None


def publish(shipped_dir: Path, namespace: str, dry_run: bool = False, private: bool = False,
            token: str | None = None) -> list[str]:
    """Upload every shipped folder to ``namespace/<recipe>``; the lines reporting it. A dry run uploads nothing."""
    plan = publish_plan(shipped_dir, namespace)
    lines = [f"{folder} -> https://huggingface.co/{repo_id} ({size / 2**20:.1f} MiB)" for folder, repo_id, size in plan]
    if dry_run:
        return ["would upload:", *lines]
    reason = hub_unavailable_reason(token)
    if reason is not None:
        raise ValueError(f"cannot publish: {reason}")
    from flexformers.training_scripts.export_to_hub import push_folder_to_hub

    return [f"{folder} -> {push_folder_to_hub(folder, repo_id, private=private, token=token)}"
            for folder, repo_id, _ in plan]
