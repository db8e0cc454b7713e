"""Depth-Adaptive training integration (two-stage schedule) and tools (threshold search, Pareto front, plots)."""

import json
from types import SimpleNamespace

import pytest
import torch

import flexformers.modeling  # noqa: F401
from flexformers.configuration.configuration_depth_adaptive import DepthAdaptiveConfig
from flexformers.modeling.modeling_depth_adaptive import DepthAdaptiveForConditionalGeneration
from flexformers.training_scripts.depth_adaptive_tools import (
    best_per_cost_bucket,
    build_parser,
    cheapest_reaching,
    pareto_front,
    plot_exits,
    plot_trade_off,
    sample_thresholds,
    write_table,
)
from flexformers.training_scripts.methods.depth_adaptive import (
    SPEC,
    DepthAdaptiveArguments,
    apply_depth_adaptive_flags,
    build_depth_adaptive_model,
)
from flexformers.training_scripts.model_registry import get_method_spec

TINY = dict(vocab_size=40, encoder_embed_dim=16, decoder_embed_dim=16, encoder_ffn_embed_dim=32,
            decoder_ffn_embed_dim=32, encoder_layers=1, decoder_layers=3, encoder_attention_heads=2,
            decoder_attention_heads=2, dropout=0.0)


def test_method_spec_is_registered():
    assert get_method_spec("depth_adaptive") is SPEC
    assert SPEC.config_class is DepthAdaptiveConfig
    config = DepthAdaptiveConfig.from_preset("depth_adaptive_iwslt_de_en", vocab_size=100)
    assert (config.encoder_embed_dim, config.decoder_embed_dim, config.decoder_layers) == (512, 256, 6)
    assert not config.share_decoder_input_output_embed and config.exit_classifiers == "independent"
    with pytest.raises(ValueError, match="preset"):
        DepthAdaptiveConfig.from_preset("nope")


def test_flags_update_and_validate_the_config():
    config = DepthAdaptiveConfig(**TINY)
    args = DepthAdaptiveArguments(da_halting_mechanism="token_geometric", da_exit_loss_alpha=0.1,
                                  da_exit_thresholds="0.2, 0.7", da_oracle="correctness", da_oracle_lambda=0.1)
    apply_depth_adaptive_flags(config, args)
    assert (config.halting_mechanism, config.exit_loss_alpha, config.exit_thresholds) == ("token_geometric", 0.1, [0.2, 0.7])
    with pytest.raises(ValueError, match="exit_thresholds"):
        apply_depth_adaptive_flags(config, DepthAdaptiveArguments(da_exit_thresholds="0.2"))
    with pytest.raises(ValueError, match="comma-separated"):
        apply_depth_adaptive_flags(config, DepthAdaptiveArguments(da_exit_thresholds="a,b"))


def test_two_stage_schedule_continues_a_stage_one_checkpoint_with_a_new_halting_mechanism(tmp_path):
    torch.manual_seed(0)
    stage_one = DepthAdaptiveForConditionalGeneration(DepthAdaptiveConfig(**TINY))
    stage_one.save_pretrained(tmp_path)
    args = DepthAdaptiveArguments(da_halting_mechanism="token_geometric", da_exit_loss_alpha=0.5)
    model_args = SimpleNamespace(model_name_or_path=str(tmp_path))
    stage_two = build_depth_adaptive_model(model_args, args, DepthAdaptiveConfig(**TINY, label_smoothing=0.1), None)
    assert stage_two.config.halting_mechanism == "token_geometric" and stage_two.config.exit_loss_alpha == 0.5
    assert stage_two.config.label_smoothing == 0.1
    for name, value in stage_one.state_dict().items():
        torch.testing.assert_close(stage_two.state_dict()[name], value)
    source = torch.randint(4, 40, (2, 5))
    output = stage_two.train()(input_ids=source, labels=torch.randint(4, 40, (2, 4)))
    assert output.exit_loss is not None and output.loss > output.decoding_loss


