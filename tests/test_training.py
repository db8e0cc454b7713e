"""Pipeline training/decoding: registry contract, fairseq schedule, loss goes down, exact resume, decode command,
and the README main job in smoke mode."""

import json
import math
import sysconfig
import types
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback, get_scheduler

from flexformers.training_scripts import decode, train
from flexformers.training_scripts.arguments import DataArguments, parse_config_overrides
from flexformers.training_scripts.model_registry import MethodSpec, available_model_types, get_method_spec

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = [
    str(STDLIB / name)
    for name in ("_collections_abc.py", "genericpath.py", "posixpath.py", "textwrap.py", "json/decoder.py", "json/encoder.py", "abc.py", "string.py")
]
TINY = (
    "encoder_embed_dim=32,decoder_embed_dim=32,encoder_ffn_embed_dim=64,decoder_ffn_embed_dim=64,"
    "encoder_layers=1,decoder_layers=1,encoder_attention_heads=2,decoder_attention_heads=2,dropout=0.1"
)


@pytest.fixture(autouse=True)
def _offline_private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("FLEXFORMERS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def tiny_argv(output_dir, *extra):
    return [
        "--model_type", "flexformer", "--preset", "transformer_codegen_small", "--config_overrides", TINY,
        "--python_source_dirs", *SOURCES, "--vocab_size", "300",
        "--max_source_length", "96", "--max_target_length", "96",
        "--output_dir", str(output_dir), "--do_train", "--per_device_train_batch_size", "4",
        "--learning_rate", "3e-3", "--warmup_steps", "2", "--eval_strategy", "no",
        "--report_to", "none", "--disable_tqdm", "true", "--seed", "7", "--use_cpu", "true",
        *extra,
    ]


# ---------------------------------------------------------------------------------------------------- registry
def test_registry_contract():
    assert "flexformer" in available_model_types()
    spec = get_method_spec("flexformer")
    assert spec.model_type == "flexformer" and spec.config_class.model_type == "flexformer"
    with pytest.raises(ValueError, match="Unknown --model_type 'transformer_xl'; available: .*flexformer"):
        get_method_spec("transformer_xl")
    with pytest.raises(ValueError, match="not a valid model type"):
        get_method_spec("../evil")
    with pytest.raises(ValueError, match="arguments_class .* must be a dataclass"):
        MethodSpec("x", object, object, arguments_class=int)
    with pytest.raises(ValueError, match="callbacks .* must be callable"):
        MethodSpec("x", object, object, callbacks=3)
    for count in (-1, 1.5, True):
        with pytest.raises(ValueError, match="decoder_tokens_beyond_target for 'x' must be a count of tokens"):
            MethodSpec("x", object, object, decoder_tokens_beyond_target=count)


def test_registry_rejects_a_module_without_spec(monkeypatch):
    import sys

    from flexformers.training_scripts import model_registry

    module = types.ModuleType("flexformers.training_scripts.methods.fake")
    module.SPEC = "not a spec"
    monkeypatch.setitem(sys.modules, "flexformers.training_scripts.methods.fake", module)
    monkeypatch.setattr(model_registry, "available_model_types", lambda: ["fake", "flexformer"])
    with pytest.raises(ValueError, match="must define SPEC = MethodSpec"):
        get_method_spec("fake")


def test_method_hooks_are_used(tmp_path):
    """A method's arguments class, config hook, model builder, collator and callbacks all reach the Trainer."""
    import dataclasses

    from transformers import DataCollatorForSeq2Seq

    base = get_method_spec("flexformer")
    seen = {}

    @dataclasses.dataclass
    class ExtraArguments:
        my_temperature: float = 1.0

    class Recorder(TrainerCallback):
        def on_train_end(self, args, state, control, model=None, **kwargs):
            seen["steps"] = state.global_step

    def build_model(model_args, method_args, config, tokenizer):
        seen["temperature"] = method_args.my_temperature
        seen["layers"] = config.encoder_layers
        return base.model_class(config)

    def collator(tokenizer, model, method_args):
        seen["collator"] = True
        return DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)

    def update_config(config, method_args):
        config.encoder_layers = 2
        return config

    spec = MethodSpec("flexformer", base.config_class, base.model_class, arguments_class=ExtraArguments,
                      build_model=build_model, data_collator=collator, callbacks=lambda a: [Recorder()],
                      update_config=update_config)
    import flexformers.training_scripts.train as train_module

    original = train_module.get_method_spec
    train_module.get_method_spec = lambda name: spec
    try:
        parsed = train.parse_arguments(tiny_argv(tmp_path / "hooks", "--max_steps", "2", "--my_temperature", "0.5"))
    finally:
        train_module.get_method_spec = original
    train.run(*parsed)
    assert seen == {"temperature": 0.5, "layers": 2, "collator": True, "steps": 2}


