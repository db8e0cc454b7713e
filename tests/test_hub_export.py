"""Hub export (``training_scripts/export_to_hub.py``, ``hub_cards/``).

* Flattening the remote code, on synthetic package trees (what is followed, what is rewritten, what is refused).
* Card templates: every method's card renders and validates with ``ModelCard.load(..., ignore_metadata_errors=False)``.
* Export of a real (tiny) checkpoint: the folder's contents, and clear failures that leave nothing behind.
* The acceptance test in a clean virtual environment is ``tests/test_hub_clean_venv.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from flexformers.training_scripts import export_to_hub
from flexformers.training_scripts.export_to_hub import (
    ExportError,
    ExportOptions,
    check_flat_remote_code,
    collect_remote_code,
    export_checkpoint,
    render_model_card,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
CARD_TYPES = ("flexformer", "iot", "mat", "indigo", "depth_adaptive")

EVAL_RESULTS = {
    "task": "translation",
    "dataset": "gettext-en-de",
    "split": "test",
    "num_examples": 10,
    "metrics": {"bleu": 12.34, "chrf": 40.5, "ter": 80.25},
    "sacrebleu_signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0",
    "chrf_signature": "nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:2.6.0",
    "ter_signature": "nrefs:1|case:lc|tok:tercom|norm:no|punct:yes|asian:no|version:2.6.0",
    "num_beams": 3,
    "length_penalty": 1.2,
    "max_new_tokens": 12,
}


# ---------------------------------------------------------------------------------------------------------
# Model types present in this checkout (discovered, never listed by hand)
# ---------------------------------------------------------------------------------------------------------


def discovered_model_types() -> list[str]:
    """Every model type with a method module or a modeling file: a modeling file without a method module (or
    the reverse) is a failure of that type's tests, not a silent skip."""
    from flexformers.training_scripts.model_registry import available_model_types

    from_files = {path.stem[len("modeling_"):] for path in (REPO_ROOT / "modeling").glob("modeling_*.py")}
    return sorted(set(available_model_types()) | from_files)


MODEL_TYPES = discovered_model_types()


# ---------------------------------------------------------------------------------------------------------
# Flattening on synthetic package trees
# ---------------------------------------------------------------------------------------------------------


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return root


GOOD_TREE = {
    "configuration/__init__.py": "from .configuration_base import BaseConfig\n",
    "configuration/configuration_base.py": """\
        from __future__ import annotations

        import math


        class BaseConfig:
            scale = math.sqrt(4)
    """,
    "configuration/configuration_child.py": """\
        from .configuration_base import BaseConfig


        class ChildConfig(BaseConfig):
            name = "child"
    """,
    "modeling/__init__.py": "import sys  # the package init registers things; never copied\n",
    "modeling/modeling_base.py": """\
        import collections
        from flexformers.configuration.configuration_base import BaseConfig


        class BaseModel:
            config_class = BaseConfig
    """,
    "modeling/modeling_child.py": """\
        \"\"\"Docstring mentioning configuration.configuration_child in prose stays as it is.\"\"\"
        from flexformers.configuration.configuration_child import (  # the config, rewritten
            ChildConfig,
        )

        from .modeling_base import BaseModel


        class ChildModel(BaseModel):
            config_class = ChildConfig


        def lazy_config():
            from configuration . configuration_base import BaseConfig as Base  # odd spacing is legal Python
            return Base
    """,
    "modeling/modeling_unused.py": "import numpy\n",
}


def test_flatten_follows_imports_and_rewrites_only_project_absolute_ones(tmp_path):
    root = write_tree(tmp_path / "src", GOOD_TREE)
    files = collect_remote_code([root / "modeling/modeling_child.py", root / "configuration/configuration_child.py"])

    assert sorted(files) == ["configuration_base.py", "configuration_child.py", "modeling_base.py", "modeling_child.py"]
    child = files["modeling_child.py"]
    assert "from .configuration_child import (  # the config, rewritten\n    ChildConfig,\n)" in child
    assert "    from .configuration_base import BaseConfig as Base  # odd spacing is legal Python" in child
    assert "from .modeling_base import BaseModel" in child
    assert "Docstring mentioning configuration.configuration_child in prose" in child
    assert files["modeling_base.py"] == (root / "modeling/modeling_base.py").read_text().replace(
        "from flexformers.configuration.configuration_base", "from .configuration_base"
    )
    # Files that needed no rewrite are copied byte for byte.
    assert files["configuration_child.py"] == (root / "configuration/configuration_child.py").read_text()
    for text in files.values():
        assert not re.search(r"^\s*from\s+(configuration|modeling)\b", text, flags=re.MULTILINE)


