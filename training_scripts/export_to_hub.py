"""``flexformers-export``: turn a trained flexformers checkpoint directory into a Hub-ready folder.

The folder loads where flexformers is *not* installed::

    model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)

It holds ``config.json`` (with ``auto_map`` for ``AutoConfig``, ``AutoModel`` and ``AutoModelForSeq2SeqLM``),
``model.safetensors``, ``generation_config.json`` (the method's decoding settings, overlaid with the beam size
and length penalty the reported evaluation used), the tokenizer files, the model's source code as a *flat* set
of files that import each other relatively, and a ``README.md`` model card rendered from ``hub_cards/`` with a
``model-index`` filled from the checkpoint's ``eval_results.json`` (written by ``flexformers-decode``).

The pieces live beside this module: :mod:`~flexformers.training_scripts.hub_remote_code` (the flat, relative-only
copy of the model's source), :mod:`~flexformers.training_scripts.hub_checkpoint` (reading and validating the
checkpoint) and :mod:`~flexformers.training_scripts.hub_model_card` (the card); this module assembles the folder.

The export is atomic: everything is written into a temporary directory next to the output and renamed into
place only after the folder has been checked, so a failure (not a flexformers checkpoint, a corrupt
``config.json``, truncated weights, ...) leaves nothing behind. The folder carries a marker
(:data:`EXPORT_MARKER`, left out of the upload): ``--overwrite`` replaces only such a folder, never a run, a
folder containing the checkpoint or anything else the user made.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flexformers.training_scripts.generation_defaults import unset_global_generation_defaults
from flexformers.training_scripts.hub_checkpoint import (
    EVAL_RESULTS_FILE,
    RemoteClasses,
    check_weights_file,
    read_checkpoint_config,
    read_eval_results,
    read_generation_samples,
    read_json_file,
    read_training_arguments,
    read_training_summary,
    resolve_model_type,
)
from flexformers.training_scripts.hub_model_card import (
    DEFAULT_CARDS_DIR,
    method_specific_config,
    render_model_card,
)
from flexformers.training_scripts.hub_remote_code import (
    ExportError,
    check_flat_remote_code,
    collect_remote_code,
)

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ExportOptions:
    """Everything :func:`export_checkpoint` takes besides the two paths."""

    hub_model_id: str | None = None
    language: Sequence[str] | None = None
    license: str | None = None
    datasets: Sequence[str] | None = None
    dataset_config: str | None = None
    generation_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    require_eval_results: bool = True
    overwrite: bool = False
    cards_dir: Path = DEFAULT_CARDS_DIR


def parse_overrides(text: str | None) -> dict[str, Any]:
    """``"num_beams=5,exit_thresholds=[0.9,0.8],name=x"`` (commas inside brackets belong to the value) or a JSON
    object -> a typed dict (JSON literals where they parse, else strings)."""
    overrides: dict[str, Any] = {}
    if not text or not text.strip():
        return overrides
    if text.lstrip().startswith("{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as error:
            raise ExportError(f"--generation_overrides is not a valid JSON object: {error}") from error
        if not isinstance(parsed, dict):
            raise ExportError("--generation_overrides must be key=value pairs or a JSON object")
        return parsed
    items, depth, current = [], 0, ""
    for character in text:
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(character, 0)
        if character == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += character
    items.append(current)
    for item in items:
        if not item.strip():
            continue
        if "=" not in item:
            raise ExportError(f"--generation_overrides item {item!r} is not key=value")
        key, value = (part.strip() for part in item.split("=", 1))
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def _load_checkpoint(checkpoint: Path, classes: RemoteClasses):
    """Load config, model (every weight accounted for) and tokenizer, turning every failure into a clear error."""
    from flexformers.training_scripts.model_loading import WeightsNotLoadedError, load_pretrained_checked
    from flexformers.training_scripts.tokenizer import check_tokenizer_layout, load_tokenizers

    try:
        config = classes.config_class.from_pretrained(str(checkpoint))
    except (ValueError, TypeError, KeyError) as error:
        raise ExportError(f"{checkpoint / 'config.json'} is not a valid {classes.config_class.__name__}: {error}") from error
    check_weights_file(checkpoint)
    try:
        model = load_pretrained_checked(classes.model_class, checkpoint, config=config)
    except WeightsNotLoadedError as error:
        raise ExportError(f"the weights do not match {classes.model_class.__name__}: {error}") from error
    except Exception as error:
        raise ExportError(f"cannot load the weights of {checkpoint} into {classes.model_class.__name__}: {error}") from error
    model.eval()
    try:
        check_tokenizer_layout(checkpoint)
    except ValueError as error:
        raise ExportError(str(error)) from error
    try:
        source_tokenizer, target_tokenizer = load_tokenizers(checkpoint)
    except Exception as error:
        raise ExportError(f"{checkpoint} has no loadable tokenizer (tokenizer.json, tokenizer_config.json): {error}") from error
    return config, model, source_tokenizer, target_tokenizer


def _check_tokenizer_is_standard(folder: Path) -> None:
    """The saved tokenizer must be a class Transformers ships (a user has no flexformers tokenizer class)."""
    import transformers

    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        raise ExportError("the tokenizer did not save a tokenizer_config.json")
    tokenizer_class = read_json_file(config_path, "tokenizer config").get("tokenizer_class")
    if tokenizer_class and not hasattr(transformers, tokenizer_class):
        raise ExportError(
            f"the tokenizer class {tokenizer_class!r} is not part of transformers; AutoTokenizer cannot load it "
            f"without flexformers"
        )


#: ``generate()`` parameters that are inputs or Transformers' own machinery, never a method's decoding setting.
_GENERATE_MACHINERY = frozenset({
    "self", "inputs", "input_ids", "attention_mask", "generation_config", "logits_processor", "stopping_criteria",
    "prefix_allowed_tokens_fn", "synced_gpus", "assistant_model", "streamer", "negative_prompt_ids",
    "negative_prompt_attention_mask", "custom_generate", "use_model_defaults", "kwargs",
})


def method_decoding_settings(model) -> dict[str, Any]:
    """The method's own decoding options that the checkpoint's config sets: keyword parameters of the model's
    ``generate()`` that are also config attributes with a value (e.g. Depth-Adaptive's ``exit_strategy`` /
    ``exit_thresholds``). They go into ``generation_config.json`` so the folder documents how it decodes."""
    parameters = inspect.signature(type(model).generate).parameters
    settings = {}
    for name, parameter in parameters.items():
        if name in _GENERATE_MACHINERY or parameter.kind in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
            continue
        value = getattr(model.config, name, None)
        if value is None:
            continue
        try:
            json.dumps(value)
        except TypeError:
            continue
        settings[name] = list(value) if isinstance(value, tuple) else value
    return settings


def build_generation_config(model, eval_results: dict[str, Any] | None, overrides: dict[str, Any]):
    """The model's generation config (the checkpoint's ``generation_config.json`` less the fields that only repeat
    Transformers' defaults, with the method's decoding fields), overlaid with the beam size / length penalty of the
    reported evaluation, then ``overrides``."""
    import copy

    generation_config = copy.deepcopy(model.generation_config)
    unset_global_generation_defaults(generation_config)
    updates: dict[str, Any] = dict(method_decoding_settings(model))
    if eval_results is not None:
        if eval_results.get("num_beams") is not None:
            updates["num_beams"] = eval_results["num_beams"]
        if eval_results.get("max_new_tokens") is not None:
            updates["max_new_tokens"] = eval_results["max_new_tokens"]
        # Length penalty and early stopping only act in beam search (flexformers-decode stops beams early, like
        # fairseq); Transformers refuses to save either next to greedy decoding.
        if updates.get("num_beams", generation_config.num_beams) > 1:
            updates["early_stopping"] = True
            if eval_results.get("length_penalty") is not None:
                updates["length_penalty"] = eval_results["length_penalty"]
    updates.update(overrides)
    try:
        unused = generation_config.update(**updates)
        # Keys GenerationConfig does not declare are kept as attributes (methods' own decoding options).
        for key, value in unused.items():
            setattr(generation_config, key, value)
        # A standalone generation config: Transformers must not re-derive it from config.json at generate() time.
        generation_config._from_model_config = False
        generation_config.validate(strict=True)
    except (ValueError, TypeError) as error:
        raise ExportError(f"invalid generation settings {updates}: {error}") from error
    return generation_config


def export_checkpoint(checkpoint: str | os.PathLike, output_dir: str | os.PathLike, options: ExportOptions | None = None) -> Path:
    """Write the Hub-ready folder of ``checkpoint`` to ``output_dir`` atomically; returns ``output_dir``."""
    options = options or ExportOptions()
    checkpoint = Path(checkpoint).resolve()
    output_dir = Path(output_dir).resolve()
    check_output_folder(checkpoint, output_dir, options.overwrite)

    raw_config = read_checkpoint_config(checkpoint)
    classes = resolve_model_type(str(raw_config["model_type"]))
    eval_results = read_eval_results(checkpoint)
    if eval_results is None and options.require_eval_results:
        raise ExportError(
            f"{checkpoint} has no {EVAL_RESULTS_FILE}; run flexformers-decode on it first (the card reports its "
            f"evaluation), or pass --allow_missing_eval_results"
        )
    config, model, source_tokenizer, target_tokenizer = _load_checkpoint(checkpoint, classes)
    # a method registered from outside the package keeps its code in its own module: the folder then loads after
    # that module is imported (it registers the Auto classes), as a model of any third-party package does
    remote_code = collect_remote_code(classes.root_files()) if classes.in_package else {}
    auto_map = classes.auto_map() if classes.in_package else {}
    generation_config = build_generation_config(model, eval_results, options.generation_overrides)

    from flexformers.training_scripts.tokenizer import SOURCE_TOKENIZER_SUBDIR, save_tokenizers

    created_parents = [parent for parent in output_dir.parents if not parent.exists()]
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.export-", dir=output_dir.parent))
    try:
        staging.chmod(0o777 & ~_current_umask())  # mkdtemp creates 0700; the folder is meant to be shared
        model.generation_config = generation_config
        model.save_pretrained(str(staging), safe_serialization=True)
        config_path = staging / "config.json"
        saved_config = read_json_file(config_path, "config")
        if auto_map:
            saved_config["auto_map"] = auto_map
        config_path.write_text(json.dumps(saved_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        generation_config.save_pretrained(str(staging))
        save_tokenizers(staging, source_tokenizer, target_tokenizer)
        _check_tokenizer_is_standard(staging)
        if source_tokenizer is not target_tokenizer:
            _check_tokenizer_is_standard(staging / SOURCE_TOKENIZER_SUBDIR)
        for name, source in remote_code.items():
            if (staging / name).exists():
                raise ExportError(f"remote code file {name} clashes with a file the checkpoint writes")
            (staging / name).write_text(source, encoding="utf-8")
        if auto_map:
            check_flat_remote_code(staging, sorted({entry.split(".")[0] + ".py" for entry in auto_map.values()}))
        card = render_model_card(
            model_type=classes.config_class.model_type,
            model_id=options.hub_model_id or output_dir.name,
            config=saved_config,
            generation_config=generation_config.to_diff_dict(),
            eval_results=eval_results,
            training=read_training_summary(checkpoint),
            num_parameters=model.num_parameters(),
            source_tokenizer_subfolder=SOURCE_TOKENIZER_SUBDIR if source_tokenizer is not target_tokenizer else None,
            training_arguments=read_training_arguments(checkpoint),
            method_config=method_specific_config(saved_config),
            samples=read_generation_samples(checkpoint, eval_results["split"]) if eval_results else [],
            auto_map=auto_map,
            plugin_module=None if classes.in_package else classes.plugin_module,
            card_template=classes.card_template,
            description=classes.description,
            language=options.language,
            license=options.license,
            datasets=options.datasets,
            dataset_config=options.dataset_config,
            cards_dir=options.cards_dir,
        )
        (staging / "README.md").write_text(card, encoding="utf-8")
        _write_export_marker(staging, checkpoint)
        for path in staging.rglob("*"):  # some writers (safetensors) create 0600 files
            path.chmod((0o777 if path.is_dir() else 0o666) & ~_current_umask())
        check_output_folder(checkpoint, output_dir, options.overwrite)  # nothing changed it while we worked
        _replace_directory(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for parent in created_parents:  # innermost first; only the directories this call created
            try:
                parent.rmdir()
            except OSError:
                break
        raise
    return output_dir


#: The file that marks a folder as made by ``flexformers-export`` (what was exported, when, which files): only such
#: a folder may be replaced by ``--overwrite``. A dot-file, kept out of the Hub upload (:func:`push_folder_to_hub`)
#: and ignored by ``from_pretrained``.
EXPORT_MARKER = ".flexformers-export.json"


def _write_export_marker(folder: Path, checkpoint: Path) -> None:
    import datetime

    files = sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file())
    marker = {
        "exported_by": "flexformers-export",
        "checkpoint": str(checkpoint),
        "exported_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "files": files,
    }
    (folder / EXPORT_MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")


def previous_export_problem(folder: Path) -> str | None:
    """Why ``folder`` is not a previous export that ``--overwrite`` may replace, or ``None`` when it is one: it
    carries :data:`EXPORT_MARKER` and holds only the files that export wrote."""
    marker_path = folder / EXPORT_MARKER
    if not marker_path.is_file():
        return f"it was not made by flexformers-export (it has no {EXPORT_MARKER})"
    try:
        marker = json.loads(marker_path.read_text(encoding="utf-8"))
        written = set(marker["files"])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        return f"its {EXPORT_MARKER} is unreadable ({error})"
    added = sorted(
        str(path.relative_to(folder)) for path in folder.rglob("*")
        if not path.is_dir() and path != marker_path and str(path.relative_to(folder)) not in written
    )
    if added:
        shown = ", ".join(added[:5]) + (f" and {len(added) - 5} more" if len(added) > 5 else "")
        return f"it holds files the export did not write ({shown})"
    return None


def check_output_folder(checkpoint: Path, output_dir: Path, overwrite: bool) -> None:
    """Refuse, with one line saying why, an output folder whose creation or replacement would lose anything: the
    checkpoint itself, a folder containing the checkpoint or inside it, a file, an existing folder without
    ``overwrite``, and with ``overwrite`` any folder but a previous, unmodified export. Both paths are resolved."""
    if output_dir == checkpoint:
        raise ExportError("the output directory must differ from the checkpoint directory")
    if output_dir in checkpoint.parents:
        raise ExportError(
            f"{output_dir} contains the checkpoint {checkpoint}; export into a new folder outside it (replacing it "
            f"would delete the checkpoint)"
        )
    if checkpoint in output_dir.parents:
        raise ExportError(
            f"{output_dir} is inside the checkpoint {checkpoint}; export into a folder outside the checkpoint"
        )
    if output_dir.exists() and not output_dir.is_dir():
        raise ExportError(f"{output_dir} exists and is not a folder; choose a new output folder")
    if not output_dir.exists():
        return
    if not overwrite:
        raise ExportError(f"{output_dir} already exists; pass --overwrite to replace it (a previous export only)")
    if not any(output_dir.iterdir()):
        return
    problem = previous_export_problem(output_dir)
    if problem is not None:
        raise ExportError(
            f"refusing to replace {output_dir}: {problem}; --overwrite replaces only a previous flexformers-export "
            f"folder; choose a new output folder"
        )


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _replace_directory(staging: Path, output_dir: Path) -> None:
    """Move ``staging`` to ``output_dir``; an existing ``output_dir`` is removed only once the new one is in place."""
    if not output_dir.exists():
        os.replace(staging, output_dir)
        return
    # a fresh empty name (a directory may be renamed onto an empty one), never a leftover of an earlier export
    retired = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.old-", dir=output_dir.parent))
    os.replace(output_dir, retired)
    try:
        os.replace(staging, output_dir)
    except BaseException:
        os.replace(retired, output_dir)
        raise
    shutil.rmtree(retired, ignore_errors=True)


def push_folder_to_hub(folder: str | os.PathLike, repo_id: str, *, private: bool = False, token: str | None = None,
                       commit_message: str = "Upload flexformers model") -> str:
    """Create (or reuse) the Hub model repository ``repo_id`` and upload ``folder``; returns the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    commit = api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=str(folder),
                               commit_message=commit_message, ignore_patterns=[EXPORT_MARKER])
    return str(getattr(commit, "commit_url", commit))


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------