def test_config_overrides_parsing_and_label_smoothing_guard():
    assert parse_config_overrides("dropout=0.1, encoder_layers=2,share_all_embeddings=false,activation_function=gelu,x=None") == {
        "dropout": 0.1, "encoder_layers": 2, "share_all_embeddings": False, "activation_function": "gelu", "x": None,
    }
    with pytest.raises(ValueError, match="expected key=value"):
        parse_config_overrides("dropout")
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        train.parse_arguments(["--label_smoothing_factor", "0.1"])
    with pytest.raises(ValueError, match="--task must be one of"):
        DataArguments(task="poetry")


def test_model_name_or_path_without_preset_keeps_the_checkpoints_architecture(tmp_path):
    """Continuing a checkpoint takes its config (dims, layers), with --config_overrides and label smoothing on top;
    a checkpoint of another model type, another vocabulary, or no config at all is a clear error."""
    from flexformers.configuration.configuration_indigo import InDIGOConfig
    from flexformers.modeling.modeling_indigo import InDIGOForConditionalGeneration
    from flexformers.training_scripts.arguments import ModelArguments

    checkpoint = tmp_path / "indigo"
    InDIGOForConditionalGeneration(
        InDIGOConfig.from_preset("transformer_codegen_small", **parse_config_overrides(TINY), vocab_size=64)
    ).save_pretrained(checkpoint)
    tokenizer = list(range(64))  # build_config only needs the vocabulary size
    spec = get_method_spec("indigo")
    method_args = spec.arguments_class() if spec.arguments_class is not None else None
    model_args = ModelArguments(model_type="indigo", model_name_or_path=str(checkpoint),
                                config_overrides="dropout=0.05", label_smoothing=0.2)
    config = train.build_config(spec, model_args, tokenizer, tokenizer, method_args)
    assert (config.decoder_embed_dim, config.decoder_layers, config.vocab_size) == (32, 1, 64)
    assert (config.dropout, config.label_smoothing) == (0.05, 0.2)
    spec.make_model(model_args, method_args, config, tokenizer)  # loads without size mismatches

    with pytest.raises(ValueError, match="holds a 'indigo' model, but --model_type is 'iot'"):
        iot = get_method_spec("iot")
        train.build_config(iot, ModelArguments(model_type="iot", model_name_or_path=str(checkpoint)), tokenizer,
                           tokenizer, iot.arguments_class())
    with pytest.raises(ValueError, match="vocab_size=64 but the tokenizer has 70 tokens"):
        train.build_config(spec, model_args, list(range(70)), list(range(70)), method_args)
    with pytest.raises(ValueError, match="has no config.json"):
        train.build_config(spec, ModelArguments(model_type="indigo", model_name_or_path=str(tmp_path)), tokenizer,
                           tokenizer, method_args)
    with pytest.raises(ValueError, match="dropout"):
        train.build_config(spec, ModelArguments(model_type="indigo", model_name_or_path=str(checkpoint),
                                                config_overrides="dropout=-1"), tokenizer, tokenizer, method_args)