def test_flattened_tree_imports_as_one_package_without_the_project_packages(tmp_path):
    root = write_tree(tmp_path / "src", GOOD_TREE)
    files = collect_remote_code([root / "modeling/modeling_child.py"])
    package = tmp_path / "elsewhere" / "flat_remote"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for name, text in files.items():
        (package / name).write_text(text)
    check_flat_remote_code(package, ["modeling_child.py"])
    script = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('configuration') is None\n"
        "from flat_remote.modeling_child import ChildModel, lazy_config\n"
        "assert ChildModel.config_class.name == 'child' and lazy_config().scale == 2.0\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        # -S: no site-packages, where this checkout is installed (editable) and `configuration` would import.
        [sys.executable, "-I", "-S", "-c", f"import sys; sys.path.insert(0, {str(package.parent)!r})\n{script}"],
        cwd=tmp_path / "elsewhere", capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize(
    "statement, message",
    [
        ("import numpy", r"modeling_child.py:1: .*found `import numpy`"),
        ("from training_scripts.data import load_corpus", r"found `from training_scripts.data import \.\.\.`"),
        ("import configuration.configuration_base", r"`import configuration.configuration_base` cannot be flattened"),
        ("from configuration import configuration_base", r"`from configuration import \.\.\.` cannot be flattened"),
        ("from . import modeling_base", r"`from \. import modeling_base` is not followed"),
        ("from ..configuration import configuration_base", r"reaches outside its package"),
        ("from .missing_module import Thing", r"missing_module.py does not exist"),
        ("from configuration.configuration_missing import Thing", r"configuration_missing.py does not exist"),
        ("from flexformers.training_scripts.data import load_corpus", r"`from flexformers.training_scripts.data import \.\.\.` cannot"),
        ("from flexformers import FlexformerConfig", r"`from flexformers import \.\.\.` cannot be flattened"),
        ("import flexformers.configuration.configuration_base", r"`import flexformers.configuration.configuration_base` cannot"),
        ("from flexformers.configuration import configuration_base", r"`from flexformers.configuration import \.\.\.` cannot"),
        ("from flexformers.configuration.configuration_missing import Thing", r"configuration_missing.py does not exist"),
        ("from .sub.module import Thing", r"sub-package"),
        ("def f():\n    import pandas", r"modeling_child.py:2: .*`import pandas`"),
        ("try:\n    import numpy\nexcept ImportError:\n    numpy = None", r"`import numpy`"),
    ],
)
def test_flatten_refuses_imports_the_user_side_cannot_satisfy(tmp_path, statement, message):
    root = write_tree(tmp_path / "src", {**GOOD_TREE, "modeling/modeling_child.py": statement + "\n"})
    with pytest.raises(ExportError, match=message):
        collect_remote_code([root / "modeling/modeling_child.py"])


def test_flatten_refuses_duplicate_file_names_across_packages(tmp_path):
    root = write_tree(
        tmp_path / "src",
        {
            "configuration/common.py": "X = 1\n",
            "configuration/configuration_a.py": "from .common import X\n",
            "modeling/common.py": "Y = 2\n",
            "modeling/modeling_a.py": "from configuration.configuration_a import X\nfrom .common import Y\n",
        },
    )
    with pytest.raises(ExportError, match="file names must be unique"):
        collect_remote_code([root / "modeling/modeling_a.py"])


def test_flatten_refuses_a_root_file_outside_the_packages(tmp_path):
    root = write_tree(tmp_path / "src", {**GOOD_TREE, "tools/helper.py": "X = 1\n"})
    with pytest.raises(ExportError, match="not in one of the packages"):
        collect_remote_code([root / "tools/helper.py"], source_root=root)


