"""Faults a careful user runs into (issue 21): a crash while a checkpoint is written, commands that train nothing,
NaN runs, malformed data files, odd files in a code tree, bad decoding input, damaged checkpoints, console-script
``--help``. Each test reproduces the probe that failed before the fix."""

import json
import logging
import math
import os
import re
import shlex
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import TrainerCallback

from flexformers.training_scripts import decode, train
from flexformers.training_scripts.checkpoints import checkpoint_problem, find_latest_complete_checkpoint
from flexformers.training_scripts.model_registry import available_model_types, get_method_spec
from flexformers.training_scripts.nonfinite import NonFiniteTrainingError

from .test_training import SOURCES, TINY, tiny_argv

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _offline_private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("FLEXFORMERS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def assert_same_weights(first: Path, second: Path):
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=name)


def with_model_type(argv: list[str], model_type: str) -> list[str]:
    argv = list(argv)
    argv[argv.index("--model_type") + 1] = model_type
    return argv


# ------------------------------------------------------------------------------ 1. crash-safe checkpoints, resume
def test_a_crash_while_saving_leaves_latest_resumable_and_the_result_exact(tmp_path, monkeypatch, caplog):
    """The save of checkpoint-8 dies midway (a full disk, simulated deterministically): no checkpoint-8 appears,
    ``latest`` resumes from checkpoint-4 naming what it passed over, and the final weights equal an uninterrupted
    run's. A half-written checkpoint-8 left by another writer is passed over too, and replaced by the real one."""
    common = ("--max_steps", "9", "--save_strategy", "steps", "--save_steps", "4", "--save_total_limit", "5")
    train.run_from_argv(tiny_argv(tmp_path / "straight", *common))

    original = transformers.Trainer._save_rng_state

    def disk_full_at_step_8(self, output_dir):
        if self.state.global_step == 8:
            raise OSError(28, "No space left on device (simulated)")
        return original(self, output_dir)

    monkeypatch.setattr(transformers.Trainer, "_save_rng_state", disk_full_at_step_8)
    crashed = tmp_path / "crashed"
    with pytest.raises(OSError, match="No space left"):
        train.run_from_argv(tiny_argv(crashed, *common))
    monkeypatch.setattr(transformers.Trainer, "_save_rng_state", original)
    assert not (crashed / "checkpoint-8").exists() and (crashed / "_tmp-checkpoint-8").is_dir()
    assert checkpoint_problem(crashed / "checkpoint-4") is None
    # What a non-atomic writer leaves when killed mid-save: weights, no trainer_state.json.
    legacy = crashed / "checkpoint-12"
    legacy.mkdir()
    (legacy / "model.safetensors").write_bytes(b"\0" * 64)

    chosen, skipped = find_latest_complete_checkpoint(crashed)
    assert chosen == str(crashed / "checkpoint-4")
    assert [name for name, _ in skipped] == ["checkpoint-12", "_tmp-checkpoint-8"]

    caplog.set_level(logging.INFO, logger="flexformers.train")
    train.run_from_argv(tiny_argv(crashed, *common, "--resume_from_checkpoint", "latest"))
    lines = [r.getMessage() for r in caplog.records if "Resuming from" in r.getMessage()]
    assert len(lines) == 1
    assert "checkpoint-4" in lines[0] and "checkpoint-12 (no trainer_state.json)" in lines[0]
    assert "_tmp-checkpoint-8 (interrupted while being written)" in lines[0]
    assert_same_weights(tmp_path / "straight", crashed)
    assert checkpoint_problem(crashed / "checkpoint-8") is None and not (crashed / "_tmp-checkpoint-8").exists()
    assert (crashed / "checkpoint-8" / "flexformers_data_args.json").is_file()


def test_a_hub_push_of_a_checkpoint_reads_the_finished_directory(tmp_path, monkeypatch):
    """With --push_to_hub, Trainer uploads each checkpoint in the background: the upload must get the final
    checkpoint-N, not the staging directory that is renamed while it runs."""
    pushed, out = [], tmp_path / "push"
    monkeypatch.setattr(transformers.Trainer, "_push_from_checkpoint",
                        lambda self, folder: pushed.append((str(Path(folder).relative_to(out)), checkpoint_problem(folder))))

    class PushDuringTraining(TrainerCallback):  # no Hub repository is created: only the checkpoint pushes run
        def on_train_begin(self, args, state, control, **kwargs):
            args.push_to_hub = True

        def on_train_end(self, args, state, control, **kwargs):
            args.push_to_hub = False

    parsed = train.parse_arguments(tiny_argv(out, "--max_steps", "4", "--save_strategy", "steps",
                                             "--save_steps", "2"))
    train.run(*parsed, extra_callbacks=[PushDuringTraining()])
    assert pushed == [("checkpoint-2", None), ("checkpoint-4", None)]


