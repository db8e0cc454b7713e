"""Nothing lost, nothing silently wrong (issue 60) around the exporter and the project's model loaders.

* ``flexformers-export --overwrite`` replaces only a previous export (a folder carrying the export marker), never
  a folder that contains the checkpoint, other runs or anything the user made; a path that is a file is refused.
* The model card keeps text that comes from data (decoded samples, dataset names, config values) inside its code
  blocks and spans: a fence or raw HTML in a test sentence cannot close a block or inject markup.
* A separate-vocabulary model without ``source_tokenizer/`` is refused by decode and export (it would encode with
  the target vocabulary).
* A checkpoint missing a weight is refused by decode, export, ``flexformers-train --model_name_or_path`` and the
  methods' initialisation hooks, unless explicitly allowed; deliberate partial loads (Depth-Adaptive's second
  stage, MAT's proximal initialisation) still work.
* ``flexformers-quickstart`` / ``flexformers-zoo`` output folders, and the upload without network or token.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flexformers.training_scripts import decode, export_to_hub
from flexformers.training_scripts.export_to_hub import EXPORT_MARKER, ExportError, ExportOptions, export_checkpoint
from tests.test_hub_export import EVAL_RESULTS, TINY_TEXTS, baseline_checkpoint, tiny_tokenizer  # noqa: F401 (fixtures)

FC1_BIAS = "model.decoder.layers.0.ffn.fc1.bias"


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes (to show nothing changed)."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def one_line_error(capsys, tool: str) -> str:
    """The single error line the tool printed (progress bars of Transformers aside), with no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("flexformers-")]
    assert len(lines) == 1 and lines[0].startswith(f"flexformers-{tool}"), err
    return lines[0]


# ---------------------------------------------------------------------------------------------------------
# 1. --overwrite replaces a previous export only
# ---------------------------------------------------------------------------------------------------------


def make_run(run: Path, checkpoint: Path, steps=(10, 20, 30)) -> None:
    """A training output folder: the final model, checkpoints, the trainer state and evaluation results."""
    shutil.copytree(checkpoint, run)
    for step in steps:
        shutil.copytree(checkpoint, run / f"checkpoint-{step}")
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (run / "all_results.json").write_text(json.dumps({"train_loss": 3.5}))


def test_overwrite_refuses_the_run_folder_holding_the_checkpoint(tmp_path, baseline_checkpoint, capsys):
    run = tmp_path / "runs" / "x"
    make_run(run, baseline_checkpoint)
    before = tree(run)

    with pytest.raises(ExportError, match=r"contains the checkpoint .*checkpoint-30"):
        export_checkpoint(run / "checkpoint-30", run, ExportOptions(overwrite=True))
    assert export_to_hub.main([str(run / "checkpoint-30"), str(run), "--overwrite"]) == 1
    assert "contains the checkpoint" in one_line_error(capsys, "export")
    assert tree(run) == before
    assert sorted(path.name for path in (tmp_path / "runs").iterdir()) == ["x"]  # no staging left behind


def test_overwrite_refuses_a_folder_of_runs_holding_the_checkpoint(tmp_path, baseline_checkpoint):
    runs = tmp_path / "runs2"
    make_run(runs / "E", baseline_checkpoint, steps=(5,))
    make_run(runs / "A", baseline_checkpoint, steps=(7,))
    before = tree(runs)

    with pytest.raises(ExportError, match=r"runs2 contains the checkpoint .*runs2/E"):
        export_checkpoint(runs / "E", runs, ExportOptions(overwrite=True))
    assert tree(runs) == before


def test_overwrite_refuses_a_folder_the_exporter_did_not_make(tmp_path, baseline_checkpoint, capsys):
    other = tmp_path / "A"
    make_run(other, baseline_checkpoint, steps=(7,))
    before = tree(other)

    with pytest.raises(ExportError, match=f"not made by flexformers-export .*{re.escape(EXPORT_MARKER)}"):
        export_checkpoint(baseline_checkpoint, other, ExportOptions(overwrite=True))
    assert export_to_hub.main([str(baseline_checkpoint), str(other), "--overwrite"]) == 1
    assert "refusing to replace" in one_line_error(capsys, "export")
    assert tree(other) == before