def test_flat_folder_check_catches_what_transformers_would_copy(tmp_path):
    folder = write_tree(
        tmp_path / "flat",
        {"modeling_x.py": 'DOC = """\nfrom .not_here import Thing\n"""\n'},
    )
    with pytest.raises(ExportError, match="not_here.py, which is not in the folder"):
        check_flat_remote_code(folder, ["modeling_x.py"])


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_project_remote_code_of_every_model_type_is_flat(tmp_path, model_type):
    classes = export_to_hub.resolve_model_type(model_type)
    files = collect_remote_code(classes.root_files())
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    entries = sorted({entry.split(".")[0] + ".py" for entry in classes.auto_map().values()})
    check_flat_remote_code(tmp_path, entries)
    assert "modeling_flexformer.py" in files and "configuration_flexformer.py" in files
    assert (REPO_ROOT / "hub_cards" / f"{model_type}.md").is_file(), f"no card template for {model_type}"


# ---------------------------------------------------------------------------------------------------------
# Cards
# ---------------------------------------------------------------------------------------------------------


def render(model_type, eval_results=EVAL_RESULTS, **overrides):
    kwargs = dict(
        model_type=model_type,
        model_id=f"someone/{model_type}-tiny",
        config={"encoder_layers": 2, "decoder_layers": 2, "encoder_embed_dim": 32, "dropout": 0.1},
        generation_config={"num_beams": 3, "length_penalty": 1.2, "decoder_start_token_id": 2, "exit_threshold": 0.9},
        eval_results=eval_results,
        training={"global_step": 30, "final_train_loss": 3.8, "training_data": "gettext-en-de"},
        num_parameters=123456,
        auto_map={"AutoModelForSeq2SeqLM": f"modeling_{model_type}.X"},
        language=["en", "de"],
        license="apache-2.0",
    )
    kwargs.update(overrides)
    return render_model_card(**kwargs)


@pytest.mark.parametrize("model_type", CARD_TYPES)
def test_every_card_renders_and_validates_with_a_model_index(tmp_path, model_type):
    from huggingface_hub import ModelCard

    path = tmp_path / "README.md"
    path.write_text(render(model_type))
    card = ModelCard.load(path, ignore_metadata_errors=False)

    assert card.data.model_name == f"{model_type}-tiny"
    scores = {result.metric_type: result.metric_value for result in card.data.eval_results}
    assert scores == EVAL_RESULTS["metrics"]
    bleu = next(result for result in card.data.eval_results if result.metric_type == "bleu")
    assert bleu.metric_config == EVAL_RESULTS["sacrebleu_signature"]
    assert bleu.dataset_split == "test" and bleu.task_type == "translation"
    assert "flexformers" in card.data.tags and model_type in card.data.tags
    text = card.text
    assert re.search(r"```bibtex\n@\w+\{\w+,\n  title\s+= \{", text), "citation as BibTeX"
    assert 'AutoModelForSeq2SeqLM.from_pretrained("someone/' in text and "trust_remote_code=True" in text
    assert "| `num_beams` | `3` |" in text
    assert "## Limitations" in text and "Training data: `gettext-en-de`" in text
    assert not re.search(r"\{\{ |\{%", text), "unrendered template syntax"


def _model_index_dataset(tmp_path, **overrides):
    from huggingface_hub import ModelCard

    path = tmp_path / "README.md"
    path.write_text(render("flexformer", **overrides))
    card = ModelCard.load(path, ignore_metadata_errors=False)
    return card.data, card.content


def test_model_index_names_the_dataset_given_with_its_config_not_the_data_file(tmp_path):
    """`--dataset user/corpus --dataset_config de-en` on a run trained from files: the model-index names that
    dataset and config, where it used to name the corpus after the file (`train.tsv`)."""
    results = dict(EVAL_RESULTS, task="files", dataset="train.tsv")
    data, content = _model_index_dataset(tmp_path, eval_results=results, datasets=["user/corpus"],
                                         dataset_config="de-en")
    for result in data.eval_results:
        assert (result.dataset_type, result.dataset_config) == ("user/corpus", "de-en")
        assert result.dataset_name == "user/corpus (de-en)"
    assert data.datasets == ["user/corpus"]
    assert "train.tsv" not in content.split("---")[1]