def test_resume_refuses_incomplete_or_damaged_checkpoints_by_path(tmp_path):
    partial = tmp_path / "out" / "checkpoint-3"
    partial.mkdir(parents=True)
    (partial / "trainer_state.json").write_text("{}")
    (partial / "model.safetensors").write_bytes(b"\0" * 100)
    with pytest.raises(ValueError, match=r"checkpoint-3: not a complete checkpoint \(model.safetensors is corrupt or truncated"):
        train.find_resume_checkpoint(type("A", (), {"resume_from_checkpoint": str(partial), "output_dir": str(tmp_path / "out")}))
    with pytest.raises(ValueError, match=r"no complete checkpoint-\* directory .* \(only incomplete ones: checkpoint-3"):
        train.find_resume_checkpoint(type("A", (), {"resume_from_checkpoint": "latest", "output_dir": str(tmp_path / "out")}))


class Killed(Exception):
    """Stands in for SIGKILL: the run ends at once, with no final save."""


class KillAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise Killed(f"killed after step {self.step}")


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["iot", "mat", "indigo", "depth_adaptive"])
def test_methods_resume_exactly_after_being_killed_between_checkpoints(tmp_path, model_type):
    """Killed at step 6 (checkpoints at 4 and 8): resuming ``latest`` repeats steps 5-9 exactly, including each
    method's randomness (drop-branch, insertion orders, dropout) and its extra state."""
    common = ("--max_steps", "9", "--save_strategy", "steps", "--save_steps", "4", "--logging_steps", "1")
    train.run_from_argv(with_model_type(tiny_argv(tmp_path / "straight", *common), model_type))
    parsed = train.parse_arguments(with_model_type(tiny_argv(tmp_path / "killed", *common), model_type))
    with pytest.raises(Killed):
        train.run(*parsed, extra_callbacks=[KillAt(6)])
    assert not (tmp_path / "killed" / "model.safetensors").exists()
    train.run_from_argv(with_model_type(tiny_argv(tmp_path / "killed", *common, "--resume_from_checkpoint", "latest"), model_type))
    assert_same_weights(tmp_path / "straight", tmp_path / "killed")
    history = lambda run: [e["loss"] for e in json.loads((tmp_path / run / "trainer_state.json").read_text())["log_history"] if "loss" in e]  # noqa: E731
    assert history("killed")[-5:] == pytest.approx(history("straight")[-5:], abs=1e-5)


# ------------------------------------------------------------------------------ 2. a training command trains
SHELL_BLOCK_LANGUAGES = ("", "bash", "sh", "shell", "console")


def documented_train_commands() -> list[tuple[str, list[str]]]:
    """Every ``flexformers-train`` command in the fenced shell code blocks (```bash, ```sh, ```shell or unlabelled)
    of README.md and docs/*.md, in document order, as (file name, argv without the program); ``...`` placeholders
    are dropped. Blocks of printed output (```text) and of Python are not shell and are skipped."""
    commands = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        in_block, in_shell, pending = False, False, ""
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.lstrip().startswith("```"):
                in_block, pending = not in_block, ""
                in_shell = in_block and line.strip()[3:].strip() in SHELL_BLOCK_LANGUAGES
                continue
            if not in_shell:
                continue
            pending += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line
            if line.rstrip().endswith("\\"):
                continue
            words = shlex.split(pending, comments=True)
            pending = ""
            if words and words[0] == "flexformers-train":
                commands.append((path.name, [word for word in words[1:] if word != "..."]))
    return commands


SMOKE_ARCHITECTURE = TINY.replace("decoder_layers=1", "decoder_layers=2")  # Depth-Adaptive's halting needs 2 exits