def test_the_tools_decode_on_the_device_asked_for_else_on_a_gpu_when_there_is_one(monkeypatch):
    """The tools once loaded every model on the CPU, so a sweep on a GPU machine ran on its CPU (~100 s a threshold
    set at the IWSLT size): the model now goes where --device says, else to the GPU when there is one."""
    from flexformers.training_scripts import decode
    from flexformers.training_scripts.depth_adaptive_tools import _load

    placed = []

    def load_model(path, device, bf16, **options):
        placed.append(device)
        raise RuntimeError("loaded")

    monkeypatch.setattr(decode, "load_model", load_model)
    for has_gpu, argv, expected in ((True, [], "cuda"), (False, [], "cpu"), (True, ["--device", "cpu"], "cpu"),
                                    (False, ["--device", "cuda:1"], "cuda:1")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: has_gpu)
        for command in ("evaluate", "threshold-search", "exit-picture"):
            with pytest.raises(RuntimeError, match="loaded"):
                _load(build_parser().parse_args([command, "--model_name_or_path", "m", *argv]))
            assert placed.pop() == expected


def test_threshold_sampling_buckets_and_pareto_front(tmp_path):
    samples = sample_thresholds(5, 4, seed=3)
    assert len(samples) == 5 and all(len(s) == 3 and all(0 <= t < 1 for t in s) for s in samples)
    assert samples == sample_thresholds(5, 4, seed=3)
    rows = [
        {"average_exit": 1.1, "bleu": 10.0, "flops_per_token": 1, "thresholds": [0.1]},
        {"average_exit": 1.2, "bleu": 12.0, "flops_per_token": 1, "thresholds": [0.2]},
        {"average_exit": 1.6, "bleu": 11.0, "flops_per_token": 1, "thresholds": [0.3]},
        {"average_exit": 2.1, "bleu": 15.0, "flops_per_token": 1, "thresholds": [0.4]},
        {"average_exit": 2.2, "bleu": 14.0, "flops_per_token": 1, "thresholds": [0.5]},
    ]
    assert [r["bleu"] for r in pareto_front(rows)] == [10.0, 12.0, 15.0]
    assert [r["bleu"] for r in best_per_cost_bucket(rows, bucket_width=0.5)] == [12.0, 11.0, 15.0]
    front = pareto_front(rows)
    assert cheapest_reaching(front, 11.5)["thresholds"] == [0.2]  # the first point of the front that matches
    assert cheapest_reaching(front, 15.0)["thresholds"] == [0.4]
    assert cheapest_reaching(front, 16.0)["thresholds"] == [0.4]  # none reaches it: the most accurate
    with pytest.raises(ValueError, match="found no thresholds"):
        cheapest_reaching([], 1.0)
    write_table(rows, tmp_path / "t.csv")
    assert (tmp_path / "t.csv").read_text().splitlines()[1].startswith("1.1,10.0,1,0.100")
    plot_trade_off(rows, pareto_front(rows), [{"average_exit": 1.0, "bleu": 9.0}], tmp_path / "f.png", "t")
    plot_exits(["a", "b", "</s>"], [1, 3, 1], [0.9, 0.2, 0.99], 3, tmp_path / "e.png", "src")
    assert (tmp_path / "f.png").stat().st_size > 0 and (tmp_path / "e.png").stat().st_size > 0
    json.dumps(rows)


@pytest.mark.slow
def test_evaluation_reports_the_cross_entropy_of_the_returned_logits_beside_the_training_loss(tmp_path):
    """Trainer's eval_loss of a Depth-Adaptive model is its training objective (Eq. 7, all exits); evaluation also
    reports the label-smoothed cross-entropy of the logits it returns (the baseline's eval_loss criterion), its NLL
    and perplexity, averaged like eval_loss over the batches."""
    import math

    from tests.test_training import tiny_argv

    from flexformers.training_scripts import train

    argv = tiny_argv(tmp_path / "da", "--max_steps", "3", "--max_eval_samples", "8", "--do_eval")
    argv[argv.index("--model_type") + 1] = "depth_adaptive"
    metrics = train.run_from_argv(argv)["eval"]
    assert {"eval_loss", "eval_logits_loss", "eval_logits_nll_loss", "eval_logits_perplexity"} <= set(metrics)
    assert metrics["eval_logits_loss"] != metrics["eval_loss"]
    assert metrics["eval_logits_perplexity"] == pytest.approx(math.exp(metrics["eval_logits_nll_loss"]), rel=1e-3)
    assert metrics["eval_logits_nll_loss"] > 0