def test_model_index_takes_the_hub_dataset_a_hub_task_run_recorded(tmp_path):
    results = dict(EVAL_RESULTS, task="hub", dataset="wmt16/de-en", dataset_id="wmt16", dataset_config="de-en")
    data, _ = _model_index_dataset(tmp_path, eval_results=results)
    assert {(r.dataset_type, r.dataset_config, r.dataset_name) for r in data.eval_results} == {
        ("wmt16", "de-en", "wmt16 (de-en)")}
    assert data.datasets == ["wmt16"]


def test_model_index_without_a_hub_dataset_keeps_the_corpus_name(tmp_path):
    data, _ = _model_index_dataset(tmp_path)
    assert {(r.dataset_type, r.dataset_name, r.dataset_config) for r in data.eval_results} == {
        ("gettext-en-de", "gettext-en-de", None)}


def test_decode_records_a_hub_dataset_id_and_config_but_not_a_local_folder(tmp_path):
    from flexformers.training_scripts.arguments import DataArguments, hub_dataset_reference

    hub = DataArguments(task="hub", dataset_name="wmt16", dataset_config_name="de-en")
    assert hub_dataset_reference(hub) == {"dataset_id": "wmt16", "dataset_config": "de-en"}
    local = DataArguments(task="hub", dataset_name=str(tmp_path))
    assert hub_dataset_reference(local) == {}
    assert hub_dataset_reference(DataArguments(task="translation")) == {}


def test_card_without_evaluation_has_no_model_index(tmp_path):
    from huggingface_hub import ModelCard

    path = tmp_path / "README.md"
    path.write_text(render("flexformer", eval_results=None))
    card = ModelCard.load(path, ignore_metadata_errors=False)
    assert card.data.eval_results is None
    assert "model-index" not in path.read_text()
    assert "exported without an evaluation" in card.text


def test_code_generation_card_reports_pov_under_a_generic_task():
    from huggingface_hub import ModelCard

    results = {**EVAL_RESULTS, "task": "codegen", "dataset": "python-stdlib-docstring-to-code"}
    results["metrics"] = {**EVAL_RESULTS["metrics"], "pov": 91.0}
    card = ModelCard(render("flexformer", eval_results=results), ignore_metadata_errors=False)
    pov = next(result for result in card.data.eval_results if result.metric_type == "pov")
    assert pov.metric_value == 91.0 and pov.task_type == "text2text-generation"


def test_an_indigo_card_names_the_insertion_step_positions_ablation():
    """The InDIGO card says the decoder has no absolute positions — unless the checkpoint is the
    ``decoder_use_positions`` ablation, which its card then names."""
    paper = render("indigo", config={"decoder_use_positions": False})
    ablation = render("indigo", config={"decoder_use_positions": True})
    assert "decoder has no absolute positions;" in paper and "insertion step" not in paper
    assert "insertion step, `decoder_use_positions`" in ablation


def test_unknown_model_type_has_no_card():
    with pytest.raises(ExportError, match="no model card template"):
        render("not_a_method")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"metrics": {"bleu": "high"}}, "metric 'bleu' must be a finite number"),
        ({"metrics": {}}, "'metrics' must be a non-empty object"),
        ({"split": ""}, "'split' must be a non-empty string"),
        ({"num_beams": 0}, "'num_beams' must be a positive integer"),
    ],
)
def test_bad_eval_results_are_refused_by_name(tmp_path, change, message):
    (tmp_path / "eval_results.json").write_text(json.dumps({**EVAL_RESULTS, **change}))
    with pytest.raises(ExportError, match=message):
        export_to_hub.read_eval_results(tmp_path)


def test_eval_results_missing_a_field(tmp_path):
    results = dict(EVAL_RESULTS)
    del results["dataset"]
    (tmp_path / "eval_results.json").write_text(json.dumps(results))
    with pytest.raises(ExportError, match="lacks the field 'dataset'.*run flexformers-decode"):
        export_to_hub.read_eval_results(tmp_path)