def smoke_form(argv: list[str], locale_dir: Path) -> list[str]:
    """The command at toy size: a tiny architecture merged into its config overrides, a few training pairs, two
    updates, the corpus options it names kept (a tiny gettext catalog stands in for the system's)."""
    argv = list(argv)
    if "--config_overrides" in argv:
        index = argv.index("--config_overrides") + 1
        argv[index] = f"{argv[index]},{SMOKE_ARCHITECTURE}"
    else:
        argv += ["--config_overrides", SMOKE_ARCHITECTURE]
    task = argv[argv.index("--task") + 1] if "--task" in argv else "codegen"
    if task == "translation":
        argv += ["--locale_dir", str(locale_dir)]
    elif task == "files":  # the user's files the command names, made here (in the test's folder)
        pairs = [("Open the file", "Datei öffnen"), ("Close the window", "Fenster schließen"),
                 ("Save the page", "Seite speichern"), ("Delete the folder", "Ordner löschen")] * 6
        for option in ("--train_file", "--validation_file", "--test_file"):
            if option in argv and not Path(argv[argv.index(option) + 1]).exists():
                Path(argv[argv.index(option) + 1]).write_text(
                    "source\ttarget\n" + "".join(f"{source}\t{target}\n" for source, target in pairs), encoding="utf-8")
    elif "--python_source_dirs" not in argv:
        argv += ["--python_source_dirs", *SOURCES]
    if "--tokenizer_name_or_path" not in argv and "--model_name_or_path" not in argv:
        argv += ["--vocab_size", "300", "--bpe_min_frequency", "1"]
    return argv + [
        "--max_steps", "2", "--max_train_samples", "16", "--max_eval_samples", "2", "--max_predict_samples", "2",
        "--max_source_length", "48", "--max_target_length", "48", "--generation_max_length", "6",
        "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "2", "--warmup_steps", "1",
        "--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "true", "--num_train_epochs", "1",
    ]


def test_the_documentation_lists_its_training_commands():
    commands = documented_train_commands()
    assert {name for name, _ in commands} >= {"README.md", "depth_adaptive.md", "hub.md", "iot.md", "mat.md"}
    assert all("--do_train" not in argv for _, argv in commands)  # the documented form relies on the default


def test_every_documented_training_command_leaves_a_loadable_model(tmp_path, monkeypatch):
    """No ``--do_*`` flag means train, then evaluate: each documented command, run in a smoke form in document
    order (later ones continue the checkpoints of earlier ones), leaves a trained model that loads."""
    from transformers import AutoModelForSeq2SeqLM

    from .test_data import write_mo

    locale = tmp_path / "locale"
    (locale / "de" / "LC_MESSAGES").mkdir(parents=True)
    nouns = ["file", "window", "folder", "page", "image", "message", "printer", "account"]
    german = ["Datei", "Fenster", "Ordner", "Seite", "Bild", "Nachricht", "Drucker", "Konto"]
    verbs = [("Open the", "öffnen"), ("Close the", "schließen"), ("Save the", "speichern"), ("Delete the", "löschen")]
    messages = {f"{v} {n}": f"{g} {d}" for v, d in verbs for n, g in zip(nouns, german)}
    write_mo(locale / "de" / "LC_MESSAGES" / "app.mo", messages)
    monkeypatch.chdir(tmp_path)
    commands = documented_train_commands()
    for name, argv in commands:
        results = train.run_from_argv(smoke_form(argv, locale))
        output_dir = Path(argv[argv.index("--output_dir") + 1]) if "--output_dir" in argv else Path("runs/flexformers")
        assert results["train"]["train_samples"] > 0 and "eval_loss" in results["eval"], (name, argv)
        model = AutoModelForSeq2SeqLM.from_pretrained(output_dir)
        model_type = argv[argv.index("--model_type") + 1] if "--model_type" in argv else "flexformer"
        assert model.config.model_type == model_type, (name, argv)
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_run_that_would_do_nothing_says_so_and_exits_nonzero(tmp_path, capsys):
    _, _, _, args, _ = train.parse_arguments(["--output_dir", str(tmp_path)])
    assert args.do_train and args.do_eval and not args.do_predict
    _, _, _, args, _ = train.parse_arguments(["--output_dir", str(tmp_path), "--do_train"])
    assert args.do_train
    assert train.main(["--output_dir", str(tmp_path), "--do_train", "false", "--eval_strategy", "no"]) == 1
    assert "nothing to do" in capsys.readouterr().err
    assert train.main(["--output_dir", str(tmp_path), "--do_eval"]) == 1
    assert "untrained" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------------------ 3. NaN configs and NaN runs
