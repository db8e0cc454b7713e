"""Crash-safe checkpoints for ``flexformers-train``.

Trainer writes ``checkpoint-N`` in place (weights, optimizer, scheduler, RNG states, ``trainer_state.json`` last), so
a process killed mid-write -- or a full disk -- leaves a directory that looks like the newest checkpoint but cannot be
resumed. Two defences:

- :class:`AtomicCheckpointMixin` makes Trainer write every checkpoint into a staging directory
  (``_tmp-checkpoint-N/checkpoint-N``) and renames it to ``checkpoint-N`` only once it is complete, so a
  ``checkpoint-N`` name always means a finished checkpoint.
- :func:`find_latest_complete_checkpoint` (``--resume_from_checkpoint latest``) still checks what it picks -- a
  directory may come from an older version, another tool, or a copy -- and passes over incomplete ones (weights,
  optimizer, scheduler or RNG states missing or damaged), saying so.

And one output folder holds one run: :func:`claim_output_dir` locks the folder for the run's duration (a second
training into it is refused), gives each run an id (``flexformers_run.json`` in the folder and in every checkpoint),
lets ``latest`` pick only this run's checkpoints, and refuses a fresh run into a folder holding another run's files
unless ``--overwrite_output_dir`` is given -- which moves those files aside into ``_replaced-<time>/``, never deleting
them.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import logging
import os
import re
import shutil
import time
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

logger = logging.getLogger("flexformers.train")

TRAINER_STATE_FILE = "trainer_state.json"
# Leading underscore: Trainer's Hub uploads of output_dir skip "_*", so a checkpoint being written is never pushed.
STAGING_PREFIX = "_tmp-"
_CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_STAGING_NAME = re.compile(rf"^{re.escape(STAGING_PREFIX)}{PREFIX_CHECKPOINT_DIR}-(\d+)$")
#: The run's identity, in the output folder and in each of its checkpoints: ``{"run_id": ..., "save_only_model": ...}``.
RUN_FILE = "flexformers_run.json"
#: Held (``flock``) by the training process for the run's duration; the OS drops it when the process dies.
LOCK_FILE = "_flexformers-train.lock"
#: ``--overwrite_output_dir`` moves the previous run's files into ``_replaced-<UTC time>/`` inside the folder.
REPLACED_PREFIX = "_replaced-"
#: What a training run (and the tools run on it) writes into its output folder: a fresh run into a folder holding any
#: of these is another run's folder. Other files (the user's data, notes) are neither counted nor moved.
RUN_OUTPUT_PATTERNS = (
    f"{PREFIX_CHECKPOINT_DIR}-*", f"{STAGING_PREFIX}{PREFIX_CHECKPOINT_DIR}-*", "model*.safetensors",
    "model.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json", "config.json",
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "source_tokenizer",
    "trainer_state.json", "training_args.bin", "flexformers_*.json", "*_results.json", "test_generations.jsonl",
    "generations.*", "learning_curve.png",
)
#: Reports of a run (scores, generations, figures): moved aside with the run, but alone they are no run to protect
#: (a ``flexformers-decode`` report may sit in a folder before the model is trained there).
RUN_REPORT_PATTERNS = ("*_results.json", "test_generations.jsonl", "generations.*", "learning_curve.png")
#: What a run writes before its first checkpoint: a folder holding only these (with the run file) is a run that
#: stopped before anything worth resuming was saved, and a fresh run may replace them.
RUN_START_FILES = ("flexformers_run.json", "flexformers_data_args.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "source_tokenizer")
# Every layout Trainer.save_model can produce: plain or sharded safetensors / pickles, FSDP's sharded folder.
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def safetensors_problem(path: str | os.PathLike) -> str | None:
    """Why a ``.safetensors`` file cannot be loaded (empty, zero-filled, truncated, trailing bytes, a malformed
    header), or ``None``. Reads the header only: the file must be exactly as long as its header says, and
    ``safetensors`` must accept every tensor entry."""
    from safetensors import safe_open

    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            header_length = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
            if header_length <= 0 or 8 + header_length > size:
                return f"{path} is corrupt or truncated ({size} bytes; no valid safetensors header)"
            header = json.loads(handle.read(header_length))
        data_end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    except OSError as error:
        return f"{path} cannot be read ({error})"
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
        return f"{path} is corrupt or truncated ({size} bytes): its safetensors header is malformed ({error})"
    if 8 + header_length + data_end != size:
        return (
            f"{path} is truncated or has trailing bytes: its header describes {8 + header_length + data_end} bytes, "
            f"the file has {size}"
        )
    try:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                handle.get_slice(name)  # checks every tensor's dtype, shape and offsets
    except Exception as error:  # safetensors raises its own SafetensorError for malformed files
        return f"{path} is corrupt or truncated ({size} bytes): {error}"
    return None


def weights_problem(directory: str | os.PathLike) -> str | None:
    """Why the model weights in ``directory`` are missing or damaged, or ``None`` when they look loadable."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if (directory / "model.safetensors").is_file():
        return safetensors_problem(directory / "model.safetensors")
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (OSError, ValueError, AttributeError) as error:
            return f"{index} is not a valid weights index ({error})"
        if not isinstance(weight_map, dict) or not weight_map:
            return f"{index} has no 'weight_map'"
        for name in sorted(set(weight_map.values())):
            problem = safetensors_problem(directory / name) if (directory / name).is_file() else f"weights file {directory / name} is missing"
            if problem:
                return problem
        return None
    if any((directory / name).is_file() for name in _WEIGHT_FILES) or any(directory.glob("pytorch_model_fsdp_*")):
        return None
    return f"{directory} has no model weights ({', '.join(_WEIGHT_FILES[:1] + _WEIGHT_FILES[2:3])} or a sharded index)"


