"""One output folder, one run (issue 60): ``flexformers-train`` never resumes, rotates away, mixes in or silently
replaces another run's files; checkpoints are resumed only when they can continue the run exactly; a run that cannot
work says so in one line before it starts. Each test reproduces a probe that deleted or replaced work, exited 0 with
a wrong result, or ended in a traceback."""

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import transformers
from safetensors.torch import load_file

from flexformers.training_scripts import train
from flexformers.training_scripts.checkpoints import (
    LOCK_FILE,
    REPLACED_PREFIX,
    RUN_FILE,
    checkpoint_problem,
    find_latest_complete_checkpoint,
    rotate_checkpoints_by_step,
    run_id_of,
)

from .test_reliability import KillAt, Killed, assert_same_weights
from .test_training import tiny_argv


@pytest.fixture(autouse=True)
def _offline_private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("FLEXFORMERS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


SAVE_EVERY_2 = ("--save_strategy", "steps", "--save_steps", "2")


def vocab_size_of(folder):
    return json.loads((folder / "config.json").read_text())["vocab_size"]


def one_line_error(capsys) -> str:
    """The CLI's error line (stderr also holds the progress bars of the work done before it)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("flexformers-train: error: "), err
    return lines[0]


# ------------------------------------------------------------------------------ 1. a folder holds one run
def test_a_fresh_run_into_another_runs_folder_needs_an_explicit_choice(tmp_path, capsys):
    """Another run's checkpoints, model and tokenizer in --output_dir: a fresh run is refused in one line naming
    both ways on; --overwrite_output_dir moves the old files aside (nothing deleted) and the new run trains its own
    tokenizer (its --vocab_size, not the old run's) and resumes only its own checkpoints."""
    out = tmp_path / "run"
    train.run_from_argv(tiny_argv(out, "--max_steps", "4", *SAVE_EVERY_2))
    first_weights = (out / "model.safetensors").read_bytes()
    first_run = run_id_of(out)
    assert first_run and run_id_of(out / "checkpoint-4") == first_run

    second = tiny_argv(out, "--max_steps", "2", *SAVE_EVERY_2, "--vocab_size", "280")
    assert train.main(second) == 1
    err = one_line_error(capsys)
    assert "holds the files of another run (checkpoint-2, checkpoint-4" in err
    assert "--resume_from_checkpoint latest" in err and "--overwrite_output_dir" in err
    assert (out / "model.safetensors").read_bytes() == first_weights and vocab_size_of(out) == 300

    train.run_from_argv(second + ["--overwrite_output_dir"])
    (aside,) = [entry for entry in out.iterdir() if entry.name.startswith(REPLACED_PREFIX)]
    assert (aside / "model.safetensors").read_bytes() == first_weights
    assert checkpoint_problem(aside / "checkpoint-4") is None and run_id_of(aside) == first_run
    assert sorted(entry.name for entry in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert vocab_size_of(out) == 280 and run_id_of(out) not in (None, first_run)
    assert run_id_of(out / "checkpoint-2") == run_id_of(out)
    # the old run's checkpoint-4 is never resumed: latest continues the new run from its own checkpoint-2
    results = train.run_from_argv(tiny_argv(out, "--max_steps", "4", *SAVE_EVERY_2, "--vocab_size", "280",
                                            "--resume_from_checkpoint", "latest"))
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4
    assert results["train"]["train_samples"] > 0 and vocab_size_of(out) == 280


def test_latest_resumes_only_this_runs_checkpoints(tmp_path, caplog):
    """A higher-numbered checkpoint of another run copied into the folder: ``latest`` passes it over (it used to
    resume it, train 0 steps and overwrite the run's model), and saving this run's checkpoint of the same step keeps
    the other one beside it. An explicit path of another run into a folder of this one is refused."""
    other, mine = tmp_path / "other", tmp_path / "mine"
    train.run_from_argv(tiny_argv(other, "--max_steps", "4", *SAVE_EVERY_2))
    parsed = train.parse_arguments(tiny_argv(mine, "--max_steps", "4", *SAVE_EVERY_2))
    with pytest.raises(Killed):
        train.run(*parsed, extra_callbacks=[KillAt(3)])
    shutil.copytree(other / "checkpoint-4", mine / "checkpoint-4")

    chosen, skipped = find_latest_complete_checkpoint(mine)
    assert chosen == str(mine / "checkpoint-2")
    assert skipped[0][0] == "checkpoint-4" and "another run's checkpoint" in skipped[0][1]

    with pytest.raises(ValueError, match=r"holds the files of another run than .*other/checkpoint-4's"):
        train.run_from_argv(tiny_argv(mine, "--max_steps", "4", *SAVE_EVERY_2,
                                      "--resume_from_checkpoint", str(other / "checkpoint-4")))
    caplog.set_level(logging.INFO, logger="flexformers.train")
    train.run_from_argv(tiny_argv(mine, "--max_steps", "4", *SAVE_EVERY_2, "--resume_from_checkpoint", "latest"))
    assert any("Resuming from" in r.getMessage() and r.getMessage().split(",")[0].endswith("checkpoint-2")
               for r in caplog.records)
    assert run_id_of(mine / "checkpoint-4") == run_id_of(mine) != run_id_of(other)
    (kept,) = mine.glob("checkpoint-4.replaced-*")
    assert run_id_of(kept) == run_id_of(other)
    straight = tmp_path / "straight"
    train.run_from_argv(tiny_argv(straight, "--max_steps", "4", *SAVE_EVERY_2))
    assert_same_weights(straight, mine)


def test_a_checkpoint_resumed_into_an_empty_folder_continues_its_run(tmp_path):
    """--resume_from_checkpoint PATH of another folder into an empty one is a continuation of that run (its id)."""
    first = tmp_path / "first"
    train.run_from_argv(tiny_argv(first, "--max_steps", "2", *SAVE_EVERY_2))
    fork = tmp_path / "fork"
    train.run_from_argv(tiny_argv(fork, "--max_steps", "4", *SAVE_EVERY_2,
                                  "--resume_from_checkpoint", str(first / "checkpoint-2")))
    assert run_id_of(fork) == run_id_of(first) == run_id_of(fork / "checkpoint-4")
    assert json.loads((fork / "trainer_state.json").read_text())["global_step"] == 4


def test_a_run_that_stopped_before_its_first_checkpoint_is_started_afresh_with_its_own_tokenizer(tmp_path):
    """Only the start of a run (its tokenizer, data arguments, run file) and no checkpoint: nothing to resume, so a
    fresh run may start there (the zoo's next session does) -- training its own tokenizer, not reusing that one."""
    out = tmp_path / "run"
    parsed = train.parse_arguments(tiny_argv(out, "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "3"))
    with pytest.raises(Killed):
        train.run(*parsed, extra_callbacks=[KillAt(1)])
    assert (out / "tokenizer.json").is_file() and not list(out.glob("checkpoint-*"))
    train.run_from_argv(tiny_argv(out, "--max_steps", "1", "--vocab_size", "280"))
    assert vocab_size_of(out) == 280


def test_an_evaluation_into_another_runs_folder_is_refused(tmp_path, capsys):
    """--do_eval of run A with --output_dir of run B used to replace B's tokenizer with A's and add A's scores to
    B's folder; into A's own folder it works."""
    first, second = tmp_path / "first", tmp_path / "second"
    train.run_from_argv(tiny_argv(first, "--max_steps", "1"))
    train.run_from_argv(tiny_argv(second, "--max_steps", "1", "--vocab_size", "280"))
    tokenizer = (second / "tokenizer.json").read_bytes()

    def evaluate(output_dir):
        argv = tiny_argv(output_dir, "--do_eval", "--model_name_or_path", str(first), "--max_eval_samples", "2",
                         "--generation_max_length", "4")
        argv.remove("--do_train")
        return train.main(argv)

    assert evaluate(second) == 1
    assert "holds the files of another run (" in one_line_error(capsys)
    assert (second / "tokenizer.json").read_bytes() == tokenizer and not (second / "validation_results.json").exists()
    assert evaluate(first) == 0 and (first / "validation_results.json").is_file()


# ------------------------------------------------------------------------------ 2. one training at a time
def test_a_second_training_into_the_same_folder_is_refused_and_a_killed_one_leaves_no_stale_lock(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import fcntl, sys, time
            handle = open({str(out / LOCK_FILE)!r}, "a+")
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            print("locked", flush=True)
            time.sleep(120)
        """)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert train.main(tiny_argv(out, "--max_steps", "1")) == 1
        assert "is in use: another flexformers-train process is training into it" in one_line_error(capsys)
        assert not (out / "model.safetensors").exists()
    finally:
        holder.kill()  # SIGKILL: no clean-up runs in that process
        holder.wait()
    assert train.main(tiny_argv(out, "--max_steps", "1")) == 0
    assert (out / "model.safetensors").is_file()


# ------------------------------------------------------------------------------ 3. rotation by step
def test_rotation_keeps_the_newest_steps_whatever_the_modification_times(tmp_path):
    """A restored run (checkpoint-4 older on disk than checkpoint-2) resumed from checkpoint-4 with
    --save_total_limit 2: rotation used to sort by mtime and delete checkpoint-4; it keeps 4 and 6."""
    out = tmp_path / "run"
    common = ("--save_total_limit", "2", *SAVE_EVERY_2)
    train.run_from_argv(tiny_argv(out, "--max_steps", "4", *common))
    os.utime(out / "checkpoint-4", (1_000_000, 1_000_000))
    os.utime(out / "checkpoint-2", (2_000_000, 2_000_000))
    train.run_from_argv(tiny_argv(out, "--max_steps", "6", *common, "--resume_from_checkpoint", "latest"))
    assert sorted(entry.name for entry in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]


def test_rotation_keeps_the_best_and_never_deletes_other_runs_or_symlinked_checkpoints(tmp_path):
    out, archive = tmp_path / "run", tmp_path / "archive"
    for step in (2, 4, 6, 8, 10):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        os.utime(out / f"checkpoint-{step}", (10_000_000 - step, 10_000_000 - step))  # newest step, oldest time
    (out / "checkpoint-4" / "flexformers_run.json").write_text(json.dumps({"run_id": "other"}))
    (archive / "checkpoint-1").mkdir(parents=True)
    (archive / "checkpoint-1" / "weights").write_text("kept")
    os.symlink(archive / "checkpoint-1", out / "checkpoint-1")
    deleted = rotate_checkpoints_by_step(out, 2, str(out / "checkpoint-2"), run_id="mine")
    assert sorted(os.path.basename(path) for path in deleted) == ["checkpoint-6", "checkpoint-8"]
    assert sorted(entry.name for entry in out.iterdir()) == ["checkpoint-1", "checkpoint-10", "checkpoint-2", "checkpoint-4"]
    assert (archive / "checkpoint-1" / "weights").read_text() == "kept"


# ------------------------------------------------------------------------------ 4. complete = resumable exactly
def test_a_checkpoint_without_or_with_a_damaged_optimizer_is_passed_over_and_resume_stays_exact(tmp_path, capsys):
    """checkpoint-4 without optimizer.pt (or with it truncated, or its scheduler.pt missing) is not complete:
    ``latest`` falls back to checkpoint-2, naming why, and the result equals an uninterrupted run's; the path of
    such a checkpoint is a one-line error."""
    common = ("--max_steps", "4", *SAVE_EVERY_2)
    straight = tmp_path / "straight"
    train.run_from_argv(tiny_argv(straight, *common))
    damaged = tmp_path / "damaged"
    shutil.copytree(straight, damaged)
    (damaged / "checkpoint-4" / "optimizer.pt").unlink()
    chosen, skipped = find_latest_complete_checkpoint(damaged)
    assert chosen == str(damaged / "checkpoint-2")
    assert skipped == [("checkpoint-4", "no optimizer.pt (the optimizer state an exact continuation needs)")]

    shutil.copy(straight / "checkpoint-4" / "optimizer.pt", damaged / "checkpoint-4" / "optimizer.pt")
    with open(damaged / "checkpoint-4" / "optimizer.pt", "r+b") as handle:
        handle.truncate(os.path.getsize(damaged / "checkpoint-4" / "optimizer.pt") // 2)
    assert checkpoint_problem(damaged / "checkpoint-4").startswith("optimizer.pt is truncated or corrupt")
    assert train.main(tiny_argv(damaged, *common, "--resume_from_checkpoint", str(damaged / "checkpoint-4"))) == 1
    assert "not a complete checkpoint (optimizer.pt is truncated or corrupt" in one_line_error(capsys)

    train.run_from_argv(tiny_argv(damaged, *common, "--resume_from_checkpoint", "latest"))
    assert_same_weights(straight, damaged)
    assert checkpoint_problem(damaged / "checkpoint-4") is None

    (damaged / "checkpoint-4" / "scheduler.pt").unlink()
    assert checkpoint_problem(damaged / "checkpoint-4") == "no scheduler.pt (the learning-rate schedule an exact continuation needs)"


def test_a_weights_only_run_can_still_resume_its_checkpoints(tmp_path, caplog):
    """--save_only_model: the run file records it, so its checkpoints count as complete without an optimizer, and
    resuming one says the optimizer and schedule start afresh."""
    out = tmp_path / "run"
    train.run_from_argv(tiny_argv(out, "--max_steps", "2", *SAVE_EVERY_2, "--save_only_model", "true"))
    assert not (out / "checkpoint-2" / "optimizer.pt").exists()
    assert checkpoint_problem(out / "checkpoint-2") is None
    caplog.set_level(logging.INFO, logger="flexformers.train")
    train.run_from_argv(tiny_argv(out, "--max_steps", "3", *SAVE_EVERY_2, "--save_only_model", "true",
                                  "--resume_from_checkpoint", "latest"))
    assert any("saved with --save_only_model" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------ 5. a time budget is a time
@pytest.mark.parametrize("minutes", ["0", "nan", "-1", "inf"])
def test_a_time_budget_must_be_a_positive_number(tmp_path, minutes, capsys):
    # (--max_steps 1: "0", "nan" and "inf" used to mean no limit at all)
    assert train.main(tiny_argv(tmp_path / "run", "--max_train_minutes", minutes, "--max_steps", "1")) == 1
    assert "--max_train_minutes must be a positive number of minutes" in one_line_error(capsys)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ 6. lengths fit the model
def test_lengths_past_the_models_positions_are_refused_before_training(tmp_path, capsys):
    argv = tiny_argv(tmp_path / "run", "--max_steps", "1")
    argv[argv.index("--config_overrides") + 1] += ",max_source_positions=64"
    assert train.main(argv) == 1
    assert "--max_source_length 96 exceeds the model's max_source_positions 64" in one_line_error(capsys)
    assert not (tmp_path / "run" / "model.safetensors").exists()
    # the defaults (256) fit every preset's positions (1024)
    _, _, data_args, _, _ = train.parse_arguments(["--output_dir", str(tmp_path / "defaults")])
    from flexformers.configuration import PRESETS, FlexformerConfig

    for preset in PRESETS:
        config = FlexformerConfig.from_preset(preset)
        assert config.max_source_positions >= data_args.max_source_length
        assert config.max_target_positions >= data_args.max_target_length


# ------------------------------------------------------------------------------ 7. one line, not a traceback
def test_a_full_disk_while_saving_is_one_line_naming_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    original = transformers.Trainer._save_rng_state

    def disk_full_at_step_4(self, output_dir):
        if self.state.global_step == 4:
            raise OSError(errno.ENOSPC, "No space left on device", str(output_dir))
        return original(self, output_dir)

    monkeypatch.setattr(transformers.Trainer, "_save_rng_state", disk_full_at_step_4)
    out = tmp_path / "run"
    assert train.main(tiny_argv(out, "--max_steps", "4", *SAVE_EVERY_2)) == 1
    err = one_line_error(capsys)
    assert "disk full while writing" in err and f"the last good checkpoint is {out / 'checkpoint-2'}" in err
    assert checkpoint_problem(out / "checkpoint-2") is None


def test_an_unwritable_output_folder_is_named_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train, "load_corpus", lambda *a, **k: pytest.fail("the corpus was built"))
    (tmp_path / "file").write_text("not a folder")
    assert train.main(tiny_argv(tmp_path / "file" / "run", "--max_steps", "1")) == 1
    assert "/file/run cannot be written: Not a directory" in one_line_error(capsys)

    real_open = open

    def read_only(path, *args, **kwargs):
        if str(path).endswith(LOCK_FILE):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", read_only)
    assert train.main(tiny_argv(tmp_path / "ro", "--max_steps", "1")) == 1
    assert "/ro cannot be written: Read-only file system" in one_line_error(capsys)


def test_resuming_with_another_model_type_or_architecture_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    train.run_from_argv(tiny_argv(out, "--max_steps", "2", *SAVE_EVERY_2))
    iot = tiny_argv(out, "--max_steps", "4", *SAVE_EVERY_2, "--resume_from_checkpoint", "latest")
    iot[iot.index("--model_type") + 1] = "iot"
    assert train.main(iot) == 1
    assert "holds a flexformer model with model_type='flexformer' (this run: 'iot')" in one_line_error(capsys)
    deeper = tiny_argv(out, "--max_steps", "4", *SAVE_EVERY_2, "--resume_from_checkpoint", "latest")
    overrides = deeper.index("--config_overrides") + 1
    deeper[overrides] = deeper[overrides].replace("encoder_layers=1", "encoder_layers=2")
    assert train.main(deeper) == 1
    assert "holds a flexformer model with encoder_layers=1 (this run: 2)" in one_line_error(capsys)


def test_a_tampered_rng_state_is_passed_over_or_refused_without_suggesting_unsafe_loading(tmp_path, capsys):
    out = tmp_path / "run"
    train.run_from_argv(tiny_argv(out, "--max_steps", "4", *SAVE_EVERY_2))
    torch.save({"python": os.getcwd, "cpu": torch.zeros(2)}, out / "checkpoint-4" / "rng_state.pth")
    chosen, skipped = find_latest_complete_checkpoint(out)
    assert chosen == str(out / "checkpoint-2") and skipped[0][0] == "checkpoint-4"
    assert train.main(tiny_argv(out, "--max_steps", "6", *SAVE_EVERY_2,
                                "--resume_from_checkpoint", str(out / "checkpoint-4"))) == 1
    err = one_line_error(capsys)
    assert "rng_state.pth is damaged or holds objects other than RNG states" in err and "weights_only" not in err


def test_a_run_file_is_in_every_checkpoint_and_the_folder(tmp_path):
    out = tmp_path / "run"
    train.run_from_argv(tiny_argv(out, "--max_steps", "2", *SAVE_EVERY_2))
    record = json.loads((out / "checkpoint-2" / RUN_FILE).read_text())
    assert record == {"run_id": run_id_of(out), "save_only_model": False}
    assert load_file(str(out / "model.safetensors"))  # the run itself is whole


# ------------------------------------------------------------------------------ 8. mutation survivors (issue 65)
def test_a_full_disk_message_says_how_to_continue(tmp_path):
    from flexformers.training_scripts.checkpoints import describe_write_error

    message = describe_write_error(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x")), tmp_path)
    assert message.startswith(f"disk full while writing {tmp_path / 'x'}: no checkpoint had been written yet")
    assert message.endswith("free some space and continue with --resume_from_checkpoint latest")
    assert describe_write_error(OSError(errno.EIO, "I/O error"), tmp_path) is None


def test_moving_aside_twice_in_one_second_numbers_the_folders_upwards(tmp_path, monkeypatch):
    from flexformers.training_scripts import checkpoints

    epoch = time.gmtime(0)
    monkeypatch.setattr(checkpoints.time, "gmtime", lambda *args: epoch)  # the same stamp every time
    folders = []
    for index in range(3):
        (tmp_path / f"file{index}").write_text(str(index))
        folders.append(checkpoints.move_aside(tmp_path, [tmp_path / f"file{index}"]).name)
    stamp = f"{REPLACED_PREFIX}19700101-000000"
    assert folders == [stamp, f"{stamp}-2", f"{stamp}-3"]
    assert [(tmp_path / folder / f"file{index}").read_text() for index, folder in enumerate(folders)] == ["0", "1", "2"]


def test_resuming_with_other_output_switches_is_not_another_architecture(tmp_path):
    """Fields that only say what a forward returns are not the model: a checkpoint saved with them set resumes."""
    from flexformers.configuration.configuration_flexformer import FlexformerConfig
    from flexformers.training_scripts.checkpoints import resumed_config_problem
    from tests.conftest import tiny_config_kwargs

    saved = FlexformerConfig(**tiny_config_kwargs(), output_hidden_states=True, output_attentions=True,
                             use_cache=False, return_dict=False)
    saved.save_pretrained(tmp_path)
    assert resumed_config_problem(tmp_path, FlexformerConfig(**tiny_config_kwargs())) is None


def test_a_checkpoint_written_by_another_transformers_version_resumes(tmp_path):
    """The Transformers version that wrote config.json is not the model: a checkpoint saved by an older (or newer)
    release resumes."""
    import json

    from flexformers.configuration.configuration_flexformer import FlexformerConfig
    from flexformers.training_scripts.checkpoints import resumed_config_problem
    from tests.conftest import tiny_config_kwargs

    FlexformerConfig(**tiny_config_kwargs()).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["transformers_version"] = "4.0.0"
    saved["_name_or_path"] = "/elsewhere/runs/old"  # Transformers 4 wrote where the model was loaded from
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert resumed_config_problem(tmp_path, FlexformerConfig(**tiny_config_kwargs())) is None


def test_a_resumed_architecture_names_at_most_four_fields_and_counts_the_rest(tmp_path):
    from flexformers.configuration.configuration_flexformer import FlexformerConfig
    from flexformers.training_scripts.checkpoints import resumed_config_problem
    from tests.conftest import tiny_config_kwargs

    FlexformerConfig(**tiny_config_kwargs()).save_pretrained(tmp_path)
    base = tiny_config_kwargs()
    two = resumed_config_problem(tmp_path, FlexformerConfig(**{**base, "encoder_layers": 3, "decoder_layers": 3}))
    assert "decoder_layers=" in two and "encoder_layers=" in two and "more fields" not in two
    six = {"encoder_layers": 3, "decoder_layers": 3, "dropout": 0.3, "attention_dropout": 0.3,
           "activation_dropout": 0.3, "label_smoothing": 0.3}
    message = resumed_config_problem(tmp_path, FlexformerConfig(**{**base, **six}))
    assert " and 2 more fields: resume with" in message
    assert sum(f"{name}=" in message for name in six) == 4


# Round 2 mutation survivors (issue 65)
def reshard(checkpoint, max_shard_size="40KB") -> list[str]:
    """Rewrite ``checkpoint``'s ``model.safetensors`` as shards and an index, as ``save_pretrained`` writes a model
    larger than its ``max_shard_size``: the shard file names, sorted."""
    from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration

    staging = checkpoint.parent / f"{checkpoint.name}-shards"
    FlexformerForConditionalGeneration.from_pretrained(checkpoint).save_pretrained(staging,
                                                                                   max_shard_size=max_shard_size)
    (checkpoint / "model.safetensors").unlink()
    shards = sorted(path.name for path in staging.glob("model-*.safetensors"))
    for name in [*shards, "model.safetensors.index.json"]:
        shutil.move(staging / name, checkpoint / name)
    shutil.rmtree(staging)
    return shards


def test_a_sharded_checkpoint_is_checked_shard_by_shard_and_resumes_exactly(tmp_path, caplog):
    from flexformers.training_scripts.checkpoints import resolve_resume_checkpoint, weights_problem

    from .test_reliability import assert_same_weights

    straight = tmp_path / "straight"
    train.run_from_argv(tiny_argv(straight, "--max_steps", "6", *SAVE_EVERY_2))
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    shutil.rmtree(out / "checkpoint-6")
    latest = out / "checkpoint-4"
    shards = reshard(latest)
    assert len(shards) >= 2
    assert weights_problem(latest) is None and checkpoint_problem(latest) is None
    assert find_latest_complete_checkpoint(out) == (str(latest), [])

    last = latest / shards[-1]
    whole = last.read_bytes()
    last.write_bytes(whole[:-10])  # a shard cut short (a full disk, a killed copy)
    assert weights_problem(latest).startswith(f"{last} is truncated or has trailing bytes")
    chosen, skipped = find_latest_complete_checkpoint(out)
    assert chosen == str(out / "checkpoint-2")
    assert skipped == [("checkpoint-4", f"{shards[-1]} is truncated or has trailing bytes: its header describes "
                                        f"{len(whole)} bytes, the file has {len(whole) - 10}")]

    last.unlink()
    assert weights_problem(latest) == f"weights file {last} is missing"
    with pytest.raises(ValueError, match=rf"--resume_from_checkpoint {latest}: not a complete checkpoint \(weights "
                                         rf"file {shards[-1]} is missing\)"):
        resolve_resume_checkpoint(str(latest), str(out))
    with caplog.at_level(logging.WARNING):
        assert resolve_resume_checkpoint("latest", str(out)) == str(out / "checkpoint-2")
    assert f"passed over: checkpoint-4 (weights file {shards[-1]} is missing)" in caplog.text

    last.write_bytes(whole)  # whole again: the run continues from the sharded checkpoint-4 as from the plain one
    train.run_from_argv(tiny_argv(out, "--max_steps", "6", *SAVE_EVERY_2, "--resume_from_checkpoint", "latest"))
    assert_same_weights(straight, out)


# ---- issue 65, round 3: the held-out sample's (seed 2) survivors ----


def test_a_damaged_single_weights_file_is_named_even_beside_other_weight_files(tmp_path):
    """A folder whose `model.safetensors` is cut short is refused by that file's own check, even though the folder
    also holds another weights file that alone would make it look loadable."""
    from safetensors.torch import save_file

    from flexformers.training_scripts.checkpoints import weights_problem

    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    save_file({"weight": torch.ones(64, 64)}, folder / "model.safetensors", metadata={"format": "pt"})
    torch.save({"weight": torch.ones(2)}, folder / "pytorch_model.bin")
    assert weights_problem(folder) is None
    whole = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    problem = weights_problem(folder)
    assert problem is not None and problem.startswith(f"{folder / 'model.safetensors'} is truncated")


def test_a_weights_file_without_tensors_is_judged_by_its_header_alone(tmp_path):
    """A valid safetensors file that holds no tensor (only its header) is complete, not an error; with a byte more
    it has trailing bytes."""
    from safetensors.torch import save_file

    from flexformers.training_scripts.checkpoints import safetensors_problem

    path = tmp_path / "empty.safetensors"
    save_file({}, path, metadata={"format": "pt"})
    assert safetensors_problem(path) is None
    path.write_bytes(path.read_bytes() + b"\0")
    assert safetensors_problem(path).startswith(f"{path} is truncated or has trailing bytes")


# Round 8 mutation survivors (issue 65, seed 6)
def test_a_staging_folder_is_never_resumed_even_when_its_files_are_all_there(tmp_path):
    """A save killed after writing every file but before renaming `_tmp-checkpoint-N` to `checkpoint-N` leaves a
    staging folder that looks complete: `latest` still resumes the last renamed checkpoint and names the staging one
    as interrupted (the rename is what marks a checkpoint finished)."""
    out = tmp_path / "run"
    train.run_from_argv(tiny_argv(out, "--max_steps", "4", *SAVE_EVERY_2))
    shutil.copytree(out / "checkpoint-4", out / "_tmp-checkpoint-6")
    chosen, skipped = find_latest_complete_checkpoint(out)
    assert chosen == str(out / "checkpoint-4")
    assert skipped == [("_tmp-checkpoint-6", "interrupted while being written")]
