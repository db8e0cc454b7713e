"""The ecosystem's tools on every projection (issue 61, items 3 and 4), for every model type beside BART:

- `torch.ao.quantization.quantize_dynamic(model, {nn.Linear})` swaps every projection (q/k/v, out_proj, fc1, fc2,
  the output layer, Depth-Adaptive's exits, InDIGO's pointer projections) and the quantized model generates;
- PEFT's LoRA adapts every projection under its usual name (`target_modules` naming them, and "all-linear"):
  train, merge, save, reload;
- the packed CPU products are still taken for plain projections, and never for a quantized or adapted one;
- checkpoints saved before the merges became plain `nn.Linear`s (bias `[1, out]`, MAT's `[B, out]`) load with the
  same outputs.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForSeq2SeqLM, BartConfig, BartForConditionalGeneration

from flexformers.modeling import cpu_kernels
from tests.test_conformance import MODEL_TYPES, source_batch, tiny_model

ALL_TYPES = [*MODEL_TYPES, "bart"]
#: the usual names of the projections in a Transformer layer (BART's and ours alike)
LAYER_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
LABELS = torch.tensor([[12, 13, 14, 2], [15, 16, 2, -100], [17, 2, -100, -100]])


def build(model_type: str, seed: int = 0) -> nn.Module:
    if model_type == "bart":
        torch.manual_seed(seed)
        config = BartConfig(
            vocab_size=60, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
        )
        return BartForConditionalGeneration(config).eval()
    return tiny_model(model_type, seed=seed)


def layer_projection_names(model: nn.Module) -> list[str]:
    """The layers' projections by their usual names, whatever their class."""
    return [name for name, _ in model.named_modules() if name.rpartition(".")[2] in LAYER_PROJECTIONS]


def projection_names(model: nn.Module) -> list[str]:
    """Every linear projection of the model by name: the layers' six, the output layer and any other projection
    (Depth-Adaptive's exits, InDIGO's pointer)."""
    linears = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    return sorted(linears | set(layer_projection_names(model)))


