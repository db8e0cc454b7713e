"""Shipped zoo models (issue 64): ``flexformers-zoo ship / verify / publish``, and every folder in ``zoo_models/``
decoding its card's slice to its card's score, with ``import flexformers`` and in a clean environment holding only
torch, transformers, tokenizers and safetensors (``trust_remote_code=True``)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from flexformers.training_scripts import decode, zoo, zoo_recipes, zoo_shipping
from flexformers.training_scripts.zoo_shipping import (
    CARD_SECTION,
    SHIP_RECORD,
    ship_recipe,
    shipped_folders,
    verify_shipped,
    write_half_precision_weights,
)
from tests.test_hub_clean_venv import clean_venv_python
from tests.test_zoo import write_recipes

REPOSITORY = Path(__file__).resolve().parent.parent
SHIPPED = shipped_folders(REPOSITORY / zoo_shipping.DEFAULT_SHIPPED_DIR)


# ---------------------------------------------------------------------------------------------------------------
# The models the repository ships
# ---------------------------------------------------------------------------------------------------------------


def test_the_shipped_models_stay_within_the_size_limit():
    total = sum(zoo_shipping.folder_bytes(folder) for folder in SHIPPED)
    assert total <= zoo_shipping.SHIPPED_SIZE_LIMIT, f"{total / 2**20:.1f} MiB shipped"


def readme_trained_model_snippet() -> tuple[str, str]:
    """The README's "Use a trained model" Python snippet and the output block it says the snippet prints."""
    section = (REPOSITORY / "README.md").read_text().split("## Use a trained model", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w*)\n(.*?)```", section, flags=re.S)
    code = next(body for language, body in blocks if language == "python")
    printed = next(body for language, body in blocks if language == "text")
    return code, printed


@pytest.mark.slow
def test_the_readme_snippet_prints_a_translation_and_a_recovered_sentence_without_training():
    """Issue 64's "done when": the README's snippet, run from a fresh clone's root in an environment with only
    torch, transformers, tokenizers and safetensors, prints what the README says it prints."""
    code, printed = readme_trained_model_snippet()
    assert "import flexformers" not in code
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    result = subprocess.run([str(clean_venv_python()), "-c", code], cwd=REPOSITORY, env=env, capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines() == printed.strip().splitlines()
    assert len(printed.strip().splitlines()) == 2  # a translation and a recovered sentence


@pytest.mark.parametrize("folder", SHIPPED, ids=[folder.name for folder in SHIPPED])
def test_a_shipped_model_carries_the_corpus_options_of_its_recipe(folder):
    """`flexformers-decode --model_name_or_path <shipped folder>` needs no --task: the folder says what it was
    trained on, and nothing in it names a file of the machine that trained it."""
    record = json.loads((folder / SHIP_RECORD).read_text())
    decode_args, data_args = decode.parse_arguments(["--model_name_or_path", str(folder), "--text", "x"])
    settings = record["recipe"]["task_settings"]
    assert data_args.task == record["recipe"]["task"]
    assert (data_args.max_source_length, data_args.max_target_length) == (settings["max_source_length"],
                                                                         settings["max_target_length"])
    assert not any(getattr(data_args, name) for name in ("train_file", "validation_file", "test_file"))
    assert "flexformers_data_args.json" in record["files"]


@pytest.mark.slow
@pytest.mark.parametrize("folder", SHIPPED, ids=[folder.name for folder in SHIPPED])
def test_a_shipped_model_decodes_its_card_slice_to_its_card_score(folder):
    record = json.loads((folder / SHIP_RECORD).read_text())
    assert not record["smoke"], "a smoke run is never shipped"
    assert record["slice"]["examples"] == min(zoo_shipping.SLICE_EXAMPLES, record["zoo_row"]["num_examples"])
    assert verify_shipped(folder) == []  # import flexformers: the registered classes
    assert verify_shipped(folder, python=str(clean_venv_python())) == []  # the folder's own remote code


# ---------------------------------------------------------------------------------------------------------------
# ship / verify on a smoke run
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """A word-order baseline recipe trained, evaluated and exported in smoke mode."""
    work = tmp_path_factory.mktemp("ship")
    recipes_path = write_recipes(work, "  - {name: base, task: word_order, model_type: flexformer, claim: baseline}\n")
    runs = work / "runs"
    argv = ["--recipes", str(recipes_path), "--runs_dir", str(runs), "--records_dir", str(work / "records")]
    assert zoo.main([*argv, "run", "base", "--smoke"]) == 0
    recipe = zoo_recipes.load_recipes(recipes_path)[0]
    return recipe, runs, argv


@pytest.mark.slow
def test_ship_copies_the_export_measures_storage_and_proves_the_card(smoke_run, tmp_path):
    recipe, runs, argv = smoke_run
    shipped_dir = tmp_path / "zoo_models"
    # the command line ships full runs only
    assert zoo.main([*argv, "ship", "base", "--shipped_dir", str(shipped_dir)]) == 1
    assert not shipped_dir.exists() or not any(shipped_dir.iterdir())

    record = ship_recipe(recipe, runs, shipped_dir, allow_smoke=True, measure_examples=40)
    folder = shipped_dir / "base"
    assert shipped_folders(shipped_dir) == [folder]
    assert [path.name for path in shipped_dir.iterdir()] == ["base"]  # no staging left
    assert json.loads((folder / SHIP_RECORD).read_text()) == record
    assert record["files"] == sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert not (folder / ".flexformers-export.json").exists()
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "README.md",
                 "flexformers_data_args.json"):
        assert (folder / name).is_file(), name
    # flexformers-decode on the shipped folder decodes as the zoo did, without --task: word order's outputs are
    # permutations of the input's words
    decode_args, data_args = decode.parse_arguments(["--model_name_or_path", str(folder), "--text", "b a c a"])
    assert data_args.task == "word_order" and data_args.max_target_length == recipe.task_settings["max_target_length"]
    (hypothesis,) = decode.run(decode_args, data_args)["hypotheses"]
    assert sorted(hypothesis.split()) == ["a", "a", "b", "c"]

    storage = record["storage"]
    assert storage["examples"] == 40 and isinstance(storage["float32_bleu"], float)
    assert storage["difference"] == round(storage["float16_bleu"] - storage["float32_bleu"], 2)
    expected = "float16" if abs(storage["difference"]) < zoo_shipping.HALF_PRECISION_TOLERANCE else "float32"
    assert storage["dtype"] == expected
    with safe_open(str(folder / "model.safetensors"), framework="pt") as weights:
        dtypes = {weights.get_tensor(name).dtype for name in weights.keys()}
    assert dtypes == {getattr(torch, expected)}

    slice_ = record["slice"]
    result = json.loads((runs / "base" / "zoo_result.json").read_text())
    assert slice_["examples"] == zoo_shipping.SLICE_EXAMPLES  # of the 2970 test pairs (the smoke test decoded 4)
    assert len(slice_["sources"]) == len(slice_["references"]) == len(slice_["hypotheses"]) == slice_["examples"]
    assert record["zoo_row"]["bleu"] == result["test"]["metrics"]["bleu"]
    assert record["parameters"] == result["parameters"] and record["recipe"]["seed"] == recipe.seed
    card = (folder / "README.md").read_text()
    section = card.split(CARD_SECTION, 1)[1]
    assert "**A smoke run**" in section and f"| {slice_['metrics']['bleu']:.2f} |" in section
    assert slice_["sacrebleu_signature"] in section or record["zoo_row"]["sacrebleu_signature"] in section

    assert verify_shipped(folder) == []
    assert verify_shipped(folder, python=str(clean_venv_python())) == []
    assert zoo.main(["verify", "--shipped_dir", str(shipped_dir)]) == 0

    # the same recipe again: refused, the shipped folder untouched
    before = (folder / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="replaced only when its recipe changes"):
        ship_recipe(recipe, runs, shipped_dir, allow_smoke=True, measure_examples=40)
    assert (folder / "model.safetensors").read_bytes() == before
    assert [path.name for path in shipped_dir.iterdir()] == ["base"]

    # a folder that no longer decodes to its card fails verification, naming what differs
    tampered = tmp_path / "tampered" / "base"
    shutil.copytree(folder, tampered)
    changed = json.loads((tampered / SHIP_RECORD).read_text())
    changed["slice"]["hypotheses"][0] += " extra"
    changed["slice"]["metrics"]["bleu"] += 1.0
    (tampered / SHIP_RECORD).write_text(json.dumps(changed))
    problems = verify_shipped(tampered)
    assert any("1 of" in problem and "example 1" in problem for problem in problems), problems
    assert any("where the card says" in problem for problem in problems), problems
    assert any("does not state the slice BLEU" in problem for problem in problems), problems
    assert zoo.main(["verify", "--shipped_dir", str(tampered.parent)]) == 1

    # shipped from an earlier version of the recipe: replaced with --replace only, nothing else left behind
    earlier = json.loads((folder / SHIP_RECORD).read_text())
    earlier["recipe"]["seed"] += 1
    (folder / SHIP_RECORD).write_text(json.dumps(earlier))
    with pytest.raises(ValueError, match="pass --replace"):
        ship_recipe(recipe, runs, shipped_dir, allow_smoke=True, measure_examples=8)
    replaced = ship_recipe(recipe, runs, shipped_dir, allow_smoke=True, measure_examples=8, replace=True)
    assert [path.name for path in shipped_dir.iterdir()] == ["base"]
    assert json.loads((folder / SHIP_RECORD).read_text()) == replaced and replaced["recipe"]["seed"] == recipe.seed


@pytest.mark.slow
def test_ship_refuses_what_it_must_not_replace_or_exceed(smoke_run, tmp_path, monkeypatch):
    recipe, runs, _ = smoke_run
    shipped_dir = tmp_path / "zoo_models"
    foreign = shipped_dir / "base"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a folder `ship` made"):
        ship_recipe(recipe, runs, shipped_dir, allow_smoke=True, measure_examples=8)
    assert (foreign / "notes.txt").read_text() == "mine"

    other_dir = tmp_path / "small"
    monkeypatch.setattr(zoo_shipping, "SHIPPED_SIZE_LIMIT", 1000)
    with pytest.raises(ValueError, match="over the 0 MiB allowed"):
        ship_recipe(recipe, runs, other_dir, allow_smoke=True, measure_examples=8)
    assert list(other_dir.iterdir()) == []  # neither the folder nor its staging is left


def test_a_changed_recipe_replaces_a_shipped_model_only_when_asked(tmp_path):
    recipe = zoo_recipes.ZooRecipe(name="base", task="word_order", model_type="flexformer", claim="baseline",
                                   task_settings={})
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / SHIP_RECORD).write_text(json.dumps({"recipe": dataclasses.asdict(recipe), "files": [SHIP_RECORD]}))
    with pytest.raises(ValueError, match="replaced only when its recipe changes"):
        zoo_shipping._check_destination(folder, recipe, replace=True)
    changed = dataclasses.replace(recipe, seed=recipe.seed + 1)
    with pytest.raises(ValueError, match=r"changed since .* \(seed differ\): pass --replace"):
        zoo_shipping._check_destination(folder, changed, replace=False)
    zoo_shipping._check_destination(folder, changed, replace=True)  # allowed
    (folder / "my_notes.txt").write_text("mine")  # a file the user added: the folder is not replaced
    with pytest.raises(ValueError, match=r"holds files `ship` did not write \(my_notes.txt\)"):
        zoo_shipping._check_destination(folder, changed, replace=True)
    zoo_shipping._check_destination(tmp_path / "absent", recipe, replace=False)


# ---------------------------------------------------------------------------------------------------------------
# Half-precision storage
# ---------------------------------------------------------------------------------------------------------------


def _saved_tiny_model(folder: Path):
    from flexformers.configuration.configuration_flexformer import FlexformerConfig
    from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration

    torch.manual_seed(0)
    model = FlexformerForConditionalGeneration(FlexformerConfig(
        vocab_size=40, encoder_embed_dim=16, decoder_embed_dim=16, encoder_ffn_embed_dim=32, decoder_ffn_embed_dim=32,
        encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        share_all_embeddings=True))
    model.save_pretrained(folder)
    return model


def test_half_precision_storage_rounds_the_weights_and_loads_back_as_float32(tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    model = _saved_tiny_model(tmp_path / "m")
    with safe_open(str(tmp_path / "m" / "model.safetensors"), framework="pt") as weights:
        metadata = weights.metadata()
    assert write_half_precision_weights(tmp_path / "m")
    with safe_open(str(tmp_path / "m" / "model.safetensors"), framework="pt") as weights:
        assert weights.metadata() == metadata
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.float16}
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == "float32"
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "m")  # the default dtype: what a user gets
    for name, tensor in model.state_dict().items():
        assert loaded.state_dict()[name].dtype == torch.float32
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.float16).float()), name


def test_half_precision_storage_keeps_float32_when_a_weight_does_not_fit(tmp_path):
    from safetensors.torch import load_file, save_file

    _saved_tiny_model(tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    with safe_open(str(path), framework="pt") as weights:
        metadata = weights.metadata()
    tensors = load_file(path)
    name = next(iter(tensors))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = 1e6  # beyond float16's 65504
    save_file(tensors, path, metadata=metadata)
    before = path.read_bytes()
    assert not write_half_precision_weights(tmp_path / "m")
    assert path.read_bytes() == before


# ---------------------------------------------------------------------------------------------------------------
# publish
# ---------------------------------------------------------------------------------------------------------------


def _fake_shipped(shipped_dir: Path, names: list[str]) -> None:
    for name in names:
        (shipped_dir / name).mkdir(parents=True)
        (shipped_dir / name / SHIP_RECORD).write_text("{}")
        (shipped_dir / name / "model.safetensors").write_bytes(b"0" * 2**20)
    (shipped_dir / "not-shipped").mkdir()


def test_publish_dry_run_lists_every_shipped_folder_and_uploads_nothing(tmp_path, capsys, monkeypatch):
    _fake_shipped(tmp_path, ["a-s1", "b-s1"])
    monkeypatch.setattr("flexformers.training_scripts.export_to_hub.push_folder_to_hub",
                        lambda *a, **k: pytest.fail("a dry run uploaded"))
    assert zoo.main(["publish", "--namespace", "me", "--shipped_dir", str(tmp_path), "--dry_run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "would upload:"
    assert out[1:] == [f"{tmp_path / 'a-s1'} -> https://huggingface.co/me/a-s1 (1.0 MiB)",
                       f"{tmp_path / 'b-s1'} -> https://huggingface.co/me/b-s1 (1.0 MiB)"]


@pytest.mark.parametrize("offline, token, reason", [
    ("1", None, "HF_HUB_OFFLINE is set"),
    ("0", None, "no Hub token"),
])
def test_publish_without_network_or_token_says_so_in_one_line(tmp_path, capsys, monkeypatch, offline, token, reason):
    _fake_shipped(tmp_path / "shipped", ["a-s1"])
    monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: token)
    assert zoo.main(["publish", "--namespace", "me", "--shipped_dir", str(tmp_path / "shipped")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot publish: {reason}" in err


def test_publish_uploads_each_shipped_folder_to_its_repository(tmp_path, monkeypatch, capsys):
    _fake_shipped(tmp_path, ["a-s1", "b-s1"])
    uploads = []
    monkeypatch.setattr(zoo_shipping, "hub_unavailable_reason", lambda token: None)
    monkeypatch.setattr("flexformers.training_scripts.export_to_hub.push_folder_to_hub",
                        lambda folder, repo_id, private, token: uploads.append((folder.name, repo_id, private))
                        or f"https://huggingface.co/{repo_id}/commit/1")
    assert zoo.main(["publish", "--namespace", "org", "--shipped_dir", str(tmp_path), "--private"]) == 0
    assert uploads == [("a-s1", "org/a-s1", True), ("b-s1", "org/b-s1", True)]
    assert "https://huggingface.co/org/b-s1/commit/1" in capsys.readouterr().out


@pytest.mark.parametrize("namespace, shipped, message", [
    ("me/repo", ["a"], "--namespace must be a Hub user or organisation name"),
    ("me", [], "holds no shipped models"),
])
def test_publish_refuses_a_bad_namespace_or_nothing_to_publish(tmp_path, capsys, namespace, shipped, message):
    _fake_shipped(tmp_path, shipped)
    assert zoo.main(["publish", "--namespace", namespace, "--shipped_dir", str(tmp_path), "--dry_run"]) == 1
    assert message in capsys.readouterr().err