def test_trainer_metrics_in_place_of_the_evaluation_are_recognised(tmp_path):
    (tmp_path / "eval_results.json").write_text(json.dumps({"epoch": 3.0, "eval_loss": 2.5, "eval_bleu": 10.0}))
    with pytest.raises(ExportError, match="look like Trainer.save_metrics output"):
        export_to_hub.read_eval_results(tmp_path)


# ---------------------------------------------------------------------------------------------------------
# Export of a real checkpoint (baseline, untrained: fast)
# ---------------------------------------------------------------------------------------------------------

TINY_TEXTS = [
    "the cat sees a dog", "der hund sieht eine katze", "a big red house", "ein grosses rotes haus",
    "small blue tree", "kleiner blauer baum", "the dog runs and jumps", "der hund rennt und springt",
]


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from flexformers.training_scripts.tokenizer import train_bpe_tokenizer

    return train_bpe_tokenizer(TINY_TEXTS * 4, vocab_size=280, min_frequency=1)


@pytest.fixture
def baseline_checkpoint(tmp_path, tiny_tokenizer):
    from flexformers.configuration.configuration_flexformer import FlexformerConfig
    from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration
    from tests.conftest import tiny_config_kwargs

    torch.manual_seed(0)
    config = FlexformerConfig(**tiny_config_kwargs(vocab_size=len(tiny_tokenizer)))
    model = FlexformerForConditionalGeneration(config)
    checkpoint = tmp_path / "checkpoint"
    model.save_pretrained(str(checkpoint))
    tiny_tokenizer.save_pretrained(str(checkpoint))
    (checkpoint / "eval_results.json").write_text(json.dumps(EVAL_RESULTS))
    return checkpoint


def leftovers(parent: Path) -> list[str]:
    return sorted(path.name for path in parent.iterdir() if ".export-" in path.name or ".old-" in path.name)


def test_export_writes_a_complete_hub_folder(tmp_path, baseline_checkpoint):
    from huggingface_hub import ModelCard

    from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration

    out = export_checkpoint(baseline_checkpoint, tmp_path / "hub", ExportOptions(hub_model_id="someone/tiny"))

    names = sorted(path.name for path in out.iterdir())
    # the backbone's model file and the sibling modules it imports (each idea in its own file), and the marker that
    # lets --overwrite replace this folder (left out of the upload), nothing else
    assert names == [
        ".flexformers-export.json",
        "README.md", "backbone_blocks.py", "backbone_sublayers.py", "branch_merge.py", "config.json", "configuration_flexformer.py",
        "cpu_kernels.py", "generation_config.json", "generation_hooks.py", "kv_caches.py", "losses.py",
        "model.safetensors", "modeling_flexformer.py", "output_recording.py", "positional_embeddings.py",
        "sublayer_order.py",
        "tokenizer.json", "tokenizer_config.json", "transformers_compat.py",
    ]
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_flexformer.FlexformerConfig",
        "AutoModel": "modeling_flexformer.FlexformerModel",
        "AutoModelForSeq2SeqLM": "modeling_flexformer.FlexformerForConditionalGeneration",
    }
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["num_beams"], generation["length_penalty"], generation["max_new_tokens"]) == (3, 1.2, 12)
    assert generation["early_stopping"] is True and generation["decoder_start_token_id"] == 2
    assert "from .configuration_flexformer import FlexformerConfig" in (out / "modeling_flexformer.py").read_text()
    card = ModelCard.load(out / "README.md", ignore_metadata_errors=False)
    assert card.data.model_name == "tiny"
    assert {r.metric_type: r.metric_value for r in card.data.eval_results} == EVAL_RESULTS["metrics"]

    original = FlexformerForConditionalGeneration.from_pretrained(str(baseline_checkpoint)).state_dict()
    exported = FlexformerForConditionalGeneration.from_pretrained(str(out)).state_dict()
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[key], exported[key]) for key in original)
    assert leftovers(tmp_path) == []