def loss_and_logits(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    output = model(input_ids=source_batch(), labels=LABELS)
    return output.loss, output.logits


def generate(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(source_batch(), max_new_tokens=5, num_beams=2)


# ---- dynamic quantization ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ALL_TYPES)
def test_dynamic_quantization_swaps_every_projection_and_the_model_generates(model_type):
    model = build(model_type)
    names = projection_names(model)
    expected_layer_projections = 2 * len(LAYER_PROJECTIONS) + 2 * (len(LAYER_PROJECTIONS) + 4)  # 2 enc + 2 dec layers
    assert len(layer_projection_names(model)) == expected_layer_projections
    assert "lm_head" in names
    with torch.no_grad():
        float_logits = loss_and_logits(model)[1]
    quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    modules = dict(quantized.named_modules())
    not_swapped = [name for name in names if type(modules[name]) is not torch.ao.nn.quantized.dynamic.Linear]
    assert not not_swapped, f"{len(not_swapped)} of {len(names)} projections not quantized: {not_swapped}"
    with torch.no_grad():
        quantized_logits = loss_and_logits(quantized)[1]
    assert not torch.equal(quantized_logits, float_logits)  # the int8 products ran
    # int8 weights and activations: close to the float model (within a tenth of the logits' range)
    assert (quantized_logits - float_logits).abs().max() < 0.1 * float_logits.abs().max()
    sequences = generate(quantized)
    assert sequences.shape[0] == source_batch().shape[0] and sequences.shape[1] >= 2


# ---- LoRA --------------------------------------------------------------------------------------------------------


def _adapted_names(model: nn.Module) -> set[str]:
    from peft.tuners.lora import LoraLayer

    return {name.removeprefix("base_model.model.") for name, module in model.named_modules()
            if isinstance(module, LoraLayer)}


@pytest.mark.parametrize("model_type", ALL_TYPES)
def test_lora_adapts_every_projection_by_its_usual_name_trains_merges_saves_and_reloads(model_type, tmp_path):
    peft = pytest.importorskip("peft")
    model = build(model_type)
    expected = set(layer_projection_names(model))
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=LAYER_PROJECTIONS))
    assert _adapted_names(adapted) == expected
    with torch.no_grad():
        untrained_logits = loss_and_logits(adapted)[1]
    optimizer = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=1e-2)
    adapted.train()
    for _ in range(3):
        loss, _ = loss_and_logits(adapted)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    adapted.eval()
    with torch.no_grad():
        adapted_logits = loss_and_logits(adapted)[1]
    assert (adapted_logits - untrained_logits).abs().max() > 1e-3  # the adapters of out_proj/fc2 learnt too
    trained = {name.rpartition(".")[0].rpartition(".lora_B")[0] for name, parameter in adapted.named_parameters()
               if "lora_B" in name and parameter.abs().sum() > 0}
    assert any(name.endswith("out_proj") for name in trained) and any(name.endswith("fc2") for name in trained)

    adapted.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(build(model_type), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(loss_and_logits(reloaded)[1], adapted_logits, atol=1e-5, rtol=1e-5)

    merged = adapted.merge_and_unload()
    assert all(type(module) is nn.Linear for name, module in merged.named_modules() if name in expected)
    with torch.no_grad():
        torch.testing.assert_close(loss_and_logits(merged)[1], adapted_logits, atol=1e-4, rtol=1e-4)
    assert generate(merged).shape[1] >= 2


@pytest.mark.parametrize("model_type", ALL_TYPES)
def test_lora_all_linear_adapts_every_projection_but_the_output_layer(model_type):
    peft = pytest.importorskip("peft")
    model = build(model_type)
    every_projection, layer_projections = set(projection_names(model)), set(layer_projection_names(model))
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
    names = _adapted_names(adapted)
    assert layer_projections <= names
    assert names == every_projection - {"lm_head"}  # PEFT leaves the output layer out of "all-linear"


# ---- the packed CPU products -------------------------------------------------------------------------------------


@pytest.fixture
def always_prepack(monkeypatch):
    """The packed oneDNN path wherever a product may take it (tiny weights never pay on their own)."""
    if not cpu_kernels._prepacking_possible():
        pytest.skip("this torch build has no oneDNN linear")
    monkeypatch.setattr(cpu_kernels, "PREPACK_INFERENCE_WEIGHTS", True)
    monkeypatch.setattr(cpu_kernels, "_prepacking_pays", lambda rows, weight: True)
    cpu_kernels._PACKED_WEIGHTS.clear()
    return cpu_kernels


def _packed_owners(model: nn.Module) -> set[str]:
    return {name for name, module in model.named_modules() if module in cpu_kernels._PACKED_WEIGHTS}


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_plain_projections_take_the_packed_products_and_quantized_or_adapted_ones_do_not(model_type, always_prepack):
    peft = pytest.importorskip("peft")
    model = build(model_type)
    with torch.no_grad():
        plain = generate(model)
    packed = _packed_owners(model)
    assert any(name.endswith("fc1") for name in packed) and any(name.endswith("out_proj") for name in packed)
    assert any(name.endswith("fc2") for name in packed)
    assert any(projection in cpu_kernels._PACKED_WEIGHTS for projection in model.vocabulary_projections())

    always_prepack._PACKED_WEIGHTS.clear()
    quantized = torch.ao.quantization.quantize_dynamic(build(model_type), {nn.Linear}, dtype=torch.qint8)
    generate(quantized)
    assert not _packed_owners(quantized)

    always_prepack._PACKED_WEIGHTS.clear()
    adapted = peft.get_peft_model(build(model_type), peft.LoraConfig(r=4, target_modules=LAYER_PROJECTIONS)).eval()
    with torch.no_grad():
        assert torch.equal(adapted.base_model.model.generate(source_batch(), max_new_tokens=5, num_beams=2), plain)
    packed = _packed_owners(adapted)
    assert not any(name.rpartition(".")[2] in LAYER_PROJECTIONS or ".base_layer" in name for name in packed)
    outputs = adapted.base_model.model.vocabulary_projections()  # not adapted: still packed
    assert any(projection in cpu_kernels._PACKED_WEIGHTS for projection in outputs)


# ---- checkpoints of the earlier layout ---------------------------------------------------------------------------


def _to_earlier_layout(folder) -> None:
    """Rewrite a saved checkpoint's weights as the code before issue 61 saved them: every merge bias `[B, out]`
    under `<name>.bias` (`[1, out]` for one branch)."""
    path = folder / "model.safetensors"
    state = load_file(path)
    earlier = {}
    for key, tensor in state.items():
        module_path, _, leaf = key.rpartition(".")
        name = module_path.rpartition(".")[2]
        if leaf == "bias" and name in ("out_proj", "fc2"):
            earlier[key] = tensor.unsqueeze(0)
        elif key.endswith("_branch_bias"):
            earlier[key.removesuffix("_branch_bias") + ".bias"] = tensor
        else:
            earlier[key] = tensor
    assert earlier.keys() != state.keys() or any(earlier[k].shape != state[k].shape for k in state)
    save_file(earlier, path, metadata={"format": "pt"})


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_a_checkpoint_of_the_earlier_merge_layout_loads_with_the_same_outputs(model_type, tmp_path):
    model = build(model_type, seed=3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "bias" in name:
                parameter.normal_(0.0, 0.1)
        expected = loss_and_logits(model)
    model.save_pretrained(tmp_path / "old")
    _to_earlier_layout(tmp_path / "old")
    before = {path.name: path.read_bytes() for path in (tmp_path / "old").iterdir()}

    loaded, info = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "old", output_loading_info=True)
    assert not any(info.values()), info
    assert loaded.name_or_path == str(tmp_path / "old")
    with torch.no_grad():
        got = loss_and_logits(loaded.eval())
    torch.testing.assert_close(got[1], expected[1], atol=0.0, rtol=0.0)
    assert {path.name: path.read_bytes() for path in (tmp_path / "old").iterdir()} == before  # never written

    # the torch-level path (Trainer's resume, load_state_dict of an old file) too
    fresh = build(model_type, seed=5)
    fresh.load_state_dict(load_file(tmp_path / "old" / "model.safetensors"), strict=False)
    with torch.no_grad():
        torch.testing.assert_close(loss_and_logits(fresh.eval())[1], expected[1], atol=0.0, rtol=0.0)

    # saved again, it is in the current layout
    loaded.save_pretrained(tmp_path / "new")
    assert all(tensor.dim() == 1 for key, tensor in load_file(tmp_path / "new" / "model.safetensors").items()
               if key.endswith((".out_proj.bias", ".fc2.bias")))