def _torch_file_problem(path: Path) -> str | None:
    """Why a ``torch.save`` file is truncated or damaged, or ``None``. Opens its zip directory only (at the end of
    the file, so a truncated file has none): fast whatever the file's size."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile, ValueError) as error:
        return f"{path.name} is truncated or corrupt ({error})"
    if not any(name.endswith("data.pkl") for name in names):
        return f"{path.name} is not a torch.save file (no data.pkl)"
    return None


def _rng_state_problem(path: Path) -> str | None:
    """Why an ``rng_state*.pth`` cannot be loaded the way Trainer loads it (``weights_only=True``, numpy's types
    allowed), or ``None``. The file is a few kilobytes."""
    import pickle

    import torch
    from transformers.trainer_pt_utils import safe_globals

    try:
        with safe_globals():
            torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError, TypeError, AttributeError):
        # (torch's own message suggests weights_only=False, i.e. running whatever code the file holds: not repeated)
        return f"{path.name} is damaged or holds objects other than RNG states, so it is not loaded"
    return None


def training_state_problem(directory: str | os.PathLike) -> str | None:
    """Why ``directory`` lacks the optimizer, scheduler or RNG states an exact continuation needs, or ``None``.

    A checkpoint of a run with ``--save_only_model`` (recorded in its run file) holds weights only; its optimizer and
    schedule are not required. DeepSpeed and FSDP layouts (``global_step*``, ``optimizer_*``) are taken as given."""
    directory = Path(directory)
    names = {entry.name for entry in directory.iterdir()}
    record = read_run_record(directory) or {}
    if not record.get("save_only_model"):
        deepspeed = any(name.startswith("global_step") for name in names)
        if not deepspeed and not any(name.startswith("optimizer") for name in names):
            return "no optimizer.pt (the optimizer state an exact continuation needs)"
        if not deepspeed and "scheduler.pt" not in names:
            return "no scheduler.pt (the learning-rate schedule an exact continuation needs)"
        for name in ("optimizer.pt", "scheduler.pt"):
            if name in names:
                problem = _torch_file_problem(directory / name)
                if problem:
                    return problem
    for name in sorted(names):
        if fnmatch.fnmatch(name, "rng_state*.pth"):
            problem = _rng_state_problem(directory / name)
            if problem:
                return problem
    return None


def checkpoint_problem(directory: str | os.PathLike) -> str | None:
    """Why ``directory`` is not a complete Trainer checkpoint, or ``None``.

    Complete = ``trainer_state.json`` (Trainer writes it last) is valid JSON, the weights are whole, and the
    optimizer, scheduler and RNG states are there and loadable (:func:`training_state_problem`)."""
    directory = Path(directory)
    state = directory / TRAINER_STATE_FILE
    if not state.is_file():
        return f"no {TRAINER_STATE_FILE}"
    try:
        if not isinstance(json.loads(state.read_text(encoding="utf-8")), dict):
            return f"{TRAINER_STATE_FILE} is not a JSON object"
    except (OSError, ValueError) as error:
        return f"{TRAINER_STATE_FILE} is unreadable ({error})"
    problem = weights_problem(directory) or training_state_problem(directory)
    return None if problem is None else problem.replace(f"{directory}/", "").replace(str(directory), "the directory")


def checkpoint_step(name: str) -> int | None:
    """N of a ``checkpoint-N`` directory name, else ``None``."""
    match = _CHECKPOINT_NAME.match(name)
    return int(match.group(1)) if match else None


def find_latest_complete_checkpoint(output_dir: str | os.PathLike) -> tuple[str | None, list[tuple[str, str]]]:
    """(the newest complete ``checkpoint-N`` of the folder's run in ``output_dir`` or ``None``, [(name, reason)] of
    the incomplete checkpoints, other runs' checkpoints and interrupted staging directories newer than it, newest
    first).

    Same naming as ``transformers.trainer_utils.get_last_checkpoint``, plus the completeness check; where the folder
    has a run id (``flexformers_run.json``), a checkpoint with another run's id is passed over (one without an id
    predates run ids and is taken as the folder's)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None, []
    folder_run = run_id_of(output_dir)
    candidates = []
    for entry in output_dir.iterdir():
        for pattern, staging in ((_CHECKPOINT_NAME, False), (_STAGING_NAME, True)):
            match = pattern.match(entry.name)
            if match and entry.is_dir():
                candidates.append((int(match.group(1)), not staging, entry))
    skipped: list[tuple[str, str]] = []
    for _, final, entry in sorted(candidates, key=lambda item: (item[0], item[1]), reverse=True):
        if not final:
            skipped.append((entry.name, "interrupted while being written"))
            continue
        owner = run_id_of(entry)
        if folder_run is not None and owner is not None and owner != folder_run:
            skipped.append((entry.name, f"another run's checkpoint: run {owner}, not this folder's {folder_run}"))
            continue
        problem = checkpoint_problem(entry)
        if problem is None:
            return str(entry), skipped
        skipped.append((entry.name, problem))
    return None, skipped