def test_separate_vocabularies_ship_the_source_tokenizer_in_a_subfolder(tmp_path):
    from transformers import AutoTokenizer

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
    checkpoint = tmp_path / "checkpoint"
    FlexformerForConditionalGeneration(config).save_pretrained(str(checkpoint))
    save_tokenizers(checkpoint, source, target)
    (checkpoint / "eval_results.json").write_text(json.dumps(EVAL_RESULTS))

    out = export_checkpoint(checkpoint, tmp_path / "hub")
    loaded_source = AutoTokenizer.from_pretrained(str(out), subfolder="source_tokenizer", trust_remote_code=True)
    loaded_target = AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)
    assert (len(loaded_source), len(loaded_target)) == (len(source), len(target))
    assert loaded_source("the cat sees a dog")["input_ids"] == source("the cat sees a dog")["input_ids"]
    assert 'subfolder="source_tokenizer"' in (out / "README.md").read_text()


def test_export_overwrite_replaces_and_refuses_without_flag(tmp_path, baseline_checkpoint):
    out = tmp_path / "hub"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(ExportError, match="already exists; pass --overwrite"):
        export_checkpoint(baseline_checkpoint, out)
    assert (out / "stale.txt").exists()
    # --overwrite replaces only a previous export (issue 60: it used to replace any folder, runs included)
    with pytest.raises(ExportError, match="not made by flexformers-export"):
        export_checkpoint(baseline_checkpoint, out, ExportOptions(overwrite=True))
    assert (out / "stale.txt").read_text() == "old"
    (out / "stale.txt").unlink()
    export_checkpoint(baseline_checkpoint, out, ExportOptions(overwrite=True))  # an empty folder: nothing to lose
    (out / "README.md").write_text("stale card")
    export_checkpoint(baseline_checkpoint, out, ExportOptions(overwrite=True))
    assert (out / "README.md").read_text() != "stale card" and (out / "model.safetensors").is_file()
    assert leftovers(tmp_path) == []


def _truncate_weights(checkpoint: Path):
    path = checkpoint / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])


def _rewrite_config(checkpoint: Path, **changes):
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(changes)
    (checkpoint / "config.json").write_text(json.dumps(config))


