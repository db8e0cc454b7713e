"""A sixth method defined here, in the test file, plugs into every tool without touching the package (issue 62).

The method ("scaled_ffn"): every feed-forward sub-layer's output is multiplied by a learned scalar, started at
``feed_forward_scale`` (1 is the baseline's FFN). It extends the backbone at its feed-forward seam
(``BackboneComponents(feed_forward=...)``), as MAT does, and plugs into the tools through a ``MethodSpec``
registered with :func:`register_method`: ``flexformers-train``, ``flexformers-decode``, the quickstart (its figures),
a zoo recipe and ``flexformers-export`` then take it as they take the package's own methods.
"""

from __future__ import annotations

import json

import pytest
import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from flexformers.configuration.configuration_flexformer import FlexformerConfig
from flexformers.modeling.modeling_flexformer import (
    BackboneComponents,
    FlexformerFeedForward,
    FlexformerForConditionalGeneration,
    FlexformerModel,
)
from flexformers.training_scripts.model_registry import (
    MethodSpec,
    available_model_types,
    get_method_spec,
    register_method,
    unregister_method,
)
from tests.conftest import tiny_config_kwargs


@strict(accept_kwargs=True)
class ScaledFeedForwardConfig(FlexformerConfig):
    """The baseline's fields plus ``feed_forward_scale``, the learned scale's starting value."""

    model_type = "scaled_ffn"
    feed_forward_scale: float = 1.0


class ScaledFeedForward(FlexformerFeedForward):
    """The backbone's FFN, its output times a learned scalar."""

    def __init__(self, config, embed_dim, ffn_dim, num_branches=1):
        super().__init__(config, embed_dim, ffn_dim, num_branches)
        self.scale = nn.Parameter(torch.full((), float(config.feed_forward_scale)))

    def forward(self, hidden_states):
        return super().forward(hidden_states) * self.scale


SCALED_COMPONENTS = BackboneComponents(feed_forward=ScaledFeedForward)


def _init_scales(model, module) -> None:
    if isinstance(module, ScaledFeedForward) and not getattr(module.scale, "_is_hf_initialized", False):
        nn.init.constant_(module.scale, model.config.feed_forward_scale)


class ScaledFeedForwardModel(FlexformerModel):
    config_class = ScaledFeedForwardConfig
    components = SCALED_COMPONENTS

    def _init_weights(self, module):
        super()._init_weights(module)
        _init_scales(self, module)


class ScaledFeedForwardForConditionalGeneration(FlexformerForConditionalGeneration):
    config_class = ScaledFeedForwardConfig
    base_model_class = ScaledFeedForwardModel
    components = SCALED_COMPONENTS

    def _init_weights(self, module):
        super()._init_weights(module)
        _init_scales(self, module)


AutoConfig.register("scaled_ffn", ScaledFeedForwardConfig, exist_ok=True)
AutoModel.register(ScaledFeedForwardConfig, ScaledFeedForwardModel, exist_ok=True)
AutoModelForSeq2SeqLM.register(ScaledFeedForwardConfig, ScaledFeedForwardForConditionalGeneration, exist_ok=True)


def scale_figures(model, batch, target_tokenizer, generate_kwargs) -> dict:
    """What the method learned: the mean FFN scale of the encoder and of the decoder."""
    scales = {side: [module.scale.item() for name, module in model.named_modules()
                     if isinstance(module, ScaledFeedForward) and f".{side}." in f".{name}"]
              for side in ("encoder", "decoder")}
    return {f"mean FFN scale ({side})": round(sum(values) / len(values), 4) for side, values in scales.items()}


SCALED_FFN_SPEC = MethodSpec(
    model_type="scaled_ffn",
    config_class=ScaledFeedForwardConfig,
    model_class=ScaledFeedForwardForConditionalGeneration,
    name="Scaled FFN",
    figures=scale_figures,
    description="A Transformer whose feed-forward outputs are scaled by learned scalars (a test method).",
)


@pytest.fixture
def scaled_ffn_method():
    register_method(SCALED_FFN_SPEC)
    yield SCALED_FFN_SPEC
    unregister_method("scaled_ffn")


def test_at_scale_one_the_method_is_the_baseline_exactly():
    """The seam changes nothing but what the method adds: at its starting scale 1 the logits are the baseline's."""
    torch.manual_seed(0)
    baseline = FlexformerForConditionalGeneration(FlexformerConfig(**tiny_config_kwargs())).eval()
    torch.manual_seed(0)
    scaled = ScaledFeedForwardForConditionalGeneration(ScaledFeedForwardConfig(**tiny_config_kwargs())).eval()
    source = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 11, 2, 1]])
    target = torch.tensor([[2, 12, 13, 14], [2, 15, 16, 17]])
    with torch.no_grad():
        expected = baseline(input_ids=source, attention_mask=source.ne(1), decoder_input_ids=target).logits
        actual = scaled(input_ids=source, attention_mask=source.ne(1), decoder_input_ids=target).logits
        assert torch.equal(actual, expected)
        for module in scaled.modules():
            if isinstance(module, ScaledFeedForward):
                module.scale.fill_(0.5)
        assert not torch.allclose(scaled(input_ids=source, attention_mask=source.ne(1),
                                         decoder_input_ids=target).logits, expected)


