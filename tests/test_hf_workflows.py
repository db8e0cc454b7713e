"""What a Hugging Face user does with a model through Transformers' own tools, not the project's scripts (issue 61),
for every model type beside the same check on a tiny `BartForConditionalGeneration`:

- fine-tune a loaded model: `from_pretrained` → `.train()` → a `Seq2SeqTrainer` step → save → reload;
- load a checkpoint that lacks the shared table of words: reported missing, initialised, usable;
- train with `Seq2SeqTrainer`'s defaults (`DataCollatorForSeq2Seq`, evaluation, `load_best_model_at_end`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForSeq2SeqLM,
    BartConfig,
    BartForConditionalGeneration,
    DataCollatorForSeq2Seq,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
)

from flexformers.training_scripts.model_registry import get_method_spec
from flexformers.training_scripts.tokenizer import train_bpe_tokenizer
from tests.conftest import tiny_config_kwargs

#: model type -> the tiny config's method fields (as tests/test_conformance.py's table: every code path of a type)
METHOD_FIELDS = {
    "flexformer": {},
    "iot": {"decoder_orders": [1, 2, 4, 6], "encoder_orders": [1, 2]},
    "mat": {"encoder_attention_branches": 2, "decoder_attention_branches": 2},
    "indigo": {},
    "depth_adaptive": {"exit_strategy": "confidence", "exit_thresholds": [0.02]},
}
MODEL_TYPES = list(METHOD_FIELDS)
WITH_BART = ["bart", *MODEL_TYPES]

TEXTS = [
    ("the cat sees a dog", "die katze sieht einen hund"),
    ("a big red house", "ein grosses rotes haus"),
    ("small blue tree", "kleiner blauer baum"),
    ("the dog runs and jumps", "der hund rennt und springt"),
    ("a cat and a dog", "eine katze und ein hund"),
    ("the red tree", "der rote baum"),
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer([text for pair in TEXTS for text in pair] * 4, vocab_size=280, min_frequency=1)


@pytest.fixture(scope="module")
def examples(tokenizer):
    """Tokenised pairs as a user's `dataset.map(tokenize)` gives them: `input_ids` and `labels`, each ending in </s>."""
    return [
        {"input_ids": tokenizer(source)["input_ids"], "labels": tokenizer(target)["input_ids"]}
        for source, target in TEXTS
    ]


def tiny_model(model_type: str, vocab_size: int, seed: int = 0, **overrides):
    """A tiny model of `model_type` ("bart" or a flexformers type), seeded, in training mode."""
    torch.manual_seed(seed)
    if model_type == "bart":
        fields = dict(
            vocab_size=vocab_size, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        )
        return BartForConditionalGeneration(BartConfig(**{**fields, **overrides}))
    spec = get_method_spec(model_type)
    config = spec.config_class(**tiny_config_kwargs(vocab_size=vocab_size, **METHOD_FIELDS[model_type], **overrides))
    return spec.model_class(config)


def tensors_on_the_meta_device(model) -> list[str]:
    """Names of parameters and buffers still on the meta device, and of tensors the modules keep as attributes
    (directly, or in a tuple/list/dict) that are."""
    found = [name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor.is_meta]

    def visit(value, name):
        if isinstance(value, torch.Tensor):
            if value.is_meta:
                found.append(name)
        elif isinstance(value, (tuple, list)):
            for index, item in enumerate(value):
                visit(item, f"{name}[{index}]")
        elif isinstance(value, dict):
            for key, item in value.items():
                visit(item, f"{name}[{key!r}]")

    for module_name, module in model.named_modules():
        for attribute, value in vars(module).items():
            if attribute not in ("_parameters", "_buffers", "_modules"):
                visit(value, f"{module_name}.{attribute}")
    return found


def training_arguments(output_dir, **overrides) -> Seq2SeqTrainingArguments:
    options = dict(
        output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=3, per_device_eval_batch_size=3,
        learning_rate=1e-2, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, seed=0,
        disable_tqdm=True,
    )
    options.update(overrides)
    return Seq2SeqTrainingArguments(**options)


def teacher_forced_batch(tokenizer, examples, model) -> dict:
    return DataCollatorForSeq2Seq(tokenizer, model=model)(examples[:3])