CORRUPTIONS = {
    "empty directory": (lambda c: [p.unlink() for p in c.iterdir()], "is not a flexformers checkpoint: it has no config.json"),
    "config not JSON": (lambda c: (c / "config.json").write_text('{"model_type": "flexformer",\n  oops}'), r"config.json is not valid JSON \(line 2"),
    "foreign model type": (lambda c: _rewrite_config(c, model_type="bart"), "model_type 'bart' is not a flexformers model type"),
    "no model type": (lambda c: (c / "config.json").write_text("{}"), "has no 'model_type'"),
    "invalid field": (lambda c: _rewrite_config(c, encoder_layers=0), "is not a valid FlexformerConfig.*encoder_layers"),
    "mismatched shape": (lambda c: _rewrite_config(c, encoder_ffn_embed_dim=48), "do not match|cannot load the weights"),
    "truncated weights": (_truncate_weights, "model.safetensors is (corrupt or truncated|truncated)"),
    "no weights": (lambda c: (c / "model.safetensors").unlink(), "has no model.safetensors"),
    "garbage weights": (lambda c: (c / "model.safetensors").write_bytes(b"\x00" * 100), "corrupt or truncated"),
    "no tokenizer": (lambda c: (c / "tokenizer.json").unlink(), "has no loadable tokenizer"),
    "no eval results": (lambda c: (c / "eval_results.json").unlink(), "has no eval_results.json; run flexformers-decode"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_bad_checkpoints_fail_clearly_and_write_nothing(tmp_path, baseline_checkpoint, corruption, capsys):
    corrupt, message = CORRUPTIONS[corruption]
    corrupt(baseline_checkpoint)
    out = tmp_path / "exports" / "hub"
    with pytest.raises(ExportError, match=message):
        export_checkpoint(baseline_checkpoint, out)
    assert not (tmp_path / "exports").exists()

    # The command line reports the same message on stderr with exit status 1.
    assert export_to_hub.main([str(baseline_checkpoint), str(out)]) == 1
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()


def test_card_lists_training_arguments_and_decoded_samples(tmp_path, baseline_checkpoint):
    from transformers import Seq2SeqTrainingArguments

    arguments = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "unused"), learning_rate=5e-4, lr_scheduler_type="inverse_sqrt", warmup_steps=4000,
        weight_decay=1e-4, adam_beta2=0.98, per_device_train_batch_size=32, max_steps=1000, report_to="none",
    )
    torch.save(arguments, baseline_checkpoint / "training_args.bin")
    rows = [{"source": f"source {i}", "reference": f"reference {i}", "hypothesis": f"output {i}"} for i in range(5)]
    (baseline_checkpoint / "generations.test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    out = export_checkpoint(baseline_checkpoint, tmp_path / "hub")
    card = (out / "README.md").read_text()
    assert "| `learning_rate` | `0.0005` |" in card and "| `lr_scheduler_type` | `inverse_sqrt` |" in card
    assert "| `max_steps` | `1000` |" in card and "num_train_epochs" not in card
    assert "output:    output 2" in card and "source 3" not in card  # the first three samples
    assert 'tokenizer(["source 0"]' in card  # the usage example feeds a real test source


def test_tampered_training_arguments_are_not_unpickled(tmp_path, baseline_checkpoint, caplog):
    import pickle

    marker = tmp_path / "executed"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (baseline_checkpoint / "training_args.bin").write_bytes(pickle.dumps(Exploit()))
    assert export_to_hub.read_training_arguments(baseline_checkpoint) == {}
    assert not marker.exists()
    assert "training_args.bin" in caplog.text


def test_generation_overrides_parse_lists_and_json():
    assert export_to_hub.parse_overrides("num_beams=4,exit_thresholds=[0.9,0.8],exit_strategy=confidence") == {
        "num_beams": 4, "exit_thresholds": [0.9, 0.8], "exit_strategy": "confidence",
    }
    assert export_to_hub.parse_overrides('{"length_penalty": 1.2}') == {"length_penalty": 1.2}
    with pytest.raises(ExportError, match="not key=value"):
        export_to_hub.parse_overrides("num_beams")


def test_generation_overrides_reach_generation_config(tmp_path, baseline_checkpoint):
    argv = [str(baseline_checkpoint), str(tmp_path / "hub"), "--generation_overrides", "num_beams=4,max_new_tokens=7"]
    assert export_to_hub.main(argv) == 0
    generation = json.loads((tmp_path / "hub" / "generation_config.json").read_text())
    assert (generation["num_beams"], generation["max_new_tokens"]) == (4, 7)


def test_generation_defaults_filled_in_by_evaluation_are_not_exported(tmp_path, baseline_checkpoint):
    """Seq2SeqTrainer's evaluation writes every Transformers default into the model's generation config
    (``max_length: 20`` among them); the exported folder must not carry them, so that ``generate(max_new_tokens=...)``
    does not warn that ``max_length`` is set too, and it must decode exactly as the checkpoint does."""
    import logging

    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration

    model = FlexformerForConditionalGeneration.from_pretrained(str(baseline_checkpoint))
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path / "run"), predict_with_generate=True, report_to=[])
    trainer = Seq2SeqTrainer(model=model, args=args)
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 2]]), "labels": torch.tensor([[8, 9, 2]])}
    trainer.prediction_step(model, inputs, prediction_loss_only=False, max_new_tokens=4)
    model.save_pretrained(str(baseline_checkpoint))
    evaluated = json.loads((baseline_checkpoint / "generation_config.json").read_text())
    assert evaluated["max_length"] == 20 and evaluated["top_k"] == 50  # what the export has to clean up

    out = export_checkpoint(baseline_checkpoint, tmp_path / "hub")
    generation = json.loads((out / "generation_config.json").read_text())
    assert not {"max_length", "top_k", "min_length", "temperature", "do_sample"} & generation.keys()
    assert (generation["num_beams"], generation["length_penalty"], generation["max_new_tokens"]) == (3, 1.2, 12)

    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addHandler(handler)
    try:
        exported = FlexformerForConditionalGeneration.from_pretrained(str(out))
        source = torch.tensor([[5, 6, 7, 8, 2]])
        from_export = exported.generate(source, max_new_tokens=6)
    finally:
        transformers_logger.removeHandler(handler)
    assert not [message for message in logged if "max_length" in message], logged
    from_checkpoint = model.generate(source, max_new_tokens=6, num_beams=3, length_penalty=1.2, early_stopping=True)
    assert torch.equal(from_export, from_checkpoint)


