"""The installed package: one `flexformers` namespace in site-packages, importable whatever sits in the working
directory, its public names at the top, and the data files (metrics, card templates) it reads at run time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GENERIC_NAMES = ("modeling", "configuration", "metrics", "training_scripts", "hub_cards")


@pytest.fixture(scope="module")
def installed_tree(tmp_path_factory) -> Path:
    """`pip install .` (a regular, non-editable install) into an empty target directory: exactly what a wheel puts
    into site-packages. Dependencies come from this environment."""
    target = tmp_path_factory.mktemp("site-packages")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-compile",
         "--target", str(target), str(REPO)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return target


@pytest.mark.slow
def test_a_regular_install_puts_only_the_flexformers_package_into_site_packages(installed_tree):
    top_level = {path.name for path in installed_tree.iterdir() if not path.name.endswith((".dist-info", ".egg-info"))}
    assert "flexformers" in top_level
    assert not top_level & {*GENERIC_NAMES, *(f"{name}.py" for name in GENERIC_NAMES)}, top_level
    package = installed_tree / "flexformers"
    for sub in ("modeling", "configuration", "training_scripts", "training_scripts/methods", "metrics/bleu"):
        assert (package / sub / "__init__.py").is_file(), sub
    # files read at run time: local evaluate metrics, model-card templates, accelerate configs
    assert (package / "metrics" / "bleu" / "bleu.py").is_file()
    assert (package / "hub_cards" / "_base.md").is_file() and (package / "hub_cards" / "iot.md").is_file()
    assert (package / "training_scripts" / "accelerate_configs" / "fsdp.yaml").is_file()
    assert (package / "training_scripts" / "zoo_recipes.yaml").is_file()  # flexformers-zoo's default recipes


@pytest.mark.slow
def test_a_configuration_py_in_the_working_directory_does_not_shadow_the_package(installed_tree, tmp_path):
    """A user's own `configuration.py` / `modeling.py` in the current directory (first on `sys.path` for
    `python -c` and scripts) used to replace ours; the installed package imports only its own modules."""
    for name in ("configuration", "modeling", "metrics", "training_scripts"):
        (tmp_path / f"{name}.py").write_text("raise ImportError('the user module was imported')\n")
    script = (
        "import flexformers, sys\n"
        "from flexformers import IOTConfig, IOTForConditionalGeneration, MATConfig, FlexformerConfig\n"
        "from flexformers.training_scripts.metrics_utils import load_metric\n"
        "from flexformers.training_scripts.hub_model_card import DEFAULT_CARDS_DIR\n"
        f"assert flexformers.__file__.startswith({str(installed_tree)!r}), flexformers.__file__\n"
        "assert load_metric('bleu').compute(predictions=['a b c d'], references=[['a b c d']])['score'] > 99.99\n"
        "assert (DEFAULT_CARDS_DIR / 'flexformer.md').is_file(), DEFAULT_CARDS_DIR\n"
        "model = IOTForConditionalGeneration(IOTConfig(encoder_layers=1, decoder_layers=1, encoder_embed_dim=16,"
        " decoder_embed_dim=16, encoder_ffn_embed_dim=32, decoder_ffn_embed_dim=32, encoder_attention_heads=2,"
        " decoder_attention_heads=2, vocab_size=20))\n"
        "print('ok', type(model).__module__)\n"
    )
    env = {"PYTHONPATH": str(installed_tree), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["ok", "flexformers.modeling.modeling_iot"]


def test_the_training_module_runs_from_the_checkout_root_without_an_editable_install():
    """`python -m flexformers.training_scripts.train --help` in the repository: the checkout's `flexformers/` folder
    (first on `sys.path`) holds only `__init__.py`, and its subpackages are the top-level folders. With a regular
    install this failed with a circular-import error; the editable install's finder is taken away to see it."""
    script = (
        "import runpy, sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]\n"
        "sys.argv = ['flexformers-train', '--help']\n"
        "runpy.run_module('flexformers.training_scripts.train', run_name='__main__')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--model_type" in result.stdout and "--config_overrides" in result.stdout


def _console_scripts() -> list[str]:
    """The console scripts that setup.cfg declares, so that a script added there is covered here too."""
    import configparser

    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    lines = setup["options.entry_points"]["console_scripts"].strip().splitlines()
    return [line.split("=", 1)[0].strip() for line in lines if line.strip()]


@pytest.mark.parametrize("script", _console_scripts())
def test_every_installed_console_script_prints_its_help_from_an_empty_directory(script, tmp_path):
    """`flexformers-train --help` is the first command a new user types: each installed script must print its usage
    and exit 0 from any directory, with no Hub access."""
    executable = Path(sys.executable).parent / script
    assert executable.is_file(), f"{script} is not installed beside {sys.executable}: run `pip install -e .`"
    result = subprocess.run([str(executable), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(f"usage: {script}"), result.stdout[:300]


def test_every_model_type_is_importable_from_the_package_top():
    import flexformers

    for name in ("FlexformerConfig", "IOTConfig", "MATConfig", "InDIGOConfig", "DepthAdaptiveConfig",
                 "FlexformerForConditionalGeneration", "IOTForConditionalGeneration", "MATForConditionalGeneration",
                 "InDIGOForConditionalGeneration", "DepthAdaptiveForConditionalGeneration"):
        assert name in flexformers.__all__ and getattr(flexformers, name).__name__ == name


def test_the_package_declares_ranges_not_pins_for_torch_and_transformers():
    """Installing flexformers never downgrades or pins the user's torch or Transformers (setup.cfg)."""
    import configparser

    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    requirements = {line.split(">")[0].split("=")[0].split("<")[0].strip(): line.strip()
                    for line in parser["options"]["install_requires"].strip().splitlines()}
    assert requirements["torch"] == "torch>=2.11,<3"
    assert requirements["transformers"] == "transformers>=5.23,<6"
    assert not any("==" in line for line in requirements.values())
