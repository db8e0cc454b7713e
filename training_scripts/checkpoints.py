"""Crash-safe checkpoints for ``flexformers-train``.

Trainer writes ``checkpoint-N`` in place (weights, optimizer, scheduler, RNG states, ``trainer_state.json`` last), so
a process killed mid-write -- or a full disk -- leaves a directory that looks like the newest checkpoint but cannot be
resumed. Two defences:

- :class:`AtomicCheckpointMixin` makes Trainer write every checkpoint into a staging directory
  (``_tmp-checkpoint-N/checkpoint-N``) and renames it to ``checkpoint-N`` only once it is complete, so a
  ``checkpoint-N`` name always means a finished checkpoint.
- :func:`find_latest_complete_checkpoint` (``--resume_from_checkpoint latest``) still checks what it picks -- a
  directory may come from an older version, another tool, or a copy -- and passes over incomplete ones, saying so.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

logger = logging.getLogger("flexformers.train")

TRAINER_STATE_FILE = "trainer_state.json"
# Leading underscore: Trainer's Hub uploads of output_dir skip "_*", so a checkpoint being written is never pushed.
STAGING_PREFIX = "_tmp-"
_CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_STAGING_NAME = re.compile(rf"^{re.escape(STAGING_PREFIX)}{PREFIX_CHECKPOINT_DIR}-(\d+)$")
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


def checkpoint_problem(directory: str | os.PathLike) -> str | None:
    """Why ``directory`` is not a complete Trainer checkpoint, or ``None``.

    Complete = ``trainer_state.json`` (Trainer writes it last) is valid JSON and the weights are whole."""
    directory = Path(directory)
    state = directory / TRAINER_STATE_FILE
    if not state.is_file():
        return f"no {TRAINER_STATE_FILE}"
    try:
        if not isinstance(json.loads(state.read_text(encoding="utf-8")), dict):
            return f"{TRAINER_STATE_FILE} is not a JSON object"
    except (OSError, ValueError) as error:
        return f"{TRAINER_STATE_FILE} is unreadable ({error})"
    problem = weights_problem(directory)
    return None if problem is None else problem.replace(f"{directory}/", "").replace(str(directory), "the directory")


def find_latest_complete_checkpoint(output_dir: str | os.PathLike) -> tuple[str | None, list[tuple[str, str]]]:
    """(the newest complete ``checkpoint-N`` in ``output_dir`` or ``None``, [(name, reason)] of the incomplete
    checkpoints and interrupted staging directories newer than it, newest first).

    Same naming as ``transformers.trainer_utils.get_last_checkpoint``, plus the completeness check."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None, []
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
            message += f"; passed over incomplete: {passed_over}"
        (logger.warning if skipped else logger.info)(message)
        return chosen
    if not os.path.isdir(value):
        raise ValueError(f"--resume_from_checkpoint {value}: no such directory")
    problem = checkpoint_problem(value)
    if problem is not None:
        raise ValueError(
            f"--resume_from_checkpoint {value}: not a complete checkpoint ({problem}); "
            "--resume_from_checkpoint latest picks the newest complete one"
        )
    return value


class AtomicCheckpointMixin:
    """Trainer mixin: ``checkpoint-N`` appears only when it is complete.

    Trainer's own ``_save_checkpoint`` does the writing (so every file it saves, in every distributed mode, is
    kept); it just writes under a staging directory that ``checkpoint-*`` globs, ``get_last_checkpoint`` and
    checkpoint rotation never see, and the finished directory is renamed into place. ``checkpoint_file_writers``
    (callables taking the staging directory) add files that must be part of the checkpoint before it appears."""

    checkpoint_file_writers: list[Callable[[str], None]] = []

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
            _replace_directory(staged, final)
            shutil.rmtree(staging_root, ignore_errors=True)
            from transformers.trainer_utils import rotate_checkpoints

            # Trainer rotated inside the staging directory (one checkpoint, nothing to do); rotate the real ones.
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        self.accelerator.wait_for_everyone()
        if pushes:
            self._push_from_checkpoint(final)


def _replace_directory(source: str, target: str) -> None:
    """Rename ``source`` to ``target``; an existing ``target`` (e.g. an incomplete directory of an interrupted run
    at the same step) is moved aside first and deleted only after the new one is in place."""
    if not os.path.exists(target):
        os.rename(source, target)
        return
    aside = f"{source}.replaced"
    os.rename(target, aside)
    os.rename(source, target)
    shutil.rmtree(aside, ignore_errors=True)


def with_atomic_checkpoints(trainer_class: type) -> type:
    """``trainer_class`` with :class:`AtomicCheckpointMixin` in front (unchanged when it already has it)."""
    if issubclass(trainer_class, AtomicCheckpointMixin):
        return trainer_class
    return type(trainer_class.__name__, (AtomicCheckpointMixin, trainer_class), {"__module__": trainer_class.__module__})


__all__ = [
    "AtomicCheckpointMixin",
    "checkpoint_problem",
    "find_latest_complete_checkpoint",
    "resolve_resume_checkpoint",
    "safetensors_problem",
    "weights_problem",
    "with_atomic_checkpoints",
]