def _config_classes():
    from flexformers.configuration import DepthAdaptiveConfig, FlexformerConfig, InDIGOConfig, IOTConfig, MATConfig
    from flexformers.configuration.configuration_mat import MATBertConfig, MATRobertaConfig

    encoder = dict(vocab_size=80, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)
    return [(FlexformerConfig, {}), (IOTConfig, {}), (MATConfig, {}), (InDIGOConfig, {}),
            (DepthAdaptiveConfig, {}), (MATRobertaConfig, encoder), (MATBertConfig, encoder)]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_every_float_field_of_every_config_must_be_finite(value):
    from flexformers.configuration.configuration_flexformer import float_field_names

    checked = 0
    for config_class, base in _config_classes():
        for name in float_field_names(config_class(**base)):
            with pytest.raises(ValueError, match=rf"{config_class.__name__}\.{name}=-?(nan|inf) is invalid: must be a finite"):
                config_class(**base, **{name: value})
            checked += 1
    assert checked >= 40


@pytest.mark.parametrize(
    "config_name, field, value",
    [
        ("IOTConfig", "diversity_loss_coef", -0.1),
        ("IOTConfig", "sharpness_loss_coef", -1.0),
        ("IOTConfig", "gumbel_temperature_decay_rate", -0.5),
        ("IOTConfig", "encoder_gumbel_temperature", 0.0),
        ("IOTConfig", "predictor_dropout", 1.0),
        ("MATConfig", "drop_head_rate", 1.0),
        ("DepthAdaptiveConfig", "oracle_sigma", -1.0),
        ("FlexformerConfig", "label_smoothing", 1.0),
        ("MATRobertaConfig", "layer_norm_eps", 0.0),
        ("MATBertConfig", "hidden_dropout_prob", 1.5),
    ],
)
def test_float_fields_out_of_range_name_the_field(config_name, field, value):
    config_class, base = next((c, b) for c, b in _config_classes() if c.__name__ == config_name)
    with pytest.raises(ValueError, match=rf"{config_name}\.{field}={value!r} is invalid"):
        config_class(**base, **{field: value})


class Poison(TrainerCallback):
    """After update ``step``, fill the parameters whose name contains ``part`` with NaN (a run that diverged)."""

    def __init__(self, step, part=""):
        self.step, self.part = step, part

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    if self.part in name:
                        parameter.fill_(math.nan)


class InfiniteGradients(TrainerCallback):
    """From update ``step`` on, one weight's gradient overflows while the loss stays finite."""

    def __init__(self, step):
        self.step = step

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.step:
            parameter = next(p for n, p in model.named_parameters() if "fc1.weight" in n)
            parameter.register_hook(lambda grad: grad * math.inf)


def test_a_nan_loss_stops_training_naming_the_step_and_keeping_the_last_good_checkpoint(tmp_path, capsys):
    out = tmp_path / "nan"
    common = ("--max_steps", "6", "--save_strategy", "steps", "--save_steps", "2")
    parsed = train.parse_arguments(tiny_argv(out, *common))
    with pytest.raises(NonFiniteTrainingError, match=r"step 4: the training loss is not finite \(loss=nan\).*"
                       r"last good checkpoint is .*checkpoint-2"):
        train.run(*parsed, extra_callbacks=[Poison(3)])
    assert not (out / "model.safetensors").exists() and not (out / "checkpoint-4").exists()
    assert all(torch.isfinite(t).all() for t in load_file(str(out / "checkpoint-2" / "model.safetensors")).values())

    parsed = train.parse_arguments(tiny_argv(tmp_path / "inf", *common))
    with pytest.raises(NonFiniteTrainingError, match=r"step 3: the gradient norm is (inf|nan)"):
        train.run(*parsed, extra_callbacks=[InfiniteGradients(3)])