def resolve_resume_checkpoint(value: str | None, output_dir: str) -> str | None:
    """``--resume_from_checkpoint``: ``None``/``false`` -> ``None``; ``latest`` (``last``, ``true``) -> the newest
    complete checkpoint in ``output_dir`` (logging which one, and the incomplete ones passed over); a path -> that
    path once it is checked to be complete. A ``ValueError`` names what is wrong otherwise."""
    if value in (None, "", "false", "False"):
        return None
    if value in ("latest", "last", "true", "True"):
        chosen, skipped = find_latest_complete_checkpoint(output_dir)
        passed_over = "; ".join(f"{name} ({reason})" for name, reason in skipped)
        if chosen is None:
            if skipped:
                raise ValueError(
                    f"--resume_from_checkpoint {value}: no complete checkpoint-* directory in {output_dir} "
                    f"(only incomplete ones: {passed_over})"
                )
            raise ValueError(f"--resume_from_checkpoint {value}: no checkpoint-* directory in {output_dir}")
        message = f"Resuming from {chosen}, the newest complete checkpoint"
        if skipped:
            message += f"; passed over: {passed_over}"
        (logger.warning if skipped else logger.info)(message)
        _warn_if_weights_only(chosen)
        return chosen
    if not os.path.isdir(value):
        raise ValueError(f"--resume_from_checkpoint {value}: no such directory")
    problem = checkpoint_problem(value)
    if problem is not None:
        raise ValueError(
            f"--resume_from_checkpoint {value}: not a complete checkpoint ({problem}); "
            "--resume_from_checkpoint latest picks the newest complete one"
        )
    _warn_if_weights_only(value)
    return value