def test_fairseq_defaults_and_inverse_sqrt_matches_fairseq():
    _, model_args, data_args, args, _ = train.parse_arguments(["--output_dir", "unused"])
    assert (args.learning_rate, args.adam_beta1, args.adam_beta2, args.weight_decay, args.warmup_steps) == (5e-4, 0.9, 0.98, 1e-4, 4000)
    assert args.lr_scheduler_type == "inverse_sqrt" and args.train_sampling_strategy == "group_by_length"
    assert model_args.label_smoothing == 0.1 and args.label_smoothing_factor == 0
    assert args.predict_with_generate and args.metric_for_best_model == "bleu" and args.load_best_model_at_end

    lr, warmup = 5e-4, 40
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = get_scheduler("inverse_sqrt", optimizer, num_warmup_steps=warmup)
    for update in range(1, 4 * warmup):
        # fairseq inverse_sqrt (warmup_init_lr=0): the lr of update n is set by step_update(n - 1)
        previous = update - 1
        expected = lr * previous / warmup if previous < warmup else lr * math.sqrt(warmup) / math.sqrt(previous)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12, abs=1e-15)
        optimizer.step()
        scheduler.step()


# ---------------------------------------------------------------------------------------------------- training
def test_a_few_steps_lower_the_loss_and_produce_a_loadable_model(tmp_path):
    out = tmp_path / "run"
    results = train.run_from_argv(tiny_argv(out, "--max_steps", "60", "--logging_steps", "1"))
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    losses = [entry["loss"] for entry in history if "loss" in entry]
    assert len(losses) == 60
    assert sum(losses[-10:]) / 10 < sum(losses[:5]) / 5 - 0.5  # starts near ln(300) = 5.7
    assert results["train"]["train_samples"] > 10
    for name in ("config.json", "model.safetensors", "tokenizer.json", "flexformers_data_args.json"):
        assert (out / name).is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["label_smoothing"] == 0.1 and config["vocab_size"] == 300 and config["model_type"] == "flexformer"

    results = decode.run_from_argv(["--model_name_or_path", str(out), "--split", "validation", "--num_beams", "2",
                                    "--max_new_tokens", "8", "--max_samples", "4", "--num_samples_to_print", "1"])
    stored = json.loads((out / "eval_results.json").read_text())
    assert stored == json.loads(json.dumps(results))
    assert {"task", "dataset", "split", "metrics", "sacrebleu_signature", "num_beams", "length_penalty"} <= set(stored)
    assert set(stored["metrics"]) == {"bleu", "chrf", "ter", "pov"}
    assert stored["task"] == "codegen" and stored["split"] == "validation" and stored["num_beams"] == 2
    assert stored["throughput"]["sentences_per_second"] > 0
    lines = (out / "generations.validation.txt").read_text().splitlines()
    assert len(lines) == 4

    quick = decode.run_from_argv(["--model_name_or_path", str(out), "--text", "Return the value.", "Wrap text.",
                                  "--num_beams", "1", "--max_new_tokens", "5"])
    assert len(quick["hypotheses"]) == 2

    # the split's pairs longer than training's caps (which training drops) are counted, and can be left out
    common = ["--model_name_or_path", str(out), "--split", "validation", "--num_beams", "1", "--max_new_tokens", "4",
              "--num_samples_to_print", "0", "--write_eval_results", "false", "--output_file", str(tmp_path / "g.txt")]
    whole = decode.run_from_argv(common)
    # the within-lengths pairs scored from the whole split's generations, as the zoo does, equal decoding them anew
    rescored = decode.score_within_training_lengths(tmp_path / "g.jsonl", out)
    within = decode.run_from_argv([*common, "--within_training_lengths", "true", "--overwrite_output"])  # g.txt exists
    assert whole["beyond_training_lengths"] > 0 and within["beyond_training_lengths"] == 0
    assert within["num_examples"] == whole["num_examples"] - whole["beyond_training_lengths"]
    for key in ("num_examples", "metrics", "copy_baseline", "gain_over_copy", "sacrebleu_signature"):
        assert rescored[key] == within[key], key
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no generations"):
        decode.score_within_training_lengths(tmp_path / "empty.jsonl", out)


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def test_do_eval_keeps_the_decode_report(tmp_path):
    """Trainer's --do_eval metrics go to validation_results.json, so they never overwrite the eval_results.json that
    flexformers-decode wrote into the same directory (the file the Hub export reads)."""
    out = tmp_path / "run"
    out.mkdir()
    report = {"task": "codegen", "dataset": "x", "split": "test", "metrics": {"bleu": 1.0}}
    (out / "eval_results.json").write_text(json.dumps(report))
    train.run_from_argv(tiny_argv(out, "--max_steps", "2", "--do_eval", "--max_eval_samples", "4"))
    assert json.loads((out / "eval_results.json").read_text()) == report
    assert "eval_loss" in json.loads((out / "validation_results.json").read_text())


