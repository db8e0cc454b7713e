"""Hub export, acceptance (slow): for every model type, train with ``flexformers-train``, evaluate with
``flexformers-decode``, export, then load and generate in a fresh virtual environment holding only torch, transformers,
tokenizers and safetensors (flexformers neither installed nor importable, Hub offline) and compare token ids exactly
with the project's own model."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from flexformers.training_scripts.export_to_hub import export_checkpoint
from tests.test_hub_export import MODEL_TYPES

# ---------------------------------------------------------------------------------------------------------
# Acceptance: a fresh virtual environment with only torch, transformers, tokenizers and safetensors
# ---------------------------------------------------------------------------------------------------------

REMOTE_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors")


def _installed_version(name: str) -> str:
    return importlib.metadata.version(name).split("+")[0]


#: The oldest Transformers release flexformers supports (setup.cfg); exported folders must load there too.
FLOOR_TRANSFORMERS = "5.23.0"


def remote_transformers_versions() -> list[str]:
    """The Transformers releases a reader may load an exported folder with: the one installed here and, if that is
    newer, the supported floor — one export, loaded under both ends of the supported range."""
    installed = _installed_version("transformers")
    return [installed] if installed == FLOOR_TRANSFORMERS else [installed, FLOOR_TRANSFORMERS]


def clean_venv_python(transformers_version: str | None = None) -> Path:
    """The Python of a virtual environment holding only torch, transformers, tokenizers and safetensors (and their
    own dependencies), pinned to the versions installed here (Transformers to `transformers_version` when given,
    with the tokenizers/safetensors pip picks for it); built once per versions and cached in the temp directory
    (a file lock makes concurrent test runs wait for one build)."""
    pins = [f"{name}=={_installed_version(name)}" for name in REMOTE_PACKAGES]
    if transformers_version is not None and transformers_version != _installed_version("transformers"):
        pins = [f"torch=={_installed_version('torch')}", f"transformers=={transformers_version}", "tokenizers", "safetensors"]
    key = hashlib.sha256(" ".join([sys.version, *pins]).encode()).hexdigest()[:16]
    venv = Path(tempfile.gettempdir()) / f"flexformers-hub-venv-{key}"
    python = venv / "bin" / "python"
    marker = venv / ".flexformers-complete"
    with open(f"{venv}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file():
            return python
        if venv.exists():
            import shutil

            shutil.rmtree(venv)
        env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        # This interpreter's pip installs into the venv (--python): no ensurepip, and --no-compile skips
        # byte-compiling torch and sympy up front; together about half the build time. torch comes from the
        # local wheel, the rest (and their dependencies) from the package index.
        steps = [
            [sys.executable, "-m", "venv", "--without-pip", str(venv)],
            [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-compile", *pins],
        ]
        for step in steps:
            result = subprocess.run(step, env=env, capture_output=True, text=True, timeout=900, cwd=tempfile.gettempdir())
            if result.returncode != 0:
                raise RuntimeError(f"building the clean venv failed at {step}:\n{result.stderr[-3000:]}")
        marker.write_text(" ".join(pins) + "\n")
    return python


REMOTE_SCRIPT = r"""
import importlib.metadata, importlib.util, json, sys

request = json.load(open(sys.argv[1]))
leaked = [name for name in ("flexformers", "modeling", "configuration", "training_scripts", "metrics")
          if importlib.util.find_spec(name) is not None]
import torch, transformers
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM, AutoTokenizer

torch.set_num_threads(1)
results = {"leaked": leaked, "sys_path": sys.path, "transformers_version": transformers.__version__, "packages": sorted(
    d.metadata["Name"].lower() for d in importlib.metadata.distributions())}