def test_invalid_generation_overrides_fail_before_writing(tmp_path, baseline_checkpoint):
    with pytest.raises(ExportError, match="invalid generation settings"):
        export_checkpoint(
            baseline_checkpoint, tmp_path / "hub", ExportOptions(generation_overrides={"max_new_tokens": -1})
        )
    assert not (tmp_path / "hub").exists()


def test_missing_eval_results_can_be_allowed(tmp_path, baseline_checkpoint):
    from huggingface_hub import ModelCard

    (baseline_checkpoint / "eval_results.json").unlink()
    assert export_to_hub.main([str(baseline_checkpoint), str(tmp_path / "hub"), "--allow_missing_eval_results"]) == 0
    assert ModelCard.load(tmp_path / "hub" / "README.md", ignore_metadata_errors=False).data.eval_results is None


def test_failure_after_staging_removes_the_staging_directory(tmp_path, baseline_checkpoint, monkeypatch):
    def broken_card(**kwargs):
        raise ExportError("card exploded")

    monkeypatch.setattr(export_to_hub, "render_model_card", broken_card)
    with pytest.raises(ExportError, match="card exploded"):
        export_checkpoint(baseline_checkpoint, tmp_path / "hub")
    assert not (tmp_path / "hub").exists() and leftovers(tmp_path) == []
    with pytest.raises(ExportError, match="card exploded"):
        export_checkpoint(baseline_checkpoint, tmp_path / "new" / "dirs" / "hub")
    assert not (tmp_path / "new").exists()  # parents the export created are removed again


def test_push_to_hub_uses_huggingface_hub_create_repo_and_upload_folder(tmp_path, baseline_checkpoint, monkeypatch):
    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("init", token))

        def create_repo(self, **kwargs):
            calls.append(("create_repo", kwargs))

        def upload_folder(self, **kwargs):
            calls.append(("upload_folder", kwargs))
            return type("Commit", (), {"commit_url": "https://huggingface.co/someone/tiny/commit/abc"})()

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    out = tmp_path / "hub"
    argv = [str(baseline_checkpoint), str(out), "--push_to_hub", "--hub_model_id", "someone/tiny", "--private"]
    assert export_to_hub.main(argv) == 0
    assert calls[1] == ("create_repo", {"repo_id": "someone/tiny", "repo_type": "model", "private": True, "exist_ok": True})
    assert calls[2][0] == "upload_folder" and calls[2][1]["folder_path"] == str(out.resolve())
    assert calls[2][1]["repo_id"] == "someone/tiny"


def test_push_to_hub_needs_a_model_id(tmp_path, baseline_checkpoint):
    assert export_to_hub.main([str(baseline_checkpoint), str(tmp_path / "hub"), "--push_to_hub"]) == 2
    assert not (tmp_path / "hub").exists()


def test_training_script_passes_push_to_hub_through_to_trainer():
    from flexformers.training_scripts.train import parse_arguments

    _, _, _, training_args, _ = parse_arguments(
        ["--model_type", "flexformer", "--output_dir", "/tmp/unused", "--push_to_hub", "--hub_model_id", "someone/x"]
    )
    assert training_args.push_to_hub is True and training_args.hub_model_id == "someone/x"


def test_card_shows_the_copy_baseline_beside_the_model(tmp_path):
    """eval_results.json from flexformers-decode carries the scores of copying the input on the same examples;
    the card puts them beside the model's, with the difference; a malformed baseline is refused by name."""
    results = {**EVAL_RESULTS, "copy_baseline": {"bleu": 17.3, "chrf": 29.6, "ter": 85.0},
               "gain_over_copy": {"bleu": -4.96, "chrf": 10.9, "ter": 4.75}}
    text = render("flexformer", eval_results=results)
    assert "| metric | this model | copying the input | model over copying |" in text
    assert "| BLEU | 12.34 | 17.30 | -4.96 |" in text
    assert "| chrF | 40.50 | 29.60 | +10.90 |" in text
    (tmp_path / "eval_results.json").write_text(json.dumps({**results, "copy_baseline": {"bleu": "high"}}))
    with pytest.raises(ExportError, match="'copy_baseline' must be an object"):
        export_to_hub.read_eval_results(tmp_path)