def test_saved_generation_configs_leave_out_the_defaults_evaluation_fills_in(tmp_path):
    """Seq2SeqTrainer's evaluation writes every Transformers generation default (``max_length: 20``, ...) into the
    model's generation config; the checkpoint saved right after an evaluation and the final model leave them out, so
    ``generate(max_new_tokens=...)`` on either does not warn that ``max_length`` is set too."""
    out = tmp_path / "run"
    train.run_from_argv(tiny_argv(out, "--max_steps", "2", "--eval_strategy", "steps", "--eval_steps", "2",
                                  "--save_strategy", "steps", "--save_steps", "2", "--max_eval_samples", "2",
                                  "--generation_max_length", "4", "--load_best_model_at_end", "false"))
    history = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
    assert any("eval_bleu" in entry for entry in history)  # the checkpoint was saved after a generating evaluation
    for folder in (out / "checkpoint-2", out):
        saved = json.loads((folder / "generation_config.json").read_text())
        assert not {"max_length", "top_k", "min_length", "temperature", "num_beams"} & saved.keys(), folder
        assert (saved["decoder_start_token_id"], saved["eos_token_id"]) == (2, 2)


def test_resume_continues_exactly(tmp_path):
    common = ("--max_steps", "9", "--save_strategy", "steps", "--save_steps", "4", "--logging_steps", "1")
    train.run_from_argv(tiny_argv(tmp_path / "straight", *common))
    parsed = train.parse_arguments(tiny_argv(tmp_path / "interrupted", *common))
    train.run(*parsed, extra_callbacks=[StopAt(4)])
    assert (tmp_path / "interrupted" / "checkpoint-4").is_dir()
    train.run_from_argv(tiny_argv(tmp_path / "interrupted", *common, "--resume_from_checkpoint", "latest"))

    straight = load_file(str(tmp_path / "straight" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "interrupted" / "model.safetensors"))
    assert straight.keys() == resumed.keys()
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=1e-6, msg=name)
    history = lambda run: [e["loss"] for e in json.loads((tmp_path / run / "trainer_state.json").read_text())["log_history"] if "loss" in e]  # noqa: E731
    assert history("interrupted")[-5:] == pytest.approx(history("straight")[-5:], abs=1e-5)


def test_bad_inputs_fail_early_with_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="--task files needs --train_file"):
        train.parse_arguments(["--task", "files", "--output_dir", str(tmp_path)])
    (tmp_path / "bad.tsv").write_bytes(b"source\ttarget\nB\xe4r\tbear\n")
    with pytest.raises(ValueError, match=r"bad.tsv, line 2: not valid UTF-8"):
        train.run_from_argv(tiny_argv(tmp_path / "o", "--task", "files", "--train_file", str(tmp_path / "bad.tsv"), "--max_steps", "1"))
    with pytest.raises(ValueError, match="preset: unknown architecture"):
        train.run_from_argv(tiny_argv(tmp_path / "p", "--preset", "transformer_huge", "--max_steps", "1"))
    with pytest.raises(ValueError, match="--resume_from_checkpoint latest: no checkpoint"):
        train.run_from_argv(tiny_argv(tmp_path / "q", "--resume_from_checkpoint", "latest"))
    with pytest.raises(ValueError, match="has no config.json"):
        decode.run_from_argv(["--model_name_or_path", str(tmp_path)])