def test_the_non_finite_loss_term_is_named():
    """Depth-Adaptive's halting head diverged: the exit loss (Eq. 6) is NaN while the decoding loss is not."""
    from flexformers.configuration import DepthAdaptiveConfig
    from flexformers.modeling.modeling_depth_adaptive import DepthAdaptiveForConditionalGeneration
    from flexformers.training_scripts.nonfinite import FiniteLossMixin

    from .conftest import tiny_config_kwargs

    torch.manual_seed(0)
    config = DepthAdaptiveConfig(**tiny_config_kwargs(), halting_mechanism="token_geometric", exit_loss_alpha=0.1)
    model = DepthAdaptiveForConditionalGeneration(config).train()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "halting" in name:
                parameter.fill_(math.nan)

    class Base:
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            return outputs.loss, outputs

    trainer = type("T", (FiniteLossMixin, Base), {})()
    trainer.state = type("S", (), {"global_step": 41})()
    trainer.args = type("A", (), {"output_dir": "/nonexistent"})()
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 2]]), "labels": torch.tensor([[8, 9, 2]])}
    with pytest.raises(NonFiniteTrainingError, match=r"step 42: .*decoding_loss=\d.*exit_loss=nan.*non-finite term: exit_loss"):
        trainer.compute_loss(model, inputs)


def test_flexformers_train_reports_a_diverged_run_without_a_traceback(tmp_path, capsys, monkeypatch):
    real_run = train.run
    monkeypatch.setattr(train, "run", lambda *parsed: real_run(*parsed, extra_callbacks=[Poison(1)]))
    assert train.main(tiny_argv(tmp_path / "m", "--max_steps", "3")) == 1
    error = capsys.readouterr().err
    assert "\nflexformers-train: error: step 2: the training loss is not finite" in error and "Traceback" not in error


# ------------------------------------------------------------------------------ 6. --config_overrides
def _build(model_type: str, overrides: str):
    from flexformers.training_scripts.arguments import ModelArguments

    spec = get_method_spec(model_type)
    method_args = spec.arguments_class() if spec.arguments_class is not None else None
    tokenizer = list(range(64))  # build_config only needs the vocabulary size
    model_args = ModelArguments(model_type=model_type, preset="transformer_codegen_small", config_overrides=overrides)
    return train.build_config(spec, model_args, tokenizer, tokenizer, method_args)


@pytest.mark.parametrize("model_type", ["flexformer", "mat", "iot"])
def test_a_misspelt_override_is_refused_with_the_closest_field(model_type):
    with pytest.raises(ValueError, match=r"'droput' is not a field of \w+Config; did you mean 'dropout'\?"):
        _build(model_type, "droput=0.3")
    with pytest.raises(ValueError, match=r"'colour' is not a field of \w+Config \(see"):
        _build(model_type, "colour=1")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ("dropout=abc", r"FlexformerConfig\.dropout='abc' is invalid: must be of type float \| int, got str"),
        ("encoder_layers=two", r"FlexformerConfig\.encoder_layers='two' is invalid: must be of type int"),
        ("encoder_ffn_embed_dim=64.5", r"FlexformerConfig\.encoder_ffn_embed_dim=64.5 is invalid: must be of type int"),
        ("share_all_embeddings=1", r"FlexformerConfig\.share_all_embeddings=1 is invalid: must be of type bool"),
    ],
)
def test_an_override_of_the_wrong_type_names_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        _build("flexformer", overrides)


def test_list_overrides_keep_their_commas():
    from flexformers.training_scripts.arguments import parse_config_overrides

    assert parse_config_overrides("decoder_orders=[1,2],dropout=0.2,activation_function='gelu'") == {
        "decoder_orders": [1, 2], "dropout": 0.2, "activation_function": "gelu",
    }
    config = _build("iot", "decoder_orders=[1,2],encoder_orders=[1, 2]")
    assert config.decoder_orders == [1, 2] and config.encoder_orders == [1, 2]
    with pytest.raises(ValueError, match=r"IOTConfig\.decoder_orders must be a list of order codes, got '12'"):
        _build("iot", "decoder_orders='12'")


# ------------------------------------------------------------------------------ 7. --help of every console script
def console_scripts() -> dict[str, str]:
    """{script name: "module:function"} from setup.cfg's console_scripts."""
    import configparser

    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    entries = parser["options.entry_points"]["console_scripts"]
    return dict(tuple(part.strip() for part in line.split("=", 1)) for line in entries.strip().splitlines())