# --------------------------------------------------------------------------------------------------------------------
# 1. Fine-tuning a loaded model
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", WITH_BART)
def test_a_loaded_model_trains_as_the_saved_one(model_type, tokenizer, examples, tmp_path):
    """`from_pretrained(dir).train()` then a training forward: nothing is left on the meta device where Transformers
    builds the model (IOT kept its Gumbel temperatures and order statistics as plain tensor attributes, which stayed
    there), and the loaded model's training loss is the saved model's, from the same random state (IOT's Gumbel
    noise, dropout)."""
    model = tiny_model(model_type, len(tokenizer), dropout=0.1)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).train()
    assert type(loaded) is type(model)
    assert tensors_on_the_meta_device(loaded) == []
    batch = teacher_forced_batch(tokenizer, examples, model)
    losses = []
    for candidate in (model.train(), loaded):
        torch.manual_seed(3)
        losses.append(candidate(**batch).loss)
    assert torch.isfinite(losses[1])
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type", WITH_BART)
def test_fine_tune_a_loaded_model_with_seq2seq_trainer_then_save_and_reload(model_type, tokenizer, examples, tmp_path):
    """The most common workflow: load, fine-tune a couple of steps with `Seq2SeqTrainer` and
    `DataCollatorForSeq2Seq`, save, reload: the loss is finite, the weights moved, the reload holds them."""
    tiny_model(model_type, len(tokenizer)).save_pretrained(tmp_path / "pretrained")
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "pretrained").train()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    trainer = Seq2SeqTrainer(
        model=model,
        args=training_arguments(tmp_path / "run"),
        train_dataset=examples,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
    )
    result = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert torch.isfinite(torch.tensor(result.training_loss))
    changed = [name for name, tensor in model.state_dict().items() if not torch.equal(tensor, before[name])]
    assert len(changed) > len(before) // 2, changed
    trainer.save_model(str(tmp_path / "tuned"))
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "tuned")
    assert tensors_on_the_meta_device(reloaded) == []
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_models_loaded_from_their_exported_remote_code_folders_train_as_the_saved_ones(tokenizer, examples, tmp_path):
    """The same through the folders `flexformers-export` writes, in an interpreter without flexformers (the models'
    own source, `trust_remote_code=True`): the remote-code classes are built on the meta device just the same."""
    from flexformers.training_scripts.export_to_hub import ExportOptions, export_checkpoint

    batch = teacher_forced_batch(tokenizer, examples, tiny_model("flexformer", len(tokenizer)))
    torch.save(dict(batch), tmp_path / "batch.pt")
    folders, losses = {}, {}
    for model_type in MODEL_TYPES:
        model = tiny_model(model_type, len(tokenizer), dropout=0.1, share_all_embeddings=True).train()
        model.save_pretrained(tmp_path / model_type)
        tokenizer.save_pretrained(tmp_path / model_type)
        folders[model_type] = str(export_checkpoint(
            tmp_path / model_type, tmp_path / f"{model_type}_hub", ExportOptions(require_eval_results=False)))
        torch.manual_seed(3)
        losses[model_type] = model(**batch).loss.item()
    script = (
        "import json, sys, torch\n"
        "from transformers import AutoModelForSeq2SeqLM\n"
        "folders, batch = json.loads(sys.argv[1]), torch.load(sys.argv[2])\n"
        "losses = {}\n"
        "for model_type, folder in folders.items():\n"
        "    model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).train()\n"
        "    assert type(model).__module__.startswith('transformers_modules.'), type(model).__module__\n"
        "    torch.manual_seed(3)\n"
        "    losses[model_type] = model(**batch).loss.item()\n"
        "assert 'flexformers' not in sys.modules\n"
        "print(json.dumps(losses))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, json.dumps(folders), str(tmp_path / "batch.pt")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    remote = json.loads(done.stdout.strip().splitlines()[-1])
    assert remote.keys() == losses.keys()
    for model_type, loss in losses.items():
        assert remote[model_type] == pytest.approx(loss, rel=1e-5), model_type


def test_iot_gumbel_temperatures_follow_the_schedule_after_loading(tokenizer, tmp_path):
    """IOT's temperatures are a non-persistent buffer filled from the schedule: after `from_pretrained` they are the
    schedule's at step 0 (not uninitialised memory), and `set_gumbel_step` moves them as the schedule moves."""
    model = tiny_model("iot", len(tokenizer), encoder_gumbel_temperature=8.0, decoder_gumbel_temperature=4.0,
                       gumbel_temperature_min=1.0, gumbel_temperature_decay_rate=1e-3,
                       gumbel_temperature_update_freq=10)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert "gumbel_temperature.values" not in load_file(tmp_path / "model.safetensors")
    assert loaded.gumbel_temperature.values.tolist() == [8.0, 4.0]
    loaded.set_gumbel_step(25)
    torch.testing.assert_close(loaded.gumbel_temperature.values, torch.tensor(loaded.gumbel_temperatures()))
    assert loaded.gumbel_temperatures()[0] == pytest.approx(8.0 * 2.718281828 ** (-1e-3 * 20), rel=1e-6)


def test_the_auto_classes_know_every_type_on_importing_flexformers_modeling(tokenizer, tmp_path):
    """No remote code is involved: a saved model's config names no `auto_map`, and in a fresh interpreter importing
    `flexformers.modeling` is all `AutoModelForSeq2SeqLM.from_pretrained` needs (no `trust_remote_code`)."""
    folders = {}
    for model_type in MODEL_TYPES:
        folders[model_type] = str(tmp_path / model_type)
        tiny_model(model_type, len(tokenizer)).save_pretrained(folders[model_type])
        assert "auto_map" not in json.loads((tmp_path / model_type / "config.json").read_text())
    script = (
        "import json, sys\n"
        "import flexformers.modeling\n"
        "from transformers import AutoModelForSeq2SeqLM\n"
        "folders = json.loads(sys.argv[1])\n"
        "loaded = {t: type(AutoModelForSeq2SeqLM.from_pretrained(f)).__module__ for t, f in folders.items()}\n"
        "print(json.dumps(loaded))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, json.dumps(folders)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    modules = json.loads(done.stdout.strip().splitlines()[-1])
    assert modules == {model_type: f"flexformers.modeling.modeling_{model_type}" for model_type in MODEL_TYPES}


# --------------------------------------------------------------------------------------------------------------------
# 2. A checkpoint without the shared table of words
# --------------------------------------------------------------------------------------------------------------------


def shared_table_names(model_type: str) -> list[str]:
    """The checkpoint names of the one table shared by encoder, decoder and output projection."""
    return ["model.shared.weight"] if model_type == "bart" else ["model.encoder.embed_tokens.weight"]


@pytest.mark.parametrize("model_type", WITH_BART)
def test_a_checkpoint_without_the_shared_table_reports_it_missing_and_initialises_it(
    model_type, tokenizer, examples, tmp_path
):
    """Transformers builds the model on the meta device, loads what the checkpoint has and initialises what it
    lacks. A checkpoint lacking the shared table (one table for encoder, decoder and output projection) lists it in
    `missing_keys`, and the model is initialised and usable, as BART is (it stayed on the meta device, unreported)."""
    model = (tiny_model(model_type, len(tokenizer)) if model_type == "bart"
             else tiny_model(model_type, len(tokenizer), share_all_embeddings=True))
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(path)
    for name in shared_table_names(model_type):
        del state[name]
    assert not any("embed_tokens" in name or "shared" in name for name in state)
    save_file(state, path, metadata={"format": "pt"})

    loaded, info = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, output_loading_info=True)
    assert set(shared_table_names(model_type)) <= set(info["missing_keys"])
    assert tensors_on_the_meta_device(loaded) == []
    table = loaded.get_input_embeddings().weight
    assert loaded.get_decoder().embed_tokens.weight is table and loaded.get_output_embeddings().weight is table
    assert table.std() > 0 and not torch.equal(table, model.get_input_embeddings().weight)
    batch = teacher_forced_batch(tokenizer, examples, loaded)
    with torch.no_grad():
        logits = loaded.eval()(**batch).logits
    assert torch.isfinite(logits).all()
    # everything the checkpoint had is loaded as it was
    for name, tensor in state.items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


@pytest.mark.parametrize("model_type", WITH_BART)
def test_a_bias_missing_beside_its_loaded_weight_starts_as_a_fresh_models(model_type, tokenizer, tmp_path):
    """A checkpoint holding a projection's weight but not its bias: the bias is initialised as in a new model
    (the FFN's and attention output's biases zero, fairseq's), not left as the memory `from_pretrained` allocated."""
    model = tiny_model(model_type, len(tokenizer))
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(path)
    fresh = tiny_model(model_type, len(tokenizer), seed=1).state_dict()
    removed = [name for name in state if name.endswith(("fc1.bias", "out_proj.bias")) and not fresh[name].any()]
    assert removed
    for name in removed:
        del state[name]
    save_file(state, path, metadata={"format": "pt"})
    for name in removed:  # leave freed memory of the biases' size that is not zero, for the allocator to hand out
        junk = torch.full_like(fresh[name], float("nan"))
        del junk

    loaded, info = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, output_loading_info=True)
    assert set(removed) <= set(info["missing_keys"])
    for name in removed:
        assert torch.equal(loaded.state_dict()[name], fresh[name]), name