def build_argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexformers-export",
        description="Turn a trained flexformers checkpoint directory into a Hub-ready folder (remote code, weights, "
        "tokenizer, generation config, model card) and optionally upload it.",
    )
    parser.add_argument("checkpoint", help="checkpoint directory written by flexformers-train (with eval_results.json)")
    parser.add_argument(
        "output_dir", help="folder to create (fails if it exists, unless --overwrite and it is a previous export)"
    )
    parser.add_argument("--hub_model_id", help="Hub repository id, e.g. user/iot-iwslt14-de-en (card and upload)")
    parser.add_argument("--push_to_hub", action="store_true", help="upload the folder with huggingface_hub")
    parser.add_argument("--private", action="store_true", help="create the Hub repository as private")
    parser.add_argument("--language", nargs="*", help="ISO codes of the languages, e.g. de en")
    parser.add_argument("--license", help="license identifier for the card, e.g. mit")
    parser.add_argument(
        "--dataset", nargs="*", dest="datasets",
        help="Hub ids of the training datasets (card metadata); the first names the evaluated dataset in the "
        "model-index, unless a --task hub run recorded its own",
    )
    parser.add_argument("--dataset_config", help="configuration of the evaluated dataset, e.g. de-en (model-index)")
    parser.add_argument(
        "--generation_overrides",
        help="comma-separated key=value decoding settings written into generation_config.json",
    )
    parser.add_argument(
        "--allow_missing_eval_results",
        action="store_true",
        help=f"export without {EVAL_RESULTS_FILE} (the card then has no model-index)",
    )
    parser.add_argument(
        "--overwrite", action="store_true",
        help=f"replace an existing output folder made by a previous flexformers-export (it carries {EXPORT_MARKER}); "
        "any other folder is refused",
    )
    parser.add_argument("--cards_dir", default=str(DEFAULT_CARDS_DIR), help="directory of the card templates")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_argument_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.push_to_hub and not args.hub_model_id:
        print("flexformers-export: --push_to_hub needs --hub_model_id", file=sys.stderr)
        return 2
    try:
        options = ExportOptions(
            hub_model_id=args.hub_model_id,
            language=args.language,
            license=args.license,
            datasets=args.datasets,
            dataset_config=args.dataset_config,
            generation_overrides=parse_overrides(args.generation_overrides),
            require_eval_results=not args.allow_missing_eval_results,
            overwrite=args.overwrite,
            cards_dir=Path(args.cards_dir),
        )
        folder = export_checkpoint(args.checkpoint, args.output_dir, options)
    except ExportError as error:
        print(f"flexformers-export: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # disk full, a read-only folder: the staging folder is removed again (see above)
        where = f" ({error.filename})" if error.filename else ""
        print(f"flexformers-export: {error.strerror or error}{where}; the export was not made and {args.output_dir} "
              f"is as it was", file=sys.stderr)
        return 1
    print(f"exported {args.checkpoint} -> {folder}")
    if args.push_to_hub:
        try:
            url = push_folder_to_hub(folder, args.hub_model_id, private=args.private)
        except Exception as error:  # no network, no token, no permission: the export itself is kept
            reason = (str(error).strip().splitlines() or [""])[0]
            print(f"flexformers-export: uploading {folder} to {args.hub_model_id} failed ({type(error).__name__}: "
                  f"{reason}); the exported folder is kept, upload it again later", file=sys.stderr)
            return 1
        print(f"uploaded to {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