def _help_of(target: str, argv: list[str], capsys) -> str:
    import importlib

    module, function = target.split(":")
    with pytest.raises(SystemExit) as exited:
        getattr(importlib.import_module(module), function)(argv)
    assert exited.value.code == 0, (target, argv)
    return capsys.readouterr().out


@pytest.mark.parametrize("script", sorted(console_scripts()))
def test_help_of_every_console_script_works(script, capsys):
    target = console_scripts()[script]
    if script != "flexformers-train":
        assert "usage:" in _help_of(target, ["--help"], capsys)
        return
    for model_type in available_model_types():
        text = _help_of(target, ["--model_type", model_type, "--help"], capsys)
        spec = get_method_spec(model_type)
        own = [f.name for f in __import__("dataclasses").fields(spec.arguments_class)] if spec.arguments_class else []
        for flag in own + ["retain_cpu_memory", "config_overrides", "do_train"]:
            assert f"--{flag}" in text, (model_type, flag)


# ------------------------------------------------------------------------------ 4, 5. TSV / CSV records
@pytest.mark.parametrize(
    "name, content, columns",
    [
        ("extra.tsv", "source\ttarget\nopen the file\tDatei öffnen\nsave the file\tenregistrer\tle fichier\n", ("source", "target")),
        ("extra_plain.tsv", "open the file\tDatei öffnen\nsave the file\tenregistrer\tle fichier\n", ("0", "1")),
        ("extra.csv", "source,target\nopen the file,Datei öffnen\nsave the file,enregistrer,le fichier\n", ("source", "target")),
    ],
)
def test_extra_fields_are_malformed_not_dropped(tmp_path, name, content, columns, caplog):
    from flexformers.training_scripts.data import SkipReport, read_parallel_file

    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{name}, line \d: too many fields: expected 2 \w+ fields .*, found 3"):
        read_parallel_file(path, *columns)
    report = SkipReport()
    rows = read_parallel_file(path, *columns, skip_bad_lines=True, report=report)
    assert [row["target"] for row in rows] == ["Datei öffnen"] and report.counts == {"too many fields": 1}


def test_csv_records_may_span_lines(tmp_path):
    from flexformers.training_scripts.data import SkipReport, read_parallel_file

    path = tmp_path / "multi.csv"
    path.write_text(
        'source,target\n"Print ""hello"",\nthen exit.","print(\'hello\')\nexit()"\nplain,einfach\n'
        '"never closed,x\nlast,letzte\n',
        encoding="utf-8",
    )
    with pytest.raises(ValueError, match=r"multi.csv, line 6: malformed CSV \(unexpected end of data\)"):
        read_parallel_file(path)
    report = SkipReport()
    rows = read_parallel_file(path, skip_bad_lines=True, report=report)
    assert [(r["source"], r["target"], r["origin"]) for r in rows] == [
        ('Print "hello",\nthen exit.', "print('hello')\nexit()", "multi.csv:2"),
        ("plain", "einfach", "multi.csv:5"),
    ]
    assert report.counts == {"malformed CSV (unexpected end of data)": 1}


# ------------------------------------------------------------------------------ 8. odd files in a code tree
@pytest.mark.timeout(120)
def test_dangling_symlinks_and_fifos_in_a_code_tree_are_skipped_and_counted(tmp_path, caplog):
    from flexformers.training_scripts.data import build_codegen_corpus, list_python_files

    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "good.py").write_text("def add(a, b):\n    '''Add two numbers.'''\n    return a + b\n")
    (tree / "link.py").symlink_to(tree / "good.py")
    (tree / "dangling.py").symlink_to(tree / "missing.py")
    os.mkfifo(tree / "fifo.py")  # reading it would block forever
    caplog.set_level(logging.WARNING)
    corpus = build_codegen_corpus([tree], cache_dir=tmp_path / "cache")
    assert sum(len(split) for split in corpus.values()) == 1  # good.py and its link: one deduplicated pair
    assert "dangling symlink" in caplog.text and "not a regular file" in caplog.text
    with pytest.raises(ValueError, match=r"fifo.py: not a regular file"):
        list_python_files([tree / "fifo.py"])
    with pytest.raises(ValueError, match=r"dangling.py: dangling symlink"):
        list_python_files([tree / "dangling.py"])