def test_overwrite_replaces_a_previous_export(tmp_path, baseline_checkpoint):
    from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration

    out = export_checkpoint(baseline_checkpoint, tmp_path / "hub")
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert marker["checkpoint"] == str(baseline_checkpoint.resolve())
    assert "model.safetensors" in marker["files"] and "README.md" in marker["files"]
    (out / "README.md").write_text("stale card")  # a file the export wrote may change; it is replaced

    again = export_checkpoint(baseline_checkpoint, out, ExportOptions(overwrite=True))
    assert (again / "README.md").read_text() != "stale card" and (again / EXPORT_MARKER).is_file()
    FlexformerForConditionalGeneration.from_pretrained(str(again))  # the marker does not disturb loading
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint", "hub"]


def test_overwrite_refuses_an_export_holding_files_it_did_not_write(tmp_path, baseline_checkpoint):
    out = export_checkpoint(baseline_checkpoint, tmp_path / "hub")
    (out / "notes").mkdir()
    (out / "notes" / "mine.txt").write_text("the user's notes")
    with pytest.raises(ExportError, match=r"holds files the export did not write \(notes/mine.txt\)"):
        export_checkpoint(baseline_checkpoint, out, ExportOptions(overwrite=True))
    assert (out / "notes" / "mine.txt").read_text() == "the user's notes"


def test_output_inside_the_checkpoint_is_refused(tmp_path, baseline_checkpoint):
    before = tree(baseline_checkpoint)
    with pytest.raises(ExportError, match="is inside the checkpoint"):
        export_checkpoint(baseline_checkpoint, baseline_checkpoint / "hub")
    assert tree(baseline_checkpoint) == before


def test_output_that_is_a_file_is_refused(tmp_path, baseline_checkpoint, capsys):
    target = tmp_path / "hub"
    target.write_text("a file of the user's")
    for overwrite in ([], ["--overwrite"]):
        assert export_to_hub.main([str(baseline_checkpoint), str(target), *overwrite]) == 1
        assert "exists and is not a folder" in one_line_error(capsys, "export")
    assert target.read_text() == "a file of the user's"


def test_upload_leaves_out_the_export_marker(tmp_path, baseline_checkpoint, monkeypatch):
    import fnmatch

    import huggingface_hub

    uploads = []

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, **kwargs):
            pass

        def upload_folder(self, **kwargs):
            uploads.append(kwargs)
            return "https://huggingface.co/someone/tiny/commit/abc"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    out = export_checkpoint(baseline_checkpoint, tmp_path / "hub")
    export_to_hub.push_folder_to_hub(out, "someone/tiny")
    patterns = uploads[0]["ignore_patterns"]
    patterns = [patterns] if isinstance(patterns, str) else patterns
    assert any(fnmatch.fnmatch(EXPORT_MARKER, pattern) for pattern in patterns)
    assert not any(fnmatch.fnmatch("model.safetensors", pattern) for pattern in patterns)