# --------------------------------------------------------------------------------------------------------------------
# 5. Seq2SeqTrainer's defaults: evaluation loss and the best model at the end
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", WITH_BART)
def test_seq2seq_trainer_defaults_evaluate_and_reload_the_best_model(model_type, tokenizer, examples, tmp_path):
    """A plain `Seq2SeqTrainer` with `DataCollatorForSeq2Seq` (which gives `labels` only), evaluation and
    `load_best_model_at_end=True` (best by the default metric, the loss): the labels Transformers reads off `forward`
    are `labels`, every evaluation has an `eval_loss`, and the best checkpoint is reloaded (InDIGO's forward also
    named its insertion targets `*_labels`, so the Trainer waited for them and had no `eval_loss`: a KeyError)."""
    model = tiny_model(model_type, len(tokenizer))
    trainer = Seq2SeqTrainer(
        model=model,
        args=training_arguments(
            tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
            load_best_model_at_end=True,
        ),
        train_dataset=examples,
        eval_dataset=examples[:3],
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
    )
    assert trainer.label_names == ["labels"]
    trainer.train()
    evaluations = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert [entry["step"] for entry in evaluations] == [2, 4]
    assert all(torch.isfinite(torch.tensor(entry["eval_loss"])) for entry in evaluations)
    best_step = min(evaluations, key=lambda entry: entry["eval_loss"])["step"]
    assert trainer.state.best_model_checkpoint.endswith(f"checkpoint-{best_step}")
    assert trainer.state.best_metric == pytest.approx(min(entry["eval_loss"] for entry in evaluations))
    best = load_file(f"{trainer.state.best_model_checkpoint}/model.safetensors")
    for name, tensor in best.items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert trainer.evaluate()["eval_loss"] == pytest.approx(trainer.state.best_metric, rel=1e-5)