# ------------------------------------------------------------------------------ 9-11. flexformers-decode input
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """An untrained tiny baseline with a real BPE tokenizer, saved the way flexformers-train saves one."""
    from flexformers.configuration import FlexformerConfig
    from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration
    from flexformers.training_scripts.tokenizer import build_tokenizers, save_tokenizers

    from .conftest import tiny_config_kwargs

    directory = tmp_path_factory.mktemp("decode") / "model"
    texts = [f"open the file number {i} and read line {i * 7}" for i in range(60)]
    tokenizer, _ = build_tokenizers(texts, texts, vocab_size=300, min_frequency=1)
    torch.manual_seed(0)
    config = FlexformerConfig(**tiny_config_kwargs(vocab_size=len(tokenizer), max_source_positions=32))
    FlexformerForConditionalGeneration(config).save_pretrained(directory)
    save_tokenizers(directory, tokenizer, tokenizer)
    return directory


class FakeStdin:
    def __init__(self, data: bytes):
        import io

        self.buffer = io.BytesIO(data)


def test_stdin_decodes_the_good_lines_and_names_the_bad_one(model_dir, monkeypatch, capsys, caplog):
    monkeypatch.setattr("sys.stdin", FakeStdin(b"open the file\nB\xe4r line\n\nread line 7\n"))
    results = decode.run_from_argv(["--model_name_or_path", str(model_dir), "--stdin", "--num_beams", "1",
                                    "--max_new_tokens", "3"])
    assert len(results["hypotheses"]) == 2 and results["skipped_lines"] == [2]
    printed = capsys.readouterr().out
    assert "SOURCE: open the file" in printed and "SOURCE: read line 7" in printed
    assert "standard input, line 2: not valid UTF-8 (byte 1); skipped" in caplog.text


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:500]), r"model.safetensors is (corrupt or truncated|truncated)"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\0" * (d / "model.safetensors").stat().st_size), r"model.safetensors is corrupt or truncated"),
        (lambda d: (d / "model.safetensors").unlink(), r"has no model weights"),
        (lambda d: (d / "config.json").write_text('{"model_type": "flexformer",'), r"config.json is not valid JSON \(line 1"),
        (lambda d: (d / "config.json").write_text('{"d_model": 32}'), r"config.json names no model_type"),
        (lambda d: (d / "config.json").write_text('{"model_type": "bert"}'), r"config.json: model_type 'bert' is not a flexformers model type"),
        (lambda d: (d / "tokenizer.json").write_text("{"), r"the tokenizer cannot be loaded"),
    ],
)
def test_a_damaged_checkpoint_is_named(model_dir, tmp_path, damage, message, capsys):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(model_dir, damaged)
    damage(damaged)
    with pytest.raises(ValueError, match=message):
        decode.load_model(damaged)
    assert decode.main(["--model_name_or_path", str(damaged), "--text", "open the file"]) == 1
    error = capsys.readouterr().err
    assert re.search(r"(^|\n)flexformers-decode: error: .*" + message, error) and "Traceback" not in error


@pytest.mark.parametrize(
    "options, message",
    [
        (["--max_new_tokens", "0"], r"--max_new_tokens must be at least 1, got 0"),
        (["--length_penalty", "nan"], r"--length_penalty must be a finite number, got nan"),
        (["--num_beams", "0"], r"--num_beams must be at least 1"),
        (["--text", "open the file", ""], r"--text: input 2 is empty"),
    ],
)
def test_bad_decoding_options_are_refused(model_dir, options, message):
    argv = ["--model_name_or_path", str(model_dir)] + (["--text", "open"] if "--text" not in options else []) + options
    with pytest.raises(ValueError, match=message):
        decode.parse_arguments(argv)