def _warn_if_weights_only(checkpoint: str) -> None:
    if (read_run_record(checkpoint) or {}).get("save_only_model"):
        logger.warning("%s was saved with --save_only_model: it holds the weights only, so the optimizer and the "
                       "learning-rate schedule start afresh (not an exact continuation)", checkpoint)


def read_run_record(directory: str | os.PathLike) -> dict | None:
    """The run file of an output folder or checkpoint (``{"run_id": ..., "save_only_model": ...}``), ``None`` when
    it has none (written before run ids, or by another tool); ``{}`` when it is unreadable."""
    path = Path(directory) / RUN_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def run_id_of(directory: str | os.PathLike) -> str | None:
    """The run id recorded in ``directory`` (an output folder or a checkpoint), or ``None``."""
    run_id = (read_run_record(directory) or {}).get("run_id")
    return run_id if isinstance(run_id, str) and run_id else None


def write_run_record(directory: str | os.PathLike, run_id: str, save_only_model: bool = False) -> None:
    """Write the run file into ``directory`` (replaced atomically: a reader never sees half of it). Also a
    ``checkpoint_file_writers`` entry, with ``functools.partial``."""
    path = Path(directory) / RUN_FILE
    staged = path.with_name(f"{RUN_FILE}.tmp")
    staged.write_text(json.dumps({"run_id": run_id, "save_only_model": bool(save_only_model)}, indent=2) + "\n")
    os.replace(staged, path)


def run_outputs(output_dir: str | os.PathLike, keep: str | os.PathLike | None = None) -> list[Path]:
    """The entries of ``output_dir`` that a training run wrote (:data:`RUN_OUTPUT_PATTERNS`), except ``keep`` (the
    checkpoint being resumed), sorted by name."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    kept = Path(keep).resolve() if keep is not None else None
    return sorted(
        (entry for entry in output_dir.iterdir()
         if any(fnmatch.fnmatch(entry.name, pattern) for pattern in RUN_OUTPUT_PATTERNS)
         and (kept is None or entry.resolve() != kept)),
        key=lambda entry: (checkpoint_step(entry.name) is None, entry.name),  # checkpoints first: named first
    )


def move_aside(output_dir: str | os.PathLike, entries: list[Path]) -> Path:
    """Move ``entries`` of ``output_dir`` into a new ``_replaced-<UTC time>/`` there (renames: nothing is copied
    or deleted); returns that folder. Hub uploads and checkpoint globs skip it."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    aside = Path(output_dir) / f"{REPLACED_PREFIX}{stamp}"
    suffix = 1
    while aside.exists():
        suffix += 1
        aside = Path(output_dir) / f"{REPLACED_PREFIX}{stamp}-{suffix}"
    aside.mkdir()
    for entry in entries:
        os.rename(entry, aside / entry.name)
    return aside


_HELD_LOCKS: dict[str, object] = {}


def lock_output_dir(output_dir: str | os.PathLike) -> None:
    """Hold an exclusive ``flock`` on ``output_dir/_flexformers-train.lock`` until :func:`unlock_output_dir` or the
    process's end (the OS drops it when the process dies, even by ``kill -9``: no stale lock to clear by hand).
    Creates the folder. A ``ValueError`` says when another process trains there, or the folder cannot be written
    (checked here, before any work)."""
    import fcntl

    key = os.path.abspath(output_dir)
    unlock_output_dir(key)  # this process's own lock of an earlier run that ended by an exception
    try:
        os.makedirs(key, exist_ok=True)
        handle = open(os.path.join(key, LOCK_FILE), "a+")
    except OSError as error:
        raise ValueError(f"--output_dir {output_dir} cannot be written: {error.strerror or error}") from error
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        handle.close()
        if error.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise ValueError(
                f"--output_dir {output_dir} is in use: another flexformers-train process is training into it "
                "(wait for it to finish, or choose another --output_dir)"
            ) from None
        raise
    _HELD_LOCKS[key] = handle