for model_type, folder in request["folders"].items():
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)  # as a user writes it (no trust_remote_code)
        model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
        base = AutoModel.from_pretrained(folder, trust_remote_code=True)
        config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
        inputs = tokenizer(request["sentences"], return_tensors="pt", padding=True)
        with torch.no_grad():
            default = model.generate(**inputs)
            greedy = model.generate(**inputs, num_beams=1)
        results[model_type] = {
            "input_ids": inputs["input_ids"].tolist(),
            "default": default.tolist(),
            "greedy": greedy.tolist(),
            "model_module": type(model).__module__,
            "model_class": type(model).__name__,
            "base_class": type(base).__name__,
            "config_class": type(config).__name__,
        }
    except Exception as error:
        import traceback
        results[model_type] = {"error": traceback.format_exc()}
json.dump(results, open(sys.argv[2], "w"))
"""

SENTENCES = ["the cat sees a dog", "big red house", "the small dog runs and jumps over the tree"]

#: Per-method additions to the tiny architecture (the rest of each method's config keeps its defaults).
TINY_ARCHITECTURE = (
    "encoder_layers=2,decoder_layers=2,encoder_embed_dim=32,decoder_embed_dim=32,encoder_ffn_embed_dim=64,"
    "decoder_ffn_embed_dim=64,encoder_attention_heads=4,decoder_attention_heads=4,dropout=0.0,"
    "max_source_positions=64,max_target_positions=64"
)


#: Method settings that make the acceptance test exercise the method's own decoding where its default would not.
METHOD_OVERRIDES = {
    # Early exit by confidence (Sec. 3.2): with a low threshold most tokens leave after block 1 of 2.
    "depth_adaptive": "exit_strategy=confidence,exit_thresholds=[0.2]",
}


def _write_corpus(directory: Path) -> dict[str, Path]:
    import random

    rng = random.Random(0)
    lexicon = {
        "the": "der", "a": "ein", "cat": "katze", "dog": "hund", "sees": "sieht", "likes": "mag", "big": "gross",
        "small": "klein", "red": "rot", "blue": "blau", "house": "haus", "tree": "baum", "runs": "rennt",
        "jumps": "springt",
    }
    words = sorted(lexicon)
    rows = []
    for _ in range(140):
        sentence = [rng.choice(words) for _ in range(rng.randint(3, 7))]
        rows.append(f"{' '.join(sentence)}\t{' '.join(lexicon[w] for w in sentence)}")
    files = {}
    for split, part in (("train", rows[:120]), ("valid", rows[120:130]), ("test", rows[130:])):
        files[split] = directory / f"{split}.tsv"
        files[split].write_text("source\ttarget\n" + "\n".join(part) + "\n")
    return files


def _train_decode_export(model_type: str, work: Path, corpus: dict[str, Path]) -> Path:
    """The pipeline end to end: flexformers-train (a few steps), flexformers-decode (eval_results.json),
    flexformers-export."""
    from flexformers.training_scripts import decode, train

    run_dir = work / f"run-{model_type}"
    train.main([
        "--model_type", model_type, "--preset", "transformer_codegen_small",
        "--config_overrides", ",".join(filter(None, [TINY_ARCHITECTURE, METHOD_OVERRIDES.get(model_type)])),
        "--vocab_size", "280", "--bpe_min_frequency", "1", "--task", "files",
        "--train_file", str(corpus["train"]), "--validation_file", str(corpus["valid"]),
        "--test_file", str(corpus["test"]), "--max_source_length", "32", "--max_target_length", "32",
        "--output_dir", str(run_dir), "--do_train", "--max_steps", "40", "--learning_rate", "5e-3",
        "--warmup_steps", "0", "--eval_strategy", "no", "--save_strategy", "no", "--report_to", "none",
        "--per_device_train_batch_size", "16", "--logging_steps", "20", "--seed", "0",
        "--disable_tqdm", "true",
    ])
    decode.main([
        "--model_name_or_path", str(run_dir), "--split", "test", "--num_beams", "2", "--max_new_tokens", "16",
        "--num_samples_to_print", "0",
    ])
    return export_checkpoint(run_dir, work / f"hub-{model_type}")


@pytest.fixture(scope="module")
def remote_results(tmp_path_factory):
    """Train/evaluate/export every model type, then load them all in one run of the clean venv."""
    work = tmp_path_factory.mktemp("hub-acceptance")
    corpus = _write_corpus(work)
    folders, failures = {}, {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest, and far faster on a shared, busy machine
    try:
        for model_type in MODEL_TYPES:
            try:
                folders[model_type] = _train_decode_export(model_type, work, corpus)
            except Exception as error:  # reported by that type's test
                import traceback

                failures[model_type] = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
    finally:
        torch.set_num_threads(threads)
    request = work / "request.json"
    request.write_text(json.dumps({"folders": {k: str(v) for k, v in folders.items()}, "sentences": SENTENCES}))
    remote_home = work / "remote-home"
    remote_home.mkdir()
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(remote_home),
        "HF_HOME": str(remote_home / "hf"),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    remote_by_version = {}
    for version in remote_transformers_versions():
        output = work / f"remote-{version}.json"
        result = subprocess.run(
            [str(clean_venv_python(version)), "-I", "-c", REMOTE_SCRIPT, str(request), str(output)],
            cwd=remote_home, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
        )
        assert result.returncode == 0, f"transformers {version}:\n{result.stderr[-5000:]}"
        remote_by_version[version] = json.loads(output.read_text())
    remote = remote_by_version[_installed_version("transformers")]
    remote["by_version"] = remote_by_version
    return folders, failures, remote


@pytest.mark.slow
def test_clean_venv_has_only_the_four_packages_and_no_flexformers(remote_results):
    _, _, remote = remote_results
    assert remote["leaked"] == []
    assert not any("work/main" in entry for entry in remote["sys_path"])
    assert "flexformers" not in remote["packages"]
    for name in ("torch", "transformers", "tokenizers", "safetensors"):
        assert name in remote["packages"]
    for absent in ("accelerate", "datasets", "evaluate", "sacrebleu"):
        assert absent not in remote["packages"]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_exported_model_generates_exactly_like_the_project_model(remote_results, model_type):
    from flexformers.training_scripts.model_registry import get_method_spec
    from flexformers.training_scripts.tokenizer import load_tokenizers

    folders, failures, remote = remote_results
    assert model_type not in failures, f"train/decode/export of {model_type} failed:\n{failures.get(model_type)}"
    folder = folders[model_type]
    assert "error" not in remote[model_type], remote[model_type].get("error")
    loaded = remote[model_type]
    spec = get_method_spec(model_type)
    assert loaded["model_module"].startswith("transformers_modules.")  # the folder's code, not a package
    assert loaded["model_class"] == spec.model_class.__name__
    assert loaded["config_class"] == spec.config_class.__name__

    source_tokenizer, _ = load_tokenizers(folder)
    model = spec.model_class.from_pretrained(str(folder)).eval()
    inputs = source_tokenizer(SENTENCES, return_tensors="pt", padding=True)
    assert inputs["input_ids"].tolist() == loaded["input_ids"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the remote side
    try:
        with torch.no_grad():
            default = model.generate(**inputs)
            greedy = model.generate(**inputs, num_beams=1)
            exits = model.generate(**inputs, num_beams=1, return_exits=True).exits if model_type == "depth_adaptive" else None
    finally:
        torch.set_num_threads(threads)
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["num_beams"] == 2  # the evaluation's decoding settings travel with the folder
    assert default.tolist() == loaded["default"]
    assert greedy.tolist() == loaded["greedy"]
    for version, other in remote["by_version"].items():  # the same folder under each end of the supported range
        assert "error" not in other[model_type], f"transformers {version}: {other[model_type].get('error')}"
        assert other["transformers_version"] == version
        assert (other[model_type]["default"], other[model_type]["greedy"]) == (loaded["default"], loaded["greedy"]), version
    assert default.shape[1] > 1
    if model_type == "depth_adaptive":
        # The compared decoding really exited early, with the settings carried by generation_config.json.
        assert generation["exit_strategy"] == "confidence" and generation["exit_thresholds"] == [0.2]
        assert exits[exits > 0].min().item() < model.config.decoder_layers