def test_a_too_long_input_is_cut_with_a_warning(model_dir, caplog):
    results = decode.run_from_argv(["--model_name_or_path", str(model_dir), "--num_beams", "1", "--max_new_tokens", "2",
                                    "--text", "open the file", " ".join(["read line 7"] * 40)])
    assert len(results["hypotheses"]) == 2
    warnings = [r.getMessage() for r in caplog.records if "max_source_positions" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("input 2 has ") and "at most 32" in warnings[0]


# ------------------------------------------------------------------------------ 13. --fp16 on the CPU
def test_fp16_on_the_cpu_is_refused_not_ignored(tmp_path):
    with pytest.raises(ValueError, match=r"--fp16 needs a GPU.*--bf16 true"):
        train.parse_arguments(tiny_argv(tmp_path, "--fp16", "true"))
    train.parse_arguments(tiny_argv(tmp_path, "--bf16", "true"))  # the CPU's mixed precision stays available


# ------------------------------------------------------------------------------ 12. generate() arguments
def _tiny_models():
    from flexformers.configuration import DepthAdaptiveConfig, FlexformerConfig, InDIGOConfig, IOTConfig, MATConfig
    from flexformers.modeling.modeling_depth_adaptive import DepthAdaptiveForConditionalGeneration
    from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration
    from flexformers.modeling.modeling_indigo import InDIGOForConditionalGeneration
    from flexformers.modeling.modeling_iot import IOTForConditionalGeneration
    from flexformers.modeling.modeling_mat import MATForConditionalGeneration

    from .conftest import tiny_config_kwargs

    pairs = [(FlexformerConfig, FlexformerForConditionalGeneration), (IOTConfig, IOTForConditionalGeneration),
             (MATConfig, MATForConditionalGeneration), (InDIGOConfig, InDIGOForConditionalGeneration),
             (DepthAdaptiveConfig, DepthAdaptiveForConditionalGeneration)]
    torch.manual_seed(0)
    return [model_class(config_class(**tiny_config_kwargs())).eval() for config_class, model_class in pairs]


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((torch.zeros(0, 5, dtype=torch.long),), {}, r"input_ids is an empty batch \(shape \(0, 5\)\)"),
        ((), {"input_ids": torch.zeros(0, 5, dtype=torch.long)}, r"input_ids is an empty batch"),
        ((torch.zeros(2, 0, dtype=torch.long),), {}, r"input_ids has sources of length 0"),
        ((torch.tensor([[5, 6, 2]]),), {"num_beams": 0}, r"num_beams must be an integer >= 1, got 0"),
        ((torch.tensor([[5, 6, 2]]),), {"num_return_sequences": 0}, r"num_return_sequences must be an integer >= 1"),
        ((torch.tensor([[5, 600, 2]]),), {}, r"input_ids holds the id 600, outside the source vocabulary \[0, 60\)"),
        ((torch.tensor([[5, -3, 2]]),), {}, r"input_ids holds the id -3"),
    ],
)
def test_generate_names_the_argument_it_cannot_decode(args, kwargs, message):
    for model in _tiny_models():
        with pytest.raises(ValueError, match=rf"generate\(\): {message}"):
            model.generate(*args, max_new_tokens=2, **kwargs)


def test_generate_still_decodes_valid_input():
    for model in _tiny_models():
        output = model.generate(torch.tensor([[5, 6, 7, 2], [8, 9, 2, 1]]), num_beams=2, max_new_tokens=3)
        assert output.shape[0] == 2


# ------------------------------------------------------------------------------ 14. from_pretrained across types
def test_from_pretrained_refuses_a_checkpoint_of_another_model_type(tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    from flexformers.configuration import FlexformerConfig
    from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration
    from flexformers.modeling.modeling_iot import IOTForConditionalGeneration
    from flexformers.modeling.modeling_mat import MATForConditionalGeneration

    from .conftest import tiny_config_kwargs

    baseline = tmp_path / "baseline"
    FlexformerForConditionalGeneration(FlexformerConfig(**tiny_config_kwargs())).save_pretrained(baseline)
    with pytest.raises(ValueError, match=r"MATForConditionalGeneration.from_pretrained\(.*\): the checkpoint is of "
                       r"model type 'flexformer', not 'mat'.*MATForConditionalGeneration.from_baseline\(path\)"):
        MATForConditionalGeneration.from_pretrained(baseline)
    with pytest.raises(ValueError, match=r"model type 'flexformer', not 'iot'.*pass config= to convert"):
        IOTForConditionalGeneration.from_pretrained(baseline)
    assert type(AutoModelForSeq2SeqLM.from_pretrained(baseline)) is FlexformerForConditionalGeneration
    assert MATForConditionalGeneration.from_baseline(baseline).config.model_type == "mat"

    config = json.loads((baseline / "config.json").read_text())
    del config["model_type"]
    (baseline / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json has no 'model_type'"):
        FlexformerForConditionalGeneration.from_pretrained(baseline)