def unlock_output_dir(output_dir: str | os.PathLike) -> None:
    """Release this process's lock of ``output_dir`` (if it holds one). The lock file stays: removing it while
    another process waits on it would let two runs in."""
    handle = _HELD_LOCKS.pop(os.path.abspath(output_dir), None)
    if handle is not None:
        handle.close()


def claim_output_dir(output_dir: str, resume_value: str | None, overwrite: bool = False, is_main: bool = True,
                     save_only_model: bool = False) -> tuple[str, str | None]:
    """(this run's id, the checkpoint to resume or ``None``) for a run into ``output_dir``.

    The main process (``is_main``; the caller holds :func:`lock_output_dir`) checks that the folder is this run's:
    a fresh run into a folder holding another run's files (checkpoints, model, tokenizer, ...), or a resume from a
    checkpoint of another run than the folder's, is refused with a ``ValueError`` unless ``overwrite``, which moves
    those files aside (:func:`move_aside`). It then records the run id in the folder. A run resuming a checkpoint
    keeps that checkpoint's id. The other processes read the id the main one recorded."""
    resume_checkpoint = resolve_resume_checkpoint(resume_value, output_dir)
    folder_run = run_id_of(output_dir)
    if not is_main:
        return folder_run or "", resume_checkpoint
    checkpoint_run = run_id_of(resume_checkpoint) if resume_checkpoint else None
    inside = resume_checkpoint is not None and Path(resume_checkpoint).resolve().parent == Path(output_dir).resolve()
    same_run = resume_checkpoint is not None and (
        checkpoint_run == folder_run or (checkpoint_run is None and inside))  # (no id: from before run ids)
    others = [] if same_run else run_outputs(output_dir, keep=resume_checkpoint)
    if all(any(fnmatch.fnmatch(entry.name, pattern) for pattern in RUN_REPORT_PATTERNS) for entry in others):
        others = []
    if others and resume_checkpoint is None and folder_run is not None and all(
            entry.name in RUN_START_FILES for entry in others):
        logger.warning("%s holds only the start of an earlier run that stopped before its first checkpoint "
                       "(%s); starting afresh", output_dir, ", ".join(entry.name for entry in others))
        others = []
    if others:
        shown = ", ".join(entry.name for entry in others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
        whose = (f"another run than {resume_checkpoint}'s" if resume_checkpoint else "another run")
        if not overwrite:
            hint = ("resume into the checkpoint's own folder or an empty one" if resume_checkpoint
                    else "continue it with --resume_from_checkpoint latest, choose another --output_dir")
            raise ValueError(
                f"--output_dir {output_dir} holds the files of {whose} ({shown}): {hint}, or pass "
                f"--overwrite_output_dir to move them aside into {output_dir}/{REPLACED_PREFIX}<time>/"
            )
        aside = move_aside(output_dir, others)
        logger.warning("--overwrite_output_dir: moved the files of %s (%s) into %s", whose, shown, aside)
        folder_run = None
    run_id = checkpoint_run or (folder_run if same_run else None) or uuid.uuid4().hex
    write_run_record(output_dir, run_id, save_only_model)
    return run_id, resume_checkpoint


def claim_output_dir_for_evaluation(output_dir: str, model_dir: str | None, overwrite: bool = False) -> None:
    """An evaluation-only run writes its tokenizer and results into ``output_dir``: refuse (``ValueError``) a folder
    holding the files of another run than the evaluated model's (``model_dir``, or a checkpoint inside
    ``output_dir``), unless ``overwrite``, which moves them aside (:func:`move_aside`)."""
    out = Path(output_dir).resolve()
    if model_dir is not None and (Path(model_dir).resolve() == out or out in Path(model_dir).resolve().parents):
        return
    others = run_outputs(output_dir)
    if all(any(fnmatch.fnmatch(entry.name, pattern) for pattern in RUN_REPORT_PATTERNS) for entry in others):
        return
    shown = ", ".join(entry.name for entry in others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
    if not overwrite:
        raise ValueError(
            f"--output_dir {output_dir} holds the files of another run ({shown}), which an evaluation of {model_dir} "
            f"would mix its tokenizer and results into: choose another --output_dir, or pass --overwrite_output_dir "
            f"to move them aside into {output_dir}/{REPLACED_PREFIX}<time>/"
        )
    logger.warning("--overwrite_output_dir: moved the files of another run (%s) into %s", shown,
                   move_aside(output_dir, others))


def resumed_config_problem(checkpoint: str | os.PathLike, config) -> str | None:
    """Why resuming ``checkpoint`` with ``config`` (the model this run builds) cannot continue it: its
    ``config.json`` records another model type or architecture (fields that differ, at most four named). ``None``
    when they agree or the checkpoint has no readable config."""
    try:
        saved = json.loads((Path(checkpoint) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    built = config.to_dict()
    ignored = {"transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype", "_commit_hash",
               "use_cache", "output_attentions", "output_hidden_states", "return_dict"}
    differ = [key for key in sorted(set(saved) & set(built) - ignored) if saved[key] != built[key]]
    if saved.get("model_type") != built.get("model_type"):
        differ = ["model_type"] + [key for key in differ if key != "model_type"]
    if not differ:
        return None
    shown = ", ".join(f"{key}={saved[key]!r} (this run: {built[key]!r})" for key in differ[:4])
    more = f" and {len(differ) - 4} more fields" if len(differ) > 4 else ""
    return (f"--resume_from_checkpoint {checkpoint} holds a {saved.get('model_type')} model with {shown}{more}: "
            "resume with the --model_type, --preset and --config_overrides the run was started with")


def last_good_checkpoint_note(output_dir: str | os.PathLike) -> str:
    """"the last good checkpoint is X (--resume_from_checkpoint latest continues from it)", or that there is none."""
    checkpoint, _ = find_latest_complete_checkpoint(output_dir)
    if checkpoint is None:
        return "no checkpoint had been written yet"
    return f"the last good checkpoint is {checkpoint} (--resume_from_checkpoint latest continues from it)"


def describe_write_error(error: OSError, output_dir: str | os.PathLike) -> str | None:
    """One line for a failed write under ``output_dir`` -- disk full, read-only, permission denied -- naming the file
    and what is still safe; ``None`` for any other ``OSError`` (left to show its traceback)."""
    where = error.filename or output_dir
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"disk full while writing {where}: {last_good_checkpoint_note(output_dir)}; free some space and "
                "continue with --resume_from_checkpoint latest")
    if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"cannot write {where}: {error.strerror or error}"
    return None


def rotate_checkpoints_by_step(output_dir: str | os.PathLike, save_total_limit: int | None,
                               best_model_checkpoint: str | None, run_id: str | None = None) -> list[str]:
    """Delete this run's oldest checkpoints (by step, not by modification time: a copied or restored folder has
    arbitrary times) beyond ``save_total_limit``, always keeping the newest and the best. Other runs' checkpoints
    and symbolic links are never deleted. Returns the deleted paths."""
    if not save_total_limit or save_total_limit <= 0:
        return []
    mine = []
    for entry in Path(output_dir).iterdir():
        step = checkpoint_step(entry.name)
        if step is None or entry.is_symlink() or not entry.is_dir():
            continue
        owner = run_id_of(entry)
        if owner is None or run_id is None or owner == run_id:
            mine.append((step, entry))
    mine.sort(key=lambda item: item[0])
    protected = {mine[-1][1].resolve()} if mine else set()
    if best_model_checkpoint:
        protected.add(Path(best_model_checkpoint).resolve())
    keep = max(save_total_limit, len(protected))
    deleted = []
    for _, entry in mine:
        if len(mine) - len(deleted) <= keep:
            break
        if entry.resolve() not in protected:
            shutil.rmtree(entry, ignore_errors=True)
            deleted.append(str(entry))
    return deleted


class AtomicCheckpointMixin:
    """Trainer mixin: ``checkpoint-N`` appears only when it is complete.

    Trainer's own ``_save_checkpoint`` does the writing (so every file it saves, in every distributed mode, is
    kept); it just writes under a staging directory that ``checkpoint-*`` globs, ``get_last_checkpoint`` and
    checkpoint rotation never see, and the finished directory is renamed into place. ``checkpoint_file_writers``
    (callables taking the staging directory) add files that must be part of the checkpoint before it appears."""

    checkpoint_file_writers: list[Callable[[str], None]] = []
    #: The run's id (:func:`claim_output_dir`): rotation deletes only this run's checkpoints.
    run_id: str | None = None

    def _save_checkpoint(self, model, trial):
        run_dir = self._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging_root = os.path.join(run_dir, f"{STAGING_PREFIX}{name}")
        staged, final = os.path.join(staging_root, name), os.path.join(run_dir, name)
        if self.args.should_save and os.path.isdir(staging_root):
            shutil.rmtree(staging_root)  # left by an earlier run that died while writing this same step
        self.accelerator.wait_for_everyone()

        def staging_output_dir(trial=None):
            return staging_root

        # Instance attributes shadow the methods for this save only: Trainer writes under the staging directory,
        # and its Hub push (an upload running in the background) waits for the final name instead of reading a
        # directory that is renamed under it.
        pushes: list[str] = []
        self._get_output_dir = staging_output_dir
        self._push_from_checkpoint = pushes.append
        try:
            super()._save_checkpoint(model, trial)
        finally:
            del self._get_output_dir, self._push_from_checkpoint
        if self.state.best_model_checkpoint == staged:
            # Trainer recorded the staging path as the best checkpoint: point the state (in memory and in the
            # checkpoint's trainer_state.json) at the final name before the directory gets it.
            self.state.best_model_checkpoint = final
            if self.args.should_save:
                self.state.save_to_json(os.path.join(staged, TRAINER_STATE_FILE))
        self.accelerator.wait_for_everyone()  # every rank's shards are written before the rename
        if self.args.should_save:
            for write in self.checkpoint_file_writers:
                write(staged)
            _replace_directory(staged, final, self.run_id)
            shutil.rmtree(staging_root, ignore_errors=True)
            # Trainer rotated inside the staging directory (one checkpoint, nothing to do); rotate the real ones.
            rotate_checkpoints_by_step(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint,
                                       self.run_id)
        self.accelerator.wait_for_everyone()
        if pushes:
            self._push_from_checkpoint(final)


def _replace_directory(source: str, target: str, run_id: str | None = None) -> None:
    """Rename ``source`` to ``target``; an existing ``target`` (e.g. an incomplete directory of an interrupted run
    at the same step) is moved aside first and deleted only after the new one is in place -- unless it is another
    run's checkpoint or a symbolic link, which is kept beside it as ``checkpoint-N.replaced-<time>``."""
    if not os.path.lexists(target):
        os.rename(source, target)
        return
    owner = run_id_of(target)
    if os.path.islink(target) or (owner is not None and run_id is not None and owner != run_id):
        kept = f"{target}.replaced-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
        os.rename(target, kept)
        os.rename(source, target)
        logger.warning("%s was %s; kept it as %s", target,
                       "a symbolic link" if os.path.islink(kept) else f"run {owner}'s checkpoint", kept)
        return
    aside = f"{source}.replaced"
    os.rename(target, aside)
    os.rename(source, target)
    shutil.rmtree(aside, ignore_errors=True)


__all__ = [
    "AtomicCheckpointMixin",
    "checkpoint_problem",
    "claim_output_dir",
    "claim_output_dir_for_evaluation",
    "describe_write_error",
    "find_latest_complete_checkpoint",
    "last_good_checkpoint_note",
    "lock_output_dir",
    "read_run_record",
    "resolve_resume_checkpoint",
    "resumed_config_problem",
    "rotate_checkpoints_by_step",
    "run_id_of",
    "run_outputs",
    "safetensors_problem",
    "training_state_problem",
    "unlock_output_dir",
    "weights_problem",
    "write_run_record",
]