def test_indigo_insertion_batches_evaluate_in_a_plain_trainer_and_take_the_earlier_target_names(
    tokenizer, examples, tmp_path
):
    """The project's InDIGO collator (a pre-defined order: the insertion targets beside `labels`) in a plain
    `Seq2SeqTrainer`: `evaluate()` reports the insertion loss of that order. Batches naming the targets by their
    earlier names (`insertion_labels`, `pointer_labels`) give the same loss; both names at once are refused."""
    from flexformers.training_scripts.indigo_orders import InDIGODataCollator

    model = tiny_model("indigo", len(tokenizer)).eval()
    collator = InDIGODataCollator(order="odd")
    batch = collator(examples[:3])
    assert {"labels", "insertion_targets", "pointer_targets"} <= set(batch)
    with torch.no_grad():
        loss = model(**batch).loss
        earlier = dict(batch)
        earlier["insertion_labels"], earlier["pointer_labels"] = earlier.pop("insertion_targets"), earlier.pop(
            "pointer_targets")
        assert torch.equal(model(**earlier).loss, loss)
        with pytest.raises(ValueError, match="both insertion_targets and insertion_labels"):
            model(**batch, insertion_labels=batch["insertion_targets"])
        left_to_right = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    assert not torch.allclose(loss, left_to_right)  # the collator's order is the one evaluated
    trainer = Seq2SeqTrainer(model=model, args=training_arguments(tmp_path), data_collator=collator)
    assert trainer.evaluate(examples[:3])["eval_loss"] == pytest.approx(float(loss), rel=1e-5)