def test_registering_makes_the_type_known_and_refuses_a_taken_name(scaled_ffn_method):
    assert "scaled_ffn" in available_model_types() and get_method_spec("scaled_ffn") is SCALED_FFN_SPEC
    with pytest.raises(ValueError, match="model type 'mat' is already defined"):
        register_method(MethodSpec("mat", ScaledFeedForwardConfig, ScaledFeedForwardForConditionalGeneration))
    with pytest.raises(ValueError, match="needs a MethodSpec"):
        register_method("scaled_ffn")
    unregister_method("scaled_ffn")
    assert "scaled_ffn" not in available_model_types()
    with pytest.raises(ValueError, match="Unknown --model_type 'scaled_ffn'"):
        get_method_spec("scaled_ffn")


def test_an_installed_packages_entry_point_makes_the_type_known(tmp_path, monkeypatch):
    """A method shipped in a package of its own declares ``[project.entry-points."flexformers.methods"]``."""
    dist = tmp_path / "scaled_ffn_method-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: scaled-ffn-method\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[flexformers.methods]\n"
                                           f"scaled_ffn = {__name__}:SCALED_FFN_SPEC\n"
                                           f"wrong_name = {__name__}:SCALED_FFN_SPEC\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert {"scaled_ffn", "wrong_name"} <= set(available_model_types())
    assert get_method_spec("scaled_ffn") is SCALED_FFN_SPEC
    with pytest.raises(ValueError, match="entry point 'wrong_name' .* must name a MethodSpec whose model_type is "
                                         "'wrong_name'"):
        get_method_spec("wrong_name")


def test_a_trainer_class_that_is_not_the_projects_is_refused_by_name(tmp_path, capsys):
    from transformers import Seq2SeqTrainer

    from flexformers.training_scripts import train
    from tests.test_training import tiny_argv

    class PlainTrainer(Seq2SeqTrainer):
        pass

    register_method(MethodSpec("scaled_ffn", ScaledFeedForwardConfig, ScaledFeedForwardForConditionalGeneration,
                               trainer_class=PlainTrainer))
    try:
        argv = tiny_argv(tmp_path / "run", "--max_steps", "1")
        argv[argv.index("--model_type") + 1] = "scaled_ffn"
        assert train.main(argv) == 1
    finally:
        unregister_method("scaled_ffn")
    assert "must subclass flexformers.training_scripts.trainer.FlexformersSeq2SeqTrainer" in capsys.readouterr().err


@pytest.mark.slow
def test_the_method_runs_through_train_decode_quickstart_zoo_and_export(tmp_path, scaled_ffn_method, capsys):
    from flexformers.training_scripts import decode, export_to_hub, quickstart, zoo
    from flexformers.training_scripts.zoo_runner import RESULT_FILE
    from tests.test_zoo import write_recipes

    # a zoo recipe: flexformers-train, then flexformers-decode on the test split, the method's figures, the export
    recipes = write_recipes(tmp_path, "  - {name: scaled, task: word_order, model_type: scaled_ffn}\n")
    runs = tmp_path / "runs"
    assert zoo.main(["--recipes", str(recipes), "--runs_dir", str(runs), "run", "scaled", "--smoke"]) == 0
    result = json.loads((runs / "scaled" / RESULT_FILE).read_text())
    assert result["recipe"]["model_type"] == "scaled_ffn" and result["updates"] == 3
    assert set(result["figures"]) == {"mean FFN scale (encoder)", "mean FFN scale (decoder)"}
    trained = AutoModelForSeq2SeqLM.from_pretrained(runs / "scaled")
    assert isinstance(trained, ScaledFeedForwardForConditionalGeneration)
    assert any(module.scale.item() != 1.0 for module in trained.modules() if isinstance(module, ScaledFeedForward))

    # the zoo's Hub folder: no remote code (the method's code is this module), a card that says to import it
    hub = runs / "hub" / "scaled"
    config = json.loads((hub / "config.json").read_text())
    assert config["model_type"] == "scaled_ffn" and "auto_map" not in config
    assert not list(hub.glob("*.py"))
    card = (hub / "README.md").read_text()
    assert f"import {__name__}  # registers model type \"scaled_ffn\"" in card
    assert "A Transformer whose feed-forward outputs are scaled by learned scalars" in card
    exported = AutoModelForSeq2SeqLM.from_pretrained(hub)
    assert all(torch.equal(a, b) for a, b in zip(exported.state_dict().values(), trained.state_dict().values()))

    # flexformers-decode and flexformers-export on the trained run, directly
    capsys.readouterr()
    assert decode.main(["--model_name_or_path", str(runs / "scaled"), "--split", "test", "--max_samples", "3",
                        "--max_new_tokens", "8", "--output_file", str(tmp_path / "out.txt")]) == 0
    assert len((tmp_path / "out.txt").read_text().splitlines()) == 3
    assert export_to_hub.main([str(runs / "scaled"), str(tmp_path / "export")]) == 0
    assert (tmp_path / "export" / "model.safetensors").is_file()

    # the quickstart: trains the method and reports its figures
    out = quickstart.run_from_argv(["--model_type", "scaled_ffn", "--smoke", "--output_dir", str(tmp_path / "quick"),
                                    "--threads", "2"])
    assert set(out["figures"]) == {"mean FFN scale (encoder)", "mean FFN scale (decoder)"}
