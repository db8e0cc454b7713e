"""MAT: checkpoints of the earlier merge layout, devices, the classifier's drop-head and the configs built from a
baseline, at the boundaries the mutation runs (issue 65) found untested."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    BertConfig,
    BertModel,
    RobertaConfig,
    RobertaModel,
)

import flexformers.modeling  # noqa: F401  (registers the Auto classes)
from flexformers.configuration.configuration_flexformer import FlexformerConfig
from flexformers.configuration.configuration_mat import MATConfig, MATRobertaConfig
from flexformers.modeling import branch_merge
from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration
from flexformers.modeling.modeling_mat import (
    MATAttention,
    MATBertForSequenceClassification,
    MATEncoderAttentionOutput,
    MATFeedForward,
    MATForConditionalGeneration,
    MATRobertaForSequenceClassification,
    drop_branch_keep_scales,
    drop_head_keep_scales,
    multi_branch_merge_weights,
)
from tests.test_mat import (  # noqa: F401  (fixtures)
    ENCODER,
    TINY,
    _encoder_batch,
    _init_standalone,
    _one_thread,
    _perturb_biases,
    baseline_dir,
    batch,
    roberta_dir,
)

# ---- issue 65: mutation survivors (checkpoints of the earlier merge layout, devices, drop-head in the classifier) ----


def _earlier_layout(state: dict[str, torch.Tensor], one_branch_merges: bool = True) -> dict[str, torch.Tensor]:
    """`state` as flexformers 0.1.0 saved it: every merge bias `[B, out]` under `<name>.bias` (`[1, out]` for
    one branch: every `out_proj` / `fc2` of the encoder-decoder; the classifier's other Linears never were merges),
    written here from the layout's description, not with the code under test."""
    earlier = {}
    for key, tensor in state.items():
        module_path, _, leaf = key.rpartition(".")
        if one_branch_merges and leaf == "bias" and module_path.rpartition(".")[2] in ("out_proj", "fc2"):
            earlier[key] = tensor.unsqueeze(0)
        elif key.endswith("_branch_bias"):
            earlier[key.removesuffix("_branch_bias") + ".bias"] = tensor
        else:
            earlier[key] = tensor
    return earlier


def test_upgrade_merge_bias_keys_maps_each_earlier_merge_bias_to_its_current_key():
    shapes = {
        "model.encoder.layers.0.self_attn.out_proj.bias": (1, 32),  # one branch: stays, squeezed
        "model.encoder.layers.0.self_attn.out_proj.weight": (32, 32),
        "model.decoder.layers.1.fc2.bias": (3, 32),  # three branches: moves to the branch bias
        "roberta.encoder.layer.0.attention.output.dense.bias": (2, 32),
        "model.encoder.layers.0.self_attn.q_proj.bias": (2, 32),  # not a merge: left alone whatever its shape
        "model.encoder.layers.1.self_attn.out_proj.bias": (32,),  # already current
    }
    assert branch_merge.upgrade_merge_bias_keys(shapes) == {
        "model.encoder.layers.0.self_attn.out_proj.bias": ("model.encoder.layers.0.self_attn.out_proj.bias", True),
        "model.decoder.layers.1.fc2.bias": ("model.decoder.layers.1.fc2_branch_bias", False),
        "roberta.encoder.layer.0.attention.output.dense.bias": (
            "roberta.encoder.layer.0.attention.output.dense_branch_bias", False),
    }
    current = {"model.encoder.layers.1.self_attn.out_proj.bias": (32,), "lm_head.weight": (60, 32)}
    assert branch_merge.upgrade_merge_bias_keys(current) == {}


def test_upgrade_merge_biases_changes_only_the_merge_biases():
    torch.manual_seed(20)
    state = {
        "a.out_proj.bias": torch.randn(1, 4),
        "a.out_proj.weight": torch.randn(4, 8),
        "b.fc2.bias": torch.randn(2, 4),
        "b.fc1.weight": torch.randn(6, 4),
        "b.fc1.bias": torch.randn(6),
    }
    upgraded = branch_merge.upgrade_merge_biases(state)
    assert set(upgraded) == {"a.out_proj.bias", "a.out_proj.weight", "b.fc2_branch_bias", "b.fc1.weight", "b.fc1.bias"}
    assert torch.equal(upgraded["a.out_proj.bias"], state["a.out_proj.bias"][0])
    assert torch.equal(upgraded["b.fc2_branch_bias"], state["b.fc2.bias"])
    for key in ("a.out_proj.weight", "b.fc1.weight", "b.fc1.bias"):
        assert torch.equal(upgraded[key], state[key]), key


def _mat_with_biases(seed: int) -> MATForConditionalGeneration:
    torch.manual_seed(seed)
    model = MATForConditionalGeneration(MATConfig(**TINY, encoder_attention_branches=2, decoder_ffn_branches=2)).eval()
    _perturb_biases(model)
    return model


def test_a_state_dict_of_the_earlier_layout_loads_into_mat_modules(batch):
    """The load hook (Trainer's resume, `load_state_dict` of an old file): one-branch and multi-branch merges."""
    model = _mat_with_biases(21)
    earlier = _earlier_layout(model.state_dict())
    assert any(tensor.dim() == 2 and tensor.shape[0] == 1 for key, tensor in earlier.items() if key.endswith(".bias"))
    fresh = _mat_with_biases(22)
    fresh.load_state_dict(earlier)  # strict: no key left over or missing
    with torch.no_grad():
        assert torch.equal(fresh(**batch).logits, model(**batch).logits)
    classifier = MATRobertaForSequenceClassification(MATRobertaConfig(**ENCODER, num_attention_branches=2)).eval()
    _perturb_biases(classifier)
    other = MATRobertaForSequenceClassification(MATRobertaConfig(**ENCODER, num_attention_branches=2)).eval()
    other.load_state_dict(_earlier_layout(classifier.state_dict(), one_branch_merges=False))
    input_ids, mask = _encoder_batch()
    with torch.no_grad():
        assert torch.equal(other(input_ids, attention_mask=mask).logits, classifier(input_ids, attention_mask=mask).logits)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_checkpoint_folder_of_the_earlier_layout_loads_through_an_upgraded_copy(sharded, batch, tmp_path, monkeypatch):
    model = _mat_with_biases(23)
    folder = tmp_path / "old"
    model.save_pretrained(folder, **({"max_shard_size": "20KB"} if sharded else {}))
    weight_files = sorted(folder.glob("*.safetensors"))
    assert (len(weight_files) > 1) == sharded and (folder / "model.safetensors.index.json").is_file() == sharded
    saved = {}  # what save_pretrained wrote (tied weights once)
    for path in weight_files:
        saved.update(load_file(path))
        save_file(_earlier_layout(load_file(path)), path, metadata={"format": "pt"})
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # nothing may be written to the working directory either

    assert branch_merge.old_layout_checkpoint_keys(str(folder))  # a folder named by a string
    assert branch_merge.checkpoint_in_current_layout(str(tmp_path / "missing"), str(tmp_path)) == str(tmp_path / "missing")
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    upgraded = branch_merge.checkpoint_in_current_layout(str(folder), str(workspace))
    assert upgraded == str(workspace)
    assert (workspace / "config.json").is_symlink() and (workspace / "config.json").read_bytes() == before["config.json"]
    upgraded_files = sorted(workspace.glob("*.safetensors"))
    assert [path.name for path in upgraded_files] == [path.name for path in weight_files]
    current = {}
    for path in upgraded_files:
        assert not path.is_symlink()
        current.update({key: (path.name, tensor) for key, tensor in load_file(path).items()})
    assert set(current) == set(saved)
    for key, (_, tensor) in current.items():
        assert torch.equal(tensor, saved[key]), key
    if sharded:
        index = json.loads((workspace / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == {key: file for key, (file, _) in current.items()}
        assert index["metadata"] == json.loads(before["model.safetensors.index.json"])["metadata"]

    loaded = MATForConditionalGeneration.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, model(**batch).logits)
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before  # the user's folder never written
    assert list(elsewhere.iterdir()) == []

    model.save_pretrained(tmp_path / "current")  # a current checkpoint is used where it is
    assert branch_merge.checkpoint_in_current_layout(str(tmp_path / "current"), str(workspace)) == str(tmp_path / "current")


def test_branch_and_head_factors_are_made_on_the_device_asked_for():
    """`meta` stands in for an accelerator: a factor made on the default device instead would not multiply."""
    for training, rate in ((False, 0.0), (True, 0.0), (True, 0.5)):
        assert drop_branch_keep_scales(3, rate, training=training, device="meta").device.type == "meta"
    assert drop_head_keep_scales(2, 4, 0.5, training=True, device="meta").device.type == "meta"


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_mat_layers_run_on_the_device_of_their_inputs(mode):
    """The official merge always builds its weights, so every merge hook must put them on the inputs' device."""
    config = MATConfig(**TINY, branch_merge="official", drop_branch_rate=0.3, drop_head_rate=0.3)
    with torch.device("meta"):
        attention = getattr(MATAttention(config, 32, 4, num_branches=2), mode)()
        feed_forward = getattr(MATFeedForward(config, 32, 16, num_branches=2), mode)()
        output = getattr(MATEncoderAttentionOutput(MATRobertaConfig(**ENCODER, branch_merge="official",
                                                                    drop_branch_rate=0.3, drop_head_rate=0.3)), mode)()
    x = torch.randn(2, 5, 32, device="meta")
    assert attention(x)[0].device.type == "meta" and attention(x)[0].shape == x.shape
    assert feed_forward(x).device.type == "meta" and feed_forward(x).shape == x.shape
    assert output(torch.randn(2, 5, 64, device="meta"), x).device.type == "meta"


def test_classifier_drop_head_matches_per_head_reference():
    """Eq. 9-10 in the encoder-only classifier: head j of branch i scaled by I{U_ij >= ρ}/(1-ρ), then each
    branch's own projection averaged (Eq. 4), computed here head by head and branch by branch."""
    branches, heads, d = 2, ENCODER["num_attention_heads"], ENCODER["hidden_size"]
    config = MATRobertaConfig(**ENCODER, num_attention_branches=branches, drop_branch_rate=0.0, drop_head_rate=0.5)
    torch.manual_seed(24)
    module = _init_standalone(MATEncoderAttentionOutput(config)).train()
    hidden, residual = torch.randn(3, 5, branches * d), torch.randn(3, 5, d)
    torch.manual_seed(98)
    factors = drop_head_keep_scales(branches, heads, 0.5, training=True)
    assert 0 < factors.count_nonzero() < branches * heads, "seed chosen so some heads drop"
    torch.manual_seed(98)
    with torch.no_grad():
        output = module(hidden, residual)
        head_dim = d // heads
        merged = 0
        for branch in range(branches):
            columns = slice(branch * d, (branch + 1) * d)
            scaled = torch.cat([hidden[..., branch * d + j * head_dim: branch * d + (j + 1) * head_dim]
                                * factors[branch * heads + j] for j in range(heads)], -1)
            merged = merged + (scaled @ module.dense.weight[:, columns].T + module.dense_branch_bias[branch]) / branches
        reference = torch.nn.functional.layer_norm(merged + residual, (d,), module.LayerNorm.weight,
                                                   module.LayerNorm.bias, config.layer_norm_eps)
    torch.testing.assert_close(output, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("is_decoder", [False, True])
def test_classifier_attends_like_its_encoder_without_a_mask(is_decoder):
    """The stock layers build their self-attention with `is_causal=config.is_decoder`; the multi-branch ones must
    too, or an unmasked call (every token real) would not be the encoder's function."""
    torch.manual_seed(25)
    base = RobertaModel(RobertaConfig(**ENCODER, is_decoder=is_decoder)).eval()
    _perturb_biases(base)
    model = MATRobertaForSequenceClassification.from_encoder(base, num_attention_branches=2).eval()
    input_ids = torch.randint(3, ENCODER["vocab_size"], (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model.roberta(input_ids).last_hidden_state, base(input_ids).last_hidden_state,
                                   atol=1e-5, rtol=1e-5)


def test_proximal_initialisation_starts_a_new_model_not_a_copy_of_the_checkpoint(baseline_dir, roberta_dir):
    """The cloned model is not the checkpoint it came from: its config must not name that folder as its own."""
    mat = MATForConditionalGeneration.from_baseline(baseline_dir, encoder_attention_branches=2)
    assert mat.name_or_path == mat.config._name_or_path == ""
    classifier = MATRobertaForSequenceClassification.from_encoder(roberta_dir, num_labels=2)
    assert classifier.name_or_path == classifier.config._name_or_path == ""


@pytest.mark.parametrize("model_class", [MATRobertaForSequenceClassification, MATBertForSequenceClassification])
def test_a_classifier_built_from_its_config_starts_with_zero_branch_biases(model_class):
    """Built from a config (not from an encoder), the per-branch merge biases start at zero like the stock bias,
    not as whatever memory `torch.empty` held (which made the logits NaN)."""
    torch.manual_seed(26)
    model = model_class(model_class.config_class(**ENCODER, num_attention_branches=2)).eval()
    for layer in model.base_model.encoder.layer:
        assert torch.equal(layer.attention.output.dense_branch_bias, torch.zeros(2, ENCODER["hidden_size"]))
    input_ids, mask = _encoder_batch()
    with torch.no_grad():
        assert torch.isfinite(model(input_ids, attention_mask=mask).logits).all()


@pytest.mark.parametrize("model_class", [MATRobertaForSequenceClassification, MATBertForSequenceClassification])
def test_a_classifier_built_from_its_config_is_initialised_like_its_encoder(model_class):
    """Besides the merge biases, every stock module gets the encoder family's own initialisation (Linear weights
    N(0, initializer_range) with zero biases, embeddings N(0, initializer_range)), as the single-branch classifier
    of the same family does, not PyTorch's default uniform ranges."""
    torch.manual_seed(27)
    config = model_class.config_class(**ENCODER, num_attention_branches=2, initializer_range=0.02)
    model = model_class(config)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(torch.equal(m.bias, torch.zeros_like(m.bias)) for m in linears if m.bias is not None)
    weights = torch.cat([m.weight.flatten() for m in linears])
    assert abs(weights.std().item() - 0.02) < 0.002 and abs(weights.mean().item()) < 0.002
    embeddings = model.base_model.embeddings.word_embeddings.weight
    assert abs(embeddings.std().item() - 0.02) < 0.003


def test_a_multi_branch_model_built_under_a_device_context_has_every_weight_on_that_device():
    """The multi-branch merge (`B * in` columns, per-branch biases) follows `with torch.device(...)` too, as
    Transformers' meta-device loading and users' GPU builds need."""
    with torch.device("meta"):
        model = MATForConditionalGeneration(MATConfig(**TINY, encoder_attention_branches=2, decoder_attention_branches=3, encoder_ffn_branches=2))
    elsewhere = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()]
                 if tensor.device.type != "meta"]
    assert not elsewhere


# Round 2 mutation survivors (issue 65)


def _merge_reference(weight, biases, hidden, weights):
    """Σ_b w_b (x_b W_bᵀ + c_b), branch by branch: branch b owns the weight's columns `b*in:(b+1)*in`."""
    num_branches, width = hidden.shape[-2], hidden.shape[-1]
    if weights is None:
        weights = torch.full((num_branches,), 1.0 / num_branches)
    total = 0
    for branch in range(num_branches):
        projected = hidden[..., branch, :] @ weight[:, branch * width:(branch + 1) * width].T + biases[branch]
        w_b = weights[..., branch]
        if weights.dim() == 2:  # one weight per batch row
            w_b = w_b.view(-1, *([1] * (projected.dim() - 1)))
        total = total + w_b * projected
    return total


@pytest.mark.parametrize("num_branches", [1, 3])
@pytest.mark.parametrize("leading", [(4,), (4, 5)], ids=["rows", "rows-positions"])
@pytest.mark.parametrize("weighting", ["average", "per-branch", "per-row"])
def test_merge_branches_is_the_weighted_sum_of_each_branchs_projection(num_branches, leading, weighting):
    """Eq. 4/6 (Eq. 8 for FFN branches): every weighting the callers pass (none, `[B]`, `[batch, B]`) on inputs with
    and without a positions axis, against a branch-by-branch sum (batch 4 ≠ 5 positions, so a weight broadcast
    over the wrong axis cannot line up by chance)."""
    torch.manual_seed(30)
    in_features, out_features = 6, 7
    projection, branch_biases = branch_merge.merge_projection(num_branches, in_features, out_features)
    with torch.no_grad():
        projection.weight.normal_()
        if branch_biases is None:
            projection.bias.normal_()
        else:
            branch_biases.normal_()
    biases = projection.bias[None] if branch_biases is None else branch_biases
    hidden = torch.randn(*leading, num_branches, in_features)
    weights = {"average": None, "per-branch": torch.rand(num_branches) + 0.5,
               "per-row": torch.rand(leading[0], num_branches) + 0.5}[weighting]
    with torch.no_grad():
        merged = branch_merge.merge_branches(projection, branch_biases, hidden, weights)
        expected = _merge_reference(projection.weight, biases, hidden, weights)
    assert merged.shape == (*leading, out_features)
    torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-5)


def test_merge_weights_default_to_the_papers_average():
    """Called without a mode (and with a config's default mode), the merge is the paper's 1/N (Eq. 4)."""
    keep = torch.tensor([1.0, 0.0, 2.0, 1.0])
    assert torch.equal(multi_branch_merge_weights(keep), keep / 4)
    assert torch.equal(multi_branch_merge_weights(keep), multi_branch_merge_weights(keep, MATConfig().branch_merge))
    assert torch.equal(multi_branch_merge_weights(keep), multi_branch_merge_weights(keep, MATRobertaConfig().branch_merge))


@pytest.mark.parametrize("branch_merge_mode", ["paper", "official"])
def test_every_drop_branch_layer_makes_its_factors_on_the_inputs_device(branch_merge_mode):
    """`meta` stands in for an accelerator (built on it, run outside the device context): a drop-branch or
    drop-head factor drawn on the default device would not multiply. Training mode with every rate on."""
    rates = dict(branch_merge=branch_merge_mode, drop_branch_rate=0.3, drop_head_rate=0.3, ffn_drop_branch_rate=0.4)
    config, encoder_config = MATConfig(**TINY, **rates), MATRobertaConfig(**ENCODER, **rates)
    with torch.device("meta"):
        modules = {
            "attention": MATAttention(config, 32, 4, num_branches=2).train(),
            "feed_forward": MATFeedForward(config, 32, 16, num_branches=2).train(),
            "classifier_attention_output": MATEncoderAttentionOutput(encoder_config).train(),
            "classifier_ffn_output": MATRobertaForSequenceClassification(encoder_config)
            .roberta.encoder.layer[0].output.train(),
        }
    x = torch.randn(2, 5, 32, device="meta")
    outputs = {
        "attention": modules["attention"](x)[0],
        "feed_forward": modules["feed_forward"](x),
        "classifier_attention_output": modules["classifier_attention_output"](torch.randn(2, 5, 64, device="meta"), x),
        "classifier_ffn_output": modules["classifier_ffn_output"](torch.randn(2, 5, 48, device="meta"), x),
    }
    for name, output in outputs.items():
        assert output.device.type == "meta" and output.shape == x.shape, name


def test_from_baseline_without_branch_overrides_has_mats_default_branch_counts(baseline_dir):
    """The baseline's own branch counts (one everywhere) are not MAT's: without overrides the new model has the
    MATConfig defaults, in its config and in the width of every attention's projections."""
    mat = MATForConditionalGeneration.from_baseline(baseline_dir)
    defaults = MATConfig()
    d = TINY["encoder_embed_dim"]
    expected = {name: getattr(defaults, name) for name in ("encoder_attention_branches", "decoder_attention_branches",
                                                            "encoder_ffn_branches", "decoder_ffn_branches")}
    assert {name: getattr(mat.config, name) for name in expected} == expected
    assert expected["decoder_attention_branches"] > 1  # else this test could not tell the baseline's counts apart
    for layer in mat.model.encoder.layers:
        assert layer.self_attn.q_proj.weight.shape[0] == expected["encoder_attention_branches"] * d
    for layer in mat.model.decoder.layers:
        assert layer.self_attn.q_proj.weight.shape[0] == expected["decoder_attention_branches"] * d
        assert layer.encoder_attn.q_proj.weight.shape[0] == expected["decoder_attention_branches"] * d


def test_from_baseline_keeps_the_baselines_generation_config(tmp_path):
    """Proximal initialisation clones the model the user trained, decoding settings included."""
    torch.manual_seed(31)
    baseline = FlexformerForConditionalGeneration(FlexformerConfig(**TINY))
    baseline.generation_config.num_beams = 3
    baseline.generation_config.max_length = 11
    baseline.generation_config.length_penalty = 0.6
    baseline.save_pretrained(tmp_path)
    for source in (baseline, tmp_path):
        mat = MATForConditionalGeneration.from_baseline(source, encoder_attention_branches=2)
        settings = mat.generation_config
        assert (settings.num_beams, settings.max_length, settings.length_penalty) == (3, 11, 0.6), source


def test_proximal_initialisation_does_not_carry_the_checkpoints_architecture(baseline_dir, roberta_dir, tmp_path):
    """The new model's config names its own architecture (or none yet), never the checkpoint's class: Transformers
    and the Hub read `architectures` to pick the class to load."""
    torch.manual_seed(32)
    BertModel(BertConfig(**ENCODER)).save_pretrained(tmp_path / "bert")
    models = [
        (MATForConditionalGeneration.from_baseline(baseline_dir), baseline_dir, "FlexformerForConditionalGeneration"),
        (MATRobertaForSequenceClassification.from_encoder(roberta_dir, num_labels=2), roberta_dir, "RobertaModel"),
        (MATBertForSequenceClassification.from_encoder(tmp_path / "bert", num_labels=2), tmp_path / "bert", "BertModel"),
    ]
    for model, checkpoint, checkpoint_class in models:
        assert json.loads((checkpoint / "config.json").read_text())["architectures"] == [checkpoint_class]
        architectures = model.config.architectures
        assert architectures in (None, [type(model).__name__]), (checkpoint_class, architectures)


@pytest.mark.parametrize(
    "model_class",
    [
        MATForConditionalGeneration,
        MATRobertaForSequenceClassification,  # the biases sit under the encoder, a PreTrainedModel of its own
        MATBertForSequenceClassification,
    ],
)
def test_merge_branch_biases_missing_from_a_checkpoint_start_at_zero(model_class, tmp_path):
    """A checkpoint without the per-branch merge biases (saved before they existed, or by hand) loads them at
    their initial value, zero, like any other missing weight; not as uninitialised memory."""
    torch.manual_seed(33)
    if model_class is MATForConditionalGeneration:
        model = model_class(MATConfig(**TINY, encoder_attention_branches=2, decoder_attention_branches=2))
    else:
        model = model_class(model_class.config_class(**ENCODER, num_attention_branches=2))
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    dropped = [key for key in weights if key.endswith("_branch_bias")]
    assert dropped
    save_file({k: v for k, v in weights.items() if k not in dropped}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    loaded = model_class.from_pretrained(tmp_path)
    state = loaded.state_dict()
    for key in dropped:
        assert torch.equal(state[key], torch.zeros_like(state[key])), key
    for key, tensor in weights.items():
        if key not in dropped and key in state:
            assert torch.equal(state[key], tensor), key  # what the checkpoint holds is loaded, not re-initialised


def test_upgraded_weight_files_carry_the_safetensors_metadata_of_a_saved_checkpoint(tmp_path):
    """The copies in the earlier layout's workspace are weight files like `save_pretrained` writes: same header
    metadata (`format: pt`, which safetensors readers check)."""
    from safetensors import safe_open

    model = _mat_with_biases(34)
    folder = tmp_path / "old"
    model.save_pretrained(folder)
    with safe_open(folder / "model.safetensors", framework="pt") as saved:
        saved_metadata = saved.metadata()
    save_file(_earlier_layout(load_file(folder / "model.safetensors")), folder / "model.safetensors",
              metadata=saved_metadata)
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    assert branch_merge.checkpoint_in_current_layout(str(folder), str(workspace)) == str(workspace)
    with safe_open(workspace / "model.safetensors", framework="pt") as upgraded:
        assert upgraded.metadata() == saved_metadata == {"format": "pt"}


# ---- issue 65, round 3: the held-out sample's (seed 2) survivors ----


def test_from_baseline_names_the_baseline_checkpoint_when_a_tensor_is_missing(baseline_dir, monkeypatch):
    """A baseline model whose state lacks a tensor the MAT needs is refused with the checkpoint named."""
    baseline = FlexformerForConditionalGeneration.from_pretrained(baseline_dir)
    full_state = baseline.state_dict()
    missing = next(name for name in full_state if name.endswith("fc1.weight"))
    monkeypatch.setattr(baseline, "state_dict", lambda: {k: v for k, v in full_state.items() if k != missing})
    with pytest.raises(ValueError, match=rf"^The baseline checkpoint has no tensor '{missing}'"):
        MATForConditionalGeneration.from_baseline(baseline, encoder_attention_branches=2)


def test_from_baseline_does_not_take_the_dtype_of_a_half_precision_baseline(baseline_dir):
    """The MAT is built in the default dtype from a bf16 baseline, and its config says so: a config that kept the
    baseline's dtype would make `from_pretrained(dtype="auto")` of the saved MAT load it in bf16."""
    baseline = FlexformerForConditionalGeneration.from_pretrained(baseline_dir, dtype=torch.bfloat16)
    assert baseline.config.dtype == torch.bfloat16
    mat = MATForConditionalGeneration.from_baseline(baseline, encoder_attention_branches=2)
    assert {p.dtype for p in mat.parameters()} == {torch.float32}
    assert getattr(mat.config, "dtype", None) in (None, torch.float32, "float32")


def test_from_encoder_with_a_new_label_set_replaces_the_encoders_labels_both_ways(roberta_dir):
    """Passing only `id2label` (no `num_labels`) gives the classifier that label set and its size, and keeps none of
    the pretrained encoder's label names (its `label2id` is left unset, as Transformers leaves it for `id2label`
    alone, rather than the encoder's stale one)."""
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    model = MATRobertaForSequenceClassification.from_encoder(roberta_dir, id2label=labels)
    assert model.config.id2label == labels
    assert model.config.label2id in (None, {name: index for index, name in labels.items()})
    assert RobertaConfig.from_pretrained(roberta_dir).label2id  # the encoder did carry label names
    assert model.config.num_labels == 3
    assert model.classifier.out_proj.out_features == 3


def test_from_encoder_with_num_labels_drops_the_encoders_label_names(roberta_dir, tmp_path):
    """An encoder saved with its own label names: `num_labels=3` gives three generic labels, not the encoder's two
    names with a count that disagrees with them."""
    encoder = RobertaModel.from_pretrained(roberta_dir)
    encoder.config.id2label = {0: "spam", 1: "ham"}
    encoder.config.label2id = {"spam": 0, "ham": 1}
    encoder.save_pretrained(tmp_path / "labelled")
    for num_labels in (2, 3):  # as many labels as the encoder named, and more
        model = MATRobertaForSequenceClassification.from_encoder(tmp_path / "labelled", num_labels=num_labels)
        assert model.config.num_labels == num_labels
        assert "spam" not in model.config.id2label.values() and len(model.config.id2label) == num_labels
        assert "spam" not in model.config.label2id


def test_registering_the_classifiers_again_keeps_the_auto_classes_working():
    """`register_mat_classifiers` is idempotent: calling it again (as a plugin reload does) keeps each model type
    mapped to its own config and classifier."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from flexformers.modeling.modeling_mat import register_mat_classifiers

    register_mat_classifiers()
    for model_class in (MATRobertaForSequenceClassification, MATBertForSequenceClassification):
        config_class = model_class.config_class
        assert type(AutoConfig.for_model(config_class.model_type)) is config_class
        model = AutoModelForSequenceClassification.from_config(config_class(**ENCODER, num_labels=2))
        assert type(model) is model_class


@pytest.mark.parametrize("model_class", [MATRobertaForSequenceClassification, MATBertForSequenceClassification])
def test_classifier_drop_branch_and_drop_head_keep_a_half_precision_model_in_its_dtype(model_class):
    """Training a bf16 classifier with drop-branch and drop-head: the factors are made in the activations' dtype, so
    every hidden state stays bf16 (factors in float32 would promote the residual stream)."""
    torch.manual_seed(0)
    config = model_class.config_class(**ENCODER, num_labels=2, num_attention_branches=2, drop_branch_rate=0.3,
                                      drop_head_rate=0.2)
    model = model_class(config).to(torch.bfloat16).train()
    input_ids, attention_mask = _encoder_batch()
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    assert out.logits.dtype == torch.bfloat16
    assert {state.dtype for state in out.hidden_states} == {torch.bfloat16}


def test_drop_head_keeps_a_half_precision_encoder_decoder_in_its_dtype(batch):
    """Training a bf16 MAT translation model with drop-head: the head factors are made in the activations' dtype,
    so the attention outputs, the hidden states and the logits stay bf16."""
    torch.manual_seed(0)
    config = MATConfig(**TINY, encoder_attention_branches=2, decoder_attention_branches=2, drop_head_rate=0.3,
                       drop_branch_rate=0.0)
    model = MATForConditionalGeneration(config).to(torch.bfloat16).train()
    out = model(**batch, output_hidden_states=True)
    assert out.logits.dtype == torch.bfloat16
    assert {s.dtype for s in (*out.encoder_hidden_states, *out.decoder_hidden_states)} == {torch.bfloat16}
    assert torch.isfinite(out.loss)


def test_cloning_refuses_tensors_that_differ_on_more_than_one_axis():
    """Proximal initialisation clones a baseline tensor into branches along exactly one axis; shapes that differ on
    two axes (of equal rank) are not a branch layout and are refused by name."""
    from flexformers.modeling.modeling_mat import clone_into_branches

    with pytest.raises(ValueError, match="'layer.weight'"):
        clone_into_branches(torch.zeros(4, 6), torch.ones(2, 3), "layer.weight")
    torch.testing.assert_close(clone_into_branches(torch.zeros(4, 3), torch.ones(2, 3), "layer.weight"),
                               torch.ones(4, 3))


def test_drop_branch_draws_come_from_the_generator_given():
    """With a generator, the drop-branch factors are its draws, whatever the global random state."""
    draws = []
    for global_seed in (0, 5):
        torch.manual_seed(global_seed)
        generator = torch.Generator().manual_seed(1)
        draws.append(drop_branch_keep_scales(32, 0.5, training=True, generator=generator))
    torch.testing.assert_close(draws[0], draws[1], rtol=0, atol=0)
    assert 0 < int(draws[0].eq(0).sum()) < 32


@pytest.mark.parametrize("classifier", [MATRobertaForSequenceClassification, MATBertForSequenceClassification])
def test_a_fresh_classifier_gets_its_encoders_initialisation(classifier):
    """A classifier built from its config (not from an encoder) initialises every module as its encoder family does:
    Linear weights ~ N(0, initializer_range), not PyTorch's default uniform."""
    config = classifier.config_class(**ENCODER, num_attention_branches=2, num_labels=3, initializer_range=0.02)
    torch.manual_seed(0)
    model = classifier(config)
    for linear in (model.base_model.encoder.layer[0].intermediate.dense, model.base_model.encoder.layer[1].output.dense):
        assert abs(linear.weight.std().item() - 0.02) < 0.004
        assert bool((linear.bias == 0).all())


def test_proximal_initialisation_from_an_encoder_names_a_tensor_it_cannot_clone():
    """An override that changes the encoder's shapes (here its width) cannot be a branch layout of the pretrained
    tensors: from_encoder refuses, naming the tensor."""
    torch.manual_seed(3)
    base = RobertaModel(RobertaConfig(**ENCODER)).eval()
    with pytest.raises(ValueError, match=r"Cannot clone baseline tensor '[\w.]+'"):
        MATRobertaForSequenceClassification.from_encoder(base, hidden_size=48, num_attention_branches=2)


@pytest.mark.parametrize("folder", [None, {"path": "x"}])
def test_old_layout_detection_ignores_anything_that_is_not_a_path(folder):
    """`from_pretrained(None, config=..., state_dict=...)` and other non-path arguments have no checkpoint folder to
    read: no upgrade is needed, and none is looked for."""
    assert branch_merge.old_layout_checkpoint_keys(folder) == {}


# ---- issue 65, round 5 ----------------------------------------------------------------------------------------


def test_proximal_initialisation_names_the_baseline_tensor_whose_shape_cannot_be_cloned(baseline_dir):
    """A baseline state whose tensor (a weight, or the bias a merge's per-branch biases come from) has a shape no
    branch layout explains is refused naming that tensor."""
    from flexformers.modeling.modeling_mat import clone_state_dict_into_branches

    mat = MATForConditionalGeneration(MATConfig(**TINY, encoder_attention_branches=2, decoder_attention_branches=2))
    source = FlexformerForConditionalGeneration.from_pretrained(baseline_dir).state_dict()
    assert clone_state_dict_into_branches(mat, source, "The baseline").keys() == mat.state_dict().keys()
    for name, named in [("model.encoder.layers.0.ffn.fc1.weight", "model.encoder.layers.0.ffn.fc1.weight"),
                        ("model.encoder.layers.0.self_attn.out_proj.bias",
                         "model.encoder.layers.0.self_attn.out_proj_branch_bias")]:
        assert name in source and named in mat.state_dict()
        broken = dict(source, **{name: torch.zeros(5, 7)})
        with pytest.raises(ValueError, match=re.escape(f"Cannot clone baseline tensor '{named}'")):
            clone_state_dict_into_branches(mat, broken, "The baseline")


def test_drop_branch_training_keeps_a_half_precision_model_in_its_dtype(batch):
    """The drop-branch merge weights are made in the model's dtype: a bfloat16 model trains in bfloat16 with ρ > 0
    (weights in float32 would promote the merged states and break the next bfloat16 projection)."""
    torch.manual_seed(0)
    config = MATConfig(**TINY, encoder_attention_branches=2, decoder_attention_branches=2, drop_branch_rate=0.3)
    model = MATForConditionalGeneration(config).to(torch.bfloat16).train()
    output = model(**batch, output_hidden_states=True)
    assert output.encoder_last_hidden_state.dtype == torch.bfloat16
    assert output.logits.dtype == torch.bfloat16 and torch.isfinite(output.loss)
    output.loss.backward()


def test_a_bert_encoders_layer_norm_epsilon_is_kept_by_its_multi_branch_layers(tmp_path):
    """The attention output's LayerNorm takes the encoder's `layer_norm_eps` (BERT's 1e-12, here a large 0.5 so the
    difference shows), not PyTorch's 1e-5: the proximal start equals its encoder only with the encoder's epsilon."""
    torch.manual_seed(14)
    base = BertModel(BertConfig(**ENCODER, layer_norm_eps=0.5))
    base.save_pretrained(tmp_path)
    base.eval()
    model = MATBertForSequenceClassification.from_encoder(tmp_path, num_attention_branches=2).eval()
    assert model.bert.encoder.layer[0].attention.output.LayerNorm.eps == 0.5
    input_ids, mask = _encoder_batch()
    with torch.no_grad():
        torch.testing.assert_close(
            model.bert(input_ids, attention_mask=mask).last_hidden_state,
            base(input_ids, attention_mask=mask).last_hidden_state, atol=1e-5, rtol=1e-5,
        )


def test_registering_the_mat_classifiers_again_is_harmless():
    """`register_mat_classifiers` runs at import; a second call (a reload, a notebook re-running its imports) must not
    raise and keeps the same classes behind the Auto classes. (Its `exist_ok=True` is not what makes this pass:
    Transformers refuses only its own config classes; see benchmarks/mutation_equivalent.json.)"""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from flexformers.modeling.modeling_mat import register_mat_classifiers

    register_mat_classifiers()
    register_mat_classifiers()
    config = MATRobertaConfig(**ENCODER)
    assert type(AutoConfig.for_model("mat_roberta", **ENCODER)) is MATRobertaConfig
    assert type(AutoModelForSequenceClassification.from_config(config)) is MATRobertaForSequenceClassification


# ---- issue 65, round 7: the held-out sample's (seed 5) survivors ----


def test_a_baseline_config_that_leaves_the_branch_counts_at_their_default_is_a_baseline(baseline_dir, tmp_path):
    """A flexformer config.json without the branch-count fields (written by hand, or by a version that did not
    write defaults) describes the single-branch baseline: the counts default to 1, so proximal initialisation
    accepts it and starts from the same weights."""
    import shutil

    folder = tmp_path / "baseline"
    shutil.copytree(baseline_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    for name in ("encoder_attention_branches", "decoder_attention_branches", "encoder_ffn_branches",
                 "decoder_ffn_branches"):
        config.pop(name, None)
    (folder / "config.json").write_text(json.dumps(config))
    assert FlexformerForConditionalGeneration.from_pretrained(folder).config.encoder_attention_branches == 1
    torch.manual_seed(3)
    from_stripped = MATForConditionalGeneration.from_baseline(folder, encoder_attention_branches=2)
    torch.manual_seed(3)
    from_saved = MATForConditionalGeneration.from_baseline(baseline_dir, encoder_attention_branches=2)
    stripped_state, saved_state = from_stripped.state_dict(), from_saved.state_dict()
    assert stripped_state.keys() == saved_state.keys()
    for key, tensor in saved_state.items():
        assert torch.equal(stripped_state[key], tensor), key


# ---- issue 65, round 8: the held-out sample's (seed 6) survivors ----


def test_proximal_initialisation_gives_a_mat_config_not_one_that_says_it_is_the_baseline(baseline_dir, tmp_path):
    """The baseline's config fields seed the new MATConfig, but its `model_type` must not: a config whose instance
    says "flexformer" would send every lookup by model type (method registry, Auto classes) to the baseline."""
    mat = MATForConditionalGeneration.from_baseline(baseline_dir)
    assert mat.config.model_type == "mat"
    mat.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "mat"


@pytest.mark.parametrize("model_class", [MATRobertaForSequenceClassification, MATBertForSequenceClassification])
def test_a_classifier_from_a_remote_code_encoder_does_not_point_to_its_code(model_class, tmp_path):
    """An encoder loaded with remote code carries `auto_map` (which files define its classes); the multi-branch
    classifier built from it is another model, so it must not inherit that map: saved and shared, it would load the
    encoder's remote classes instead of its own."""
    torch.manual_seed(30)
    base_class, config_class = (RobertaModel, RobertaConfig) if model_class is MATRobertaForSequenceClassification \
        else (BertModel, BertConfig)
    base = base_class(config_class(**ENCODER))
    base.config.auto_map = {"AutoModel": "modeling_custom.CustomEncoder"}
    model = model_class.from_encoder(base, num_attention_branches=2)
    assert getattr(model.config, "auto_map", None) is None
    model.save_pretrained(tmp_path)
    assert "auto_map" not in json.loads((tmp_path / "config.json").read_text())