def test_user_tsv_with_separate_vocabularies(tmp_path):
    rows = [f"open file {i}\tDatei {i} öffnen" for i in range(40)] + [f"close window {i}\tFenster {i} schließen" for i in range(40)]
    (tmp_path / "train.tsv").write_text("src\ttgt\n" + "\n".join(rows) + "\n")
    out = tmp_path / "sep"
    train.run_from_argv(tiny_argv(out, "--task", "files", "--train_file", str(tmp_path / "train.tsv"), "--source_column", "src",
                                  "--target_column", "tgt", "--joint_vocab", "false", "--vocab_size", "280",
                                  "--target_vocab_size", "290", "--max_steps", "3", "--save_strategy", "steps", "--save_steps", "3"))
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 280 and config["target_vocab_size"] == 290 and not config["share_all_embeddings"]
    assert (out / "checkpoint-3" / "source_tokenizer" / "tokenizer.json").is_file()
    results = decode.run_from_argv(["--model_name_or_path", str(out / "checkpoint-3"), "--num_beams", "1", "--max_new_tokens", "4"])
    assert results["dataset"] == "train.tsv" and "pov" not in results["metrics"]


@pytest.mark.slow
def test_quickstart_smoke(tmp_path, capsys):
    from flexformers.training_scripts import quickstart

    result = quickstart.run_from_argv(["--smoke", "--output_dir", str(tmp_path / "qs")])
    printed = capsys.readouterr().out
    assert "REFERENCE:" in printed and "GENERATED:" in printed and "sacrebleu signature:" in printed
    # the model's scores beside copying the input, on the same test examples, in the summary and eval_results.json
    assert "copying the input" in printed and "model - copy" in printed
    assert "exactly right:" in printed and result["exact_matches"]["examples"] == 6
    assert result["exact_matches"]["copy"] == 0  # a shuffled sentence is never its own reference
    stored = json.loads((tmp_path / "qs" / "eval_results.json").read_text())
    assert set(stored["metrics"]) == set(stored["copy_baseline"]) == set(stored["gain_over_copy"]) == {"bleu", "chrf", "ter"}
    assert stored["task"] == "word_order" and stored == result["eval"]
    # word-order recovery: the test outputs (and the validation curve's) are permutations of the source words
    assert stored["output_constraint"] == "permutation of the source words"
    hypotheses = [json.loads(line) for line in (tmp_path / "qs" / "generations.test.jsonl").read_text().splitlines()]
    # (the smoke mode's 32-token limit cuts the longest, maybe inside a word; the words before are the source's)
    assert all(Counter(row["hypothesis"].split()[:-1]) <= Counter(row["source"].split()) for row in hypotheses)
    assert sum(sorted(row["hypothesis"].split()) == sorted(row["source"].split()) for row in hypotheses) >= 4
    assert stored["copy_baseline"]["chrf"] > 30  # the shuffled sentence has every character of the reference
    assert (tmp_path / "qs" / "model.safetensors").is_file()
    # the learning curve: training loss and validation BLEU per update, with the copy baseline
    assert result["curve"] == str(tmp_path / "qs" / "learning_curve.png")
    assert (tmp_path / "qs" / "learning_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    history = json.loads((tmp_path / "qs" / "trainer_state.json").read_text())["log_history"]
    assert any("eval_bleu" in entry and "eval_copy_bleu" in entry and "eval_bleu_over_copy" in entry for entry in history)
    assert any("loss" in entry for entry in history)


@pytest.mark.slow
@pytest.mark.parametrize("model_type, figure", [
    ("iot", "decoder order usage"),
    ("mat", "attention branches"),
    ("depth_adaptive", "confidence exit"),
    ("indigo", "left-to-right share"),
])
def test_quickstart_runs_each_method_with_its_figures(tmp_path, capsys, model_type, figure):
    """`flexformers-quickstart --model_type M`: the same job and summary (beside copying), plus the method's figure."""
    from flexformers.training_scripts import quickstart

    result = quickstart.run_from_argv(["--smoke", "--model_type", model_type, "--max_steps", "4",
                                       "--output_dir", str(tmp_path / model_type)])
    printed = capsys.readouterr().out
    assert f"{model_type} on word_order, test set" in printed and "copying the input" in printed
    assert json.loads((tmp_path / model_type / "config.json").read_text())["model_type"] == model_type
    assert (tmp_path / model_type / "learning_curve.png").is_file()
    (name, value), *_ = [(n, v) for n, v in result["figures"].items() if figure in n]
    assert f"{name}: {value}" in printed
    if model_type == "depth_adaptive":
        exits = [v for n, v in result["figures"].items() if "average exit" in n]
        assert len(exits) == 1 and 1.0 <= exits[0] <= 2.0  # the smoke model's 2 decoder blocks
    if model_type == "iot":
        assert sum(value.values()) == pytest.approx(1.0, abs=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [m for m in available_model_types() if m != "flexformer"])
def test_every_registered_model_type_trains_and_decodes(tmp_path, model_type):
    """The one entry point: each method module plugs into flexformers-train / flexformers-decode."""
    out = tmp_path / model_type
    argv = tiny_argv(out, "--max_steps", "2", "--save_strategy", "no")
    argv[argv.index("--model_type") + 1] = model_type
    results = train.run_from_argv(argv)
    assert results["train"]["train_samples"] > 0
    assert json.loads((out / "config.json").read_text())["model_type"] == model_type
    decoded = decode.run_from_argv(["--model_name_or_path", str(out), "--split", "validation", "--max_samples", "2",
                                    "--num_beams", "2", "--max_new_tokens", "6", "--num_samples_to_print", "0"])
    assert decoded["num_examples"] == 2 and set(decoded["metrics"]) >= {"bleu", "chrf", "ter", "pov"}


def test_cpu_training_retains_freed_memory_unless_told_not_to(tmp_path, monkeypatch):
    """flexformers-train switches glibc to keeping freed memory when it trains on the CPU (training_scripts/cpu_heap),
    and leaves the allocator alone with --retain_cpu_memory false."""
    calls = []
    monkeypatch.setattr(train, "retain_freed_memory", lambda: calls.append("retain") or True)
    train.run_from_argv(tiny_argv(tmp_path / "default", "--max_steps", "1"))
    assert calls == ["retain"]
    train.run_from_argv(tiny_argv(tmp_path / "off", "--max_steps", "1", "--retain_cpu_memory", "false"))
    assert calls == ["retain"]


def test_a_time_budget_is_the_stopping_rule_and_no_checkpoints_need_no_best_model(tmp_path):
    """`--max_train_minutes` alone trains until the budget (not Trainer's default 3 epochs); `--save_strategy no`
    is accepted (no checkpoints: no best one to reload); `MaxTimeCallback(deadline=...)` stops at an absolute time
    that counted the work before training."""
    import time as clock

    from transformers import TrainerControl, TrainerState

    _, _, _, args, _ = train.parse_arguments(["--output_dir", str(tmp_path), "--max_train_minutes", "30"])
    assert args.num_train_epochs == train.TIME_BUDGET_EPOCHS
    _, _, _, args, _ = train.parse_arguments(["--output_dir", str(tmp_path), "--max_train_minutes", "30",
                                              "--num_train_epochs", "2"])
    assert args.num_train_epochs == 2
    _, _, _, args, _ = train.parse_arguments(["--output_dir", str(tmp_path), "--save_strategy", "no"])
    assert args.save_strategy == "no" and not args.load_best_model_at_end

    for deadline, stops in ((clock.monotonic() - 1.0, True), (clock.monotonic() + 3600.0, False)):
        callback, control = train.MaxTimeCallback(deadline=deadline), TrainerControl()
        callback.on_train_begin(args, TrainerState(), control)
        assert callback.on_step_end(args, TrainerState(), control).should_training_stop is stops
    with pytest.raises(ValueError, match="exactly one"):
        train.MaxTimeCallback(max_minutes=1.0, deadline=clock.monotonic())