def test_upload_without_network_or_token_is_one_line_and_keeps_the_folder(tmp_path, baseline_checkpoint, capsys,
                                                                           monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "hub"
    argv = [str(baseline_checkpoint), str(out), "--push_to_hub", "--hub_model_id", "someone/tiny"]
    assert export_to_hub.main(argv) == 1
    line = one_line_error(capsys, "export")
    assert "uploading" in line and "kept" in line
    assert (out / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------------------
# 2. Data text in the model card stays inside its blocks
# ---------------------------------------------------------------------------------------------------------

EVIL_ROWS = [
    {"source": "print('a')\n```\n<script>alert(1)</script>\n~~~~\nafter",
     "reference": "</code></pre><img src=x onerror=alert(1)>",
     "hypothesis": "~~~~~~~~\n# not a heading\n<iframe src=javascript:alert(1)></iframe>"},
    {"source": "`tick` | pipe <b>bold</b>", "reference": "plain", "hypothesis": "````"},
]


def markdown_outside_code(markdown: str) -> tuple[str, list[str]]:
    """(the text outside fenced code blocks and code spans, the contents of each fenced block), per CommonMark:
    a block closes only on a fence of its own character at least as long as the one that opened it."""
    body = markdown.split("\n---\n", 1)[1] if markdown.startswith("---\n") else markdown  # past the YAML metadata
    outside, blocks, fence, block = [], [], None, []
    for line in body.split("\n"):
        if fence is None:
            opening = re.match(r"^ {0,3}(`{3,}|~{3,})(.*)$", line)
            if opening and not (opening.group(1)[0] == "`" and "`" in opening.group(2)):
                fence, block = opening.group(1), []
                continue
            outside.append(re.sub(r"(?<!`)(`+)(?!`).*?(?<!`)\1(?!`)", "", line))
        else:
            if re.match(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$", line):
                blocks.append("\n".join(block))
                fence = None
            else:
                block.append(line)
    assert fence is None, "a code block is left open"
    return "\n".join(outside), blocks


def test_card_keeps_data_text_inside_code_blocks_and_spans(tmp_path, baseline_checkpoint):
    (baseline_checkpoint / "generations.test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in EVIL_ROWS))
    evil_dataset = "data <b onmouseover=alert(1)>x</b> ``tick`` | pipe"
    (baseline_checkpoint / "eval_results.json").write_text(json.dumps(dict(EVAL_RESULTS, dataset=evil_dataset)))
    config = json.loads((baseline_checkpoint / "config.json").read_text())
    config["note"] = "x | <script>alert(2)</script> ``` y"
    (baseline_checkpoint / "config.json").write_text(json.dumps(config))

    card = (export_checkpoint(baseline_checkpoint, tmp_path / "hub") / "README.md").read_text()
    outside, blocks = markdown_outside_code(card)
    assert not re.search(r"<[A-Za-z!/?]", outside), [line for line in outside.splitlines() if "<" in line]
    samples = [block for block in blocks if block.startswith("source:")]
    assert len(samples) == 2
    for row, block in zip(EVIL_ROWS, samples):
        assert block == f"source:    {row['source']}\nreference: {row['reference']}\noutput:    {row['hypothesis']}"
    # the config value stays one row of its table (its pipe escaped) and the dataset name one code span
    note_rows = [line for line in card.splitlines() if line.startswith("| `note` |")]
    assert len(note_rows) == 1 and len(re.findall(r"(?<!\\)\|", note_rows[0])) == 3
    assert "<script>alert(2)</script>" in note_rows[0]  # shown literally, inside a code span
    assert card.count(evil_dataset) >= 1


# ---------------------------------------------------------------------------------------------------------
# 3. Separate vocabularies need their source tokenizer
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def separate_vocab_checkpoint(tmp_path):
    from flexformers.configuration.configuration_flexformer import FlexformerConfig
    from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration
    from flexformers.training_scripts.tokenizer import build_tokenizers, save_tokenizers
    from tests.conftest import tiny_config_kwargs

    source, target = build_tokenizers(
        TINY_TEXTS[::2] * 4, TINY_TEXTS[1::2] * 4, joint=False, vocab_size=270, target_vocab_size=265, min_frequency=1
    )
    config = FlexformerConfig(
        **tiny_config_kwargs(vocab_size=len(source), target_vocab_size=len(target), share_all_embeddings=False)
    )
    checkpoint = tmp_path / "separate"
    FlexformerForConditionalGeneration(config).save_pretrained(str(checkpoint))
    save_tokenizers(checkpoint, source, target)
    (checkpoint / "eval_results.json").write_text(json.dumps(EVAL_RESULTS))
    return checkpoint


def test_separate_vocabularies_load_both_tokenizers(separate_vocab_checkpoint):
    from flexformers.training_scripts.tokenizer import load_tokenizers

    source, target = load_tokenizers(separate_vocab_checkpoint)
    assert source is not target and (len(source), len(target)) == (270, 265)


def test_missing_source_tokenizer_is_refused_by_decode_and_export(tmp_path, separate_vocab_checkpoint, capsys):
    from flexformers.training_scripts.tokenizer import load_tokenizers

    shutil.rmtree(separate_vocab_checkpoint / "source_tokenizer")
    message = "separate source and target vocabularies, but source_tokenizer/tokenizer.json is missing"
    with pytest.raises(ValueError, match=message):
        load_tokenizers(separate_vocab_checkpoint)
    with pytest.raises(ValueError, match=message):
        decode.load_model(separate_vocab_checkpoint)
    assert decode.main(["--model_name_or_path", str(separate_vocab_checkpoint), "--text", "the cat"]) == 1
    assert message in one_line_error(capsys, "decode")
    with pytest.raises(ExportError, match=message):
        export_checkpoint(separate_vocab_checkpoint, tmp_path / "hub")
    assert not (tmp_path / "hub").exists()


def test_joint_model_with_a_stray_source_tokenizer_is_refused(tmp_path, baseline_checkpoint, tiny_tokenizer):
    from flexformers.training_scripts.tokenizer import load_tokenizers

    tiny_tokenizer.save_pretrained(str(baseline_checkpoint / "source_tokenizer"))
    with pytest.raises(ValueError, match="one joint vocabulary, but .*source_tokenizer exists"):
        load_tokenizers(baseline_checkpoint)


def test_tokenizer_directory_without_a_model_config_still_loads(tmp_path, tiny_tokenizer):
    from flexformers.training_scripts.tokenizer import load_tokenizers

    tiny_tokenizer.save_pretrained(str(tmp_path / "tok"))
    source, target = load_tokenizers(tmp_path / "tok")
    assert source is target and len(target) == len(tiny_tokenizer)


# ---------------------------------------------------------------------------------------------------------
# 4. Missing weights are refused unless allowed
# ---------------------------------------------------------------------------------------------------------


def remove_tensor(checkpoint: Path, name: str) -> None:
    path = checkpoint / "model.safetensors"
    tensors = load_file(str(path))
    assert name in tensors
    del tensors[name]
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_decode_refuses_a_missing_weight_unless_allowed(baseline_checkpoint, capsys):
    remove_tensor(baseline_checkpoint, FC1_BIAS)
    argv = ["--model_name_or_path", str(baseline_checkpoint), "--text", "the cat", "--num_beams", "1",
            "--max_new_tokens", "3"]
    assert decode.main(argv) == 1
    line = one_line_error(capsys, "decode")
    assert f"missing from the checkpoint (they would be randomly initialised): {FC1_BIAS}" in line
    assert "--allow_missing_weights" in line

    assert decode.main([*argv, "--allow_missing_weights"]) == 0
    assert "OUTPUT:" in capsys.readouterr().out


@pytest.fixture
def tied_checkpoint(tmp_path, tiny_tokenizer):
    """Shared embeddings: the file holds one tensor for the encoder, decoder and output embeddings."""
    checkpoint = _save_tiny("flexformer", tmp_path / "tied", vocab_size=len(tiny_tokenizer), share_all_embeddings=True)
    tiny_tokenizer.save_pretrained(str(checkpoint))
    assert "lm_head.weight" not in load_file(str(checkpoint / "model.safetensors"))
    return checkpoint


def test_a_complete_tied_checkpoint_loads(tied_checkpoint):
    model, _, _ = decode.load_model(tied_checkpoint)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    saved = load_file(str(tied_checkpoint / "model.safetensors"))["model.encoder.embed_tokens.weight"]
    assert torch.equal(model.get_output_embeddings().weight, saved)


def test_a_tied_embedding_absent_from_the_file_is_reported(tied_checkpoint):
    """Transformers leaves a tied group with no tensor in the file out of missing_keys: it would be random."""
    remove_tensor(tied_checkpoint, "model.encoder.embed_tokens.weight")
    with pytest.raises(ValueError, match="missing from the checkpoint .*embed_tokens"):
        decode.load_model(tied_checkpoint)


def test_export_refuses_a_missing_weight(tmp_path, baseline_checkpoint):
    remove_tensor(baseline_checkpoint, FC1_BIAS)
    with pytest.raises(ExportError, match=re.escape(FC1_BIAS)):
        export_checkpoint(baseline_checkpoint, tmp_path / "hub")
    assert not (tmp_path / "hub").exists()


def test_export_refuses_an_unexpected_weight(tmp_path, baseline_checkpoint):
    path = baseline_checkpoint / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.decoder.extra_gate.weight"] = torch.zeros(3)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ExportError, match="does not have: model.decoder.extra_gate.weight"):
        export_checkpoint(baseline_checkpoint, tmp_path / "hub")


def test_train_model_name_or_path_refuses_a_missing_weight(tmp_path, baseline_checkpoint, capsys):
    from flexformers.training_scripts import train
    from tests.test_training import SOURCES

    remove_tensor(baseline_checkpoint, FC1_BIAS)
    argv = [
        "--model_type", "flexformer", "--model_name_or_path", str(baseline_checkpoint),
        "--python_source_dirs", *SOURCES, "--max_source_length", "64", "--max_target_length", "64",
        "--output_dir", str(tmp_path / "run"), "--do_train", "--max_steps", "1", "--per_device_train_batch_size", "2",
        "--eval_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "true",
    ]
    assert train.main(argv) == 1
    line = one_line_error(capsys, "train")
    assert FC1_BIAS in line and "--allow_missing_weights" in line
    assert not (tmp_path / "run" / "model.safetensors").exists()

    assert train.main([*argv, "--allow_missing_weights", "true"]) == 0  # asked for: trains, the bias starts anew
    assert FC1_BIAS in load_file(str(tmp_path / "run" / "model.safetensors"))


def test_default_build_model_allows_missing_weights_when_asked(baseline_checkpoint):
    from types import SimpleNamespace

    from flexformers.configuration.configuration_flexformer import FlexformerConfig
    from flexformers.training_scripts.model_registry import get_method_spec

    remove_tensor(baseline_checkpoint, FC1_BIAS)
    spec = get_method_spec("flexformer")
    config = FlexformerConfig.from_pretrained(str(baseline_checkpoint))
    with pytest.raises(ValueError, match=re.escape(FC1_BIAS)):
        spec.make_model(SimpleNamespace(model_name_or_path=str(baseline_checkpoint)), None, config, None)
    model = spec.make_model(
        SimpleNamespace(model_name_or_path=str(baseline_checkpoint), allow_missing_weights=True), None, config, None
    )
    assert model.config.encoder_layers == config.encoder_layers


def _save_tiny(model_type: str, folder: Path, **overrides) -> Path:
    from flexformers.training_scripts.model_registry import get_method_spec
    from tests.conftest import tiny_config_kwargs

    spec = get_method_spec(model_type)
    torch.manual_seed(0)
    spec.model_class(spec.config_class(**tiny_config_kwargs(**overrides))).save_pretrained(str(folder))
    return folder


def test_indigo_initialisation_refuses_a_missing_weight(tmp_path):
    from types import SimpleNamespace

    from flexformers.training_scripts.model_registry import get_method_spec

    checkpoint = _save_tiny("indigo", tmp_path / "indigo")
    spec = get_method_spec("indigo")
    config = spec.config_class.from_pretrained(str(checkpoint))
    spec.make_model(SimpleNamespace(model_name_or_path=str(checkpoint)), None, config, None)  # complete: loads
    remove_tensor(checkpoint, FC1_BIAS)
    with pytest.raises(ValueError, match=re.escape(FC1_BIAS)):
        spec.make_model(SimpleNamespace(model_name_or_path=str(checkpoint)), None, config, None)


def test_depth_adaptive_second_stage_initialises_only_the_new_halting_weights(tmp_path):
    from types import SimpleNamespace

    from flexformers.training_scripts.methods.depth_adaptive import DepthAdaptiveArguments
    from flexformers.training_scripts.model_registry import get_method_spec

    checkpoint = _save_tiny("depth_adaptive", tmp_path / "stage-one")
    spec = get_method_spec("depth_adaptive")
    config = spec.config_class.from_pretrained(str(checkpoint))
    stage_two = DepthAdaptiveArguments(da_halting_mechanism="token_geometric", da_oracle="likelihood",
                                       da_exit_loss_alpha=0.1)
    model = spec.make_model(SimpleNamespace(model_name_or_path=str(checkpoint)), stage_two, config, None)
    loaded = load_file(str(checkpoint / "model.safetensors"))
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in loaded.items())
    assert set(state) - set(loaded) - {"lm_head.weight", "model.decoder.embed_tokens.weight"}  # halting: new

    remove_tensor(checkpoint, FC1_BIAS)
    with pytest.raises(ValueError, match=re.escape(FC1_BIAS)):
        spec.make_model(SimpleNamespace(model_name_or_path=str(checkpoint)), stage_two, config, None)


def test_mat_proximal_initialisation_refuses_an_incomplete_baseline(tmp_path):
    from types import SimpleNamespace

    from flexformers.training_scripts.methods.mat import MATArguments
    from flexformers.training_scripts.model_registry import get_method_spec
    from tests.conftest import tiny_config_kwargs

    baseline = _save_tiny("flexformer", tmp_path / "baseline")
    spec = get_method_spec("mat")
    config = spec.config_class(**tiny_config_kwargs())
    model = spec.make_model(SimpleNamespace(model_name_or_path=None), MATArguments(baseline_checkpoint=str(baseline)),
                            config, None)
    assert model.config.model_type == "mat"
    remove_tensor(baseline, FC1_BIAS)
    with pytest.raises(ValueError, match=re.escape(FC1_BIAS)):
        spec.make_model(SimpleNamespace(model_name_or_path=None), MATArguments(baseline_checkpoint=str(baseline)),
                        config, None)


def test_a_method_initialised_from_a_plain_flexformer_checkpoint_starts_only_its_own_weights_anew(tmp_path):
    """``--model_type iot --model_name_or_path <flexformer>``: IOT's order predictor is new (deliberately), every
    backbone weight comes from the checkpoint, and a backbone weight missing from the file is still refused."""
    from types import SimpleNamespace

    from flexformers.training_scripts.model_registry import get_method_spec

    checkpoint = _save_tiny("flexformer", tmp_path / "baseline")
    spec = get_method_spec("iot")
    config = spec.config_class.from_pretrained(str(checkpoint))
    model = spec.make_model(SimpleNamespace(model_name_or_path=str(checkpoint)), None, config, None)
    loaded = load_file(str(checkpoint / "model.safetensors"))
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in loaded.items())
    remove_tensor(checkpoint, FC1_BIAS)
    with pytest.raises(ValueError, match=re.escape(FC1_BIAS)):
        spec.make_model(SimpleNamespace(model_name_or_path=str(checkpoint)), None, config, None)


# ---------------------------------------------------------------------------------------------------------
# 5. The quickstart's and the zoo's output folders
# ---------------------------------------------------------------------------------------------------------


def test_quickstart_into_another_runs_folder_is_one_line_and_keeps_it(tmp_path, baseline_checkpoint, capsys):
    from flexformers.training_scripts import quickstart

    run = tmp_path / "qs"
    make_run(run, baseline_checkpoint, steps=(5,))
    before = tree(run)
    assert quickstart.main(["--smoke", "--max_steps", "2", "--output_dir", str(run)]) == 1
    line = one_line_error(capsys, "quickstart")
    assert "holds the files of another run" in line and "--overwrite_output_dir" in line
    after = {name: data for name, data in tree(run).items() if not name.endswith(".lock")}  # training's lock file
    assert after == before


def test_quickstart_passes_overwrite_output_dir_to_training():
    from flexformers.training_scripts import quickstart

    args = quickstart.build_parser().parse_args(["--overwrite_output_dir", "--output_dir", "x"])
    argv = quickstart.training_argv(args, quickstart.TASKS["word_order"], 1.0)
    assert argv[argv.index("--overwrite_output_dir") + 1] == "true"
    args = quickstart.build_parser().parse_args(["--output_dir", "x"])
    assert "--overwrite_output_dir" not in quickstart.training_argv(args, quickstart.TASKS["word_order"], 1.0)


def test_zoo_export_replaces_its_previous_export_but_refuses_anything_else(tmp_path, baseline_checkpoint):
    from flexformers.training_scripts import zoo_runner

    hub_dir = tmp_path / "runs" / "hub" / "base"
    hub_dir.mkdir(parents=True)
    (hub_dir / "notes.txt").write_text("the user's")
    with pytest.raises(ValueError, match=r"refusing to replace .*hub/base.*--no_export"):
        zoo_runner.export_hub_folder(baseline_checkpoint, hub_dir)
    assert (hub_dir / "notes.txt").read_text() == "the user's"

    (hub_dir / "notes.txt").unlink()
    zoo_runner.export_hub_folder(baseline_checkpoint, hub_dir)
    zoo_runner.export_hub_folder(baseline_checkpoint, hub_dir)  # a re-evaluation replaces the zoo's own export
    assert (hub_dir / "model.safetensors").is_file() and (hub_dir / EXPORT_MARKER).is_file()


def test_disk_full_while_exporting_is_one_line_and_leaves_nothing(tmp_path, baseline_checkpoint, capsys, monkeypatch):
    import errno

    real_write_text = Path.write_text

    def full_disk(path, *args, **kwargs):
        if path.name == "README.md":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_write_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    assert export_to_hub.main([str(baseline_checkpoint), str(tmp_path / "hub")]) == 1
    line = one_line_error(capsys, "export")
    assert "No space left on device" in line and "the export was not made" in line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint"]


def test_overwriting_keeps_no_retired_copy_and_survives_a_stale_one(tmp_path, baseline_checkpoint):
    import os

    out = export_checkpoint(baseline_checkpoint, tmp_path / "hub")
    stale = tmp_path / f".hub.old-{os.getpid()}"
    (stale / "x").mkdir(parents=True)  # a leftover of an interrupted export, under the name it used to reuse
    export_checkpoint(baseline_checkpoint, out, ExportOptions(overwrite=True))
    assert sorted(path.name for path in tmp_path.iterdir()) == [stale.name, "checkpoint", "hub"]
