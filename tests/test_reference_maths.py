"""The maths against independent references (issue 65): the other backbone tests compare the model with itself
(eager vs SDPA, cached vs uncached, fused vs per-branch), which a wrong formula passes. Here the attention, the
whole encoder-decoder, the sinusoidal positions and the label-smoothed loss are compared with references that do not
call our modules — `torch.nn.MultiheadAttention`, Transformers' `FSMTForConditionalGeneration` (fairseq's
transformer ported to HF), and plain-torch formulas written from the paper / fairseq in this file — and each model
type's outputs with numbers stored in tests/data/expected_outputs.json (written by
benchmarks/make_expected_outputs.py; regenerate them only when a change is meant to change them)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import flexformers  # noqa: F401  (registers the model types)
from flexformers.configuration import FlexformerConfig
from flexformers.modeling import FlexformerForConditionalGeneration
from flexformers.modeling.losses import label_smoothed_nll_loss
from flexformers.modeling.modeling_flexformer import padding_mask
from flexformers.modeling.positional_embeddings import SinusoidalPositionalEmbedding, sinusoidal_table
from tests.conftest import tiny_config_kwargs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import make_expected_outputs

PAD = 1
IMPLEMENTATIONS = ("eager", "sdpa")
# Right padding in one row, left padding in another: masks and positions both matter.
SOURCE = torch.tensor([[5, 6, 7, 8, 9, 2], [10, 11, 12, 2, PAD, PAD], [PAD, 13, 14, 15, 16, 2]])
TARGET = torch.tensor([[2, 20, 21, 22, 23], [2, 30, 31, 32, 33], [2, 40, 41, 42, 43]])


def randomized_model(seed=0, attn_implementation="eager", **overrides) -> FlexformerForConditionalGeneration:
    """A tiny model whose every parameter (biases and LayerNorms included, which start at 0 / 1) is random, so a
    reference that drops or mis-wires any of them disagrees."""
    torch.manual_seed(seed)
    model = FlexformerForConditionalGeneration(FlexformerConfig(**tiny_config_kwargs(**overrides))).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "layer_norm" in name and name.endswith("weight"):
                parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
            else:
                parameter.normal_(0.0, 0.3)
    model.set_attn_implementation(attn_implementation)
    return model


# --------------------------------------------------------------------------------------------------------------------
# Independent references, written from "Attention Is All You Need" and fairseq; none calls a flexformers module.
# --------------------------------------------------------------------------------------------------------------------


def reference_attention(weights: dict, prefix: str, queries, keys_values, allowed, num_heads):
    """softmax(Q Kᵀ / √head_dim + mask) V, then the output projection; `allowed` `[batch, 1 | q, k]` is True where
    a query may attend. Returns (output, attention weights `[batch, heads, q, k]`)."""
    batch, q_len, dim = queries.shape
    head_dim = dim // num_heads

    def heads(states, name):
        projected = F.linear(states, weights[f"{prefix}.{name}.weight"], weights[f"{prefix}.{name}.bias"])
        return projected.view(batch, -1, num_heads, head_dim).transpose(1, 2)

    query, key, value = heads(queries, "q_proj"), heads(keys_values, "k_proj"), heads(keys_values, "v_proj")
    scores = query @ key.transpose(-1, -2) / math.sqrt(head_dim)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probabilities = scores.softmax(-1)
    context = (probabilities @ value).transpose(1, 2).reshape(batch, q_len, dim)
    output = F.linear(context, weights[f"{prefix}.out_proj.weight"], weights[f"{prefix}.out_proj.bias"])
    return output, probabilities


def reference_sinusoids(num_positions: int, dim: int, padding_idx: int) -> torch.Tensor:
    """fairseq's table: row p holds sin(p·ω_i) for i < dim/2 then cos(p·ω_i), ω_i = 10000^(−i/(dim/2 − 1)); an odd
    dim gets a zero last column; the padding row is zero."""
    half = dim // 2
    table = torch.zeros(num_positions, dim, dtype=torch.float64)
    for position in range(num_positions):
        for i in range(half):
            angle = position * 10000.0 ** (-i / (half - 1))
            table[position, i] = math.sin(angle)
            table[position, half + i] = math.cos(angle)
    table[padding_idx] = 0
    return table.float()


def reference_positions(input_ids: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """fairseq's positions: the k-th non-padding token of a row (k = 1, 2, ...) is at padding_idx + k; padding
    tokens are at padding_idx."""
    positions = torch.full_like(input_ids, padding_idx)
    for row in range(input_ids.shape[0]):
        count = 0
        for column in range(input_ids.shape[1]):
            if input_ids[row, column] != padding_idx:
                count += 1
                positions[row, column] = padding_idx + count
    return positions


def reference_forward(model: FlexformerForConditionalGeneration, source, target) -> torch.Tensor:
    """fairseq's transformer (Vaswani et al. 2017; fairseq's TransformerEncoder/Decoder) from the parameters alone:
    √d-scaled embeddings + sinusoidal positions, blocks of residual sub-layers with LayerNorm after (post-norm) or
    before (pre-norm, then a final LayerNorm), ReLU feed-forward, output projection onto the vocabulary. Returns the
    logits."""
    config = model.config
    weights = dict(model.named_parameters())
    weights["lm_head.weight"] = model.lm_head.weight
    weights["model.decoder.embed_tokens.weight"] = model.model.decoder.embed_tokens.weight

    def layer_norm(name, states):
        return F.layer_norm(states, states.shape[-1:], weights[f"{name}.weight"], weights[f"{name}.bias"], 1e-5)

    def sublayer(name, states, normalize_before, compute):
        residual = states
        if normalize_before:
            states = layer_norm(name, states)
        states = residual + compute(states)
        return states if normalize_before else layer_norm(name, states)

    def feed_forward(prefix, states):
        inner = F.relu(F.linear(states, weights[f"{prefix}.ffn.fc1.weight"], weights[f"{prefix}.ffn.fc1.bias"]))
        return F.linear(inner, weights[f"{prefix}.ffn.fc2.weight"], weights[f"{prefix}.ffn.fc2.bias"])

    def embed(side, ids):
        dim = weights[f"model.{side}.embed_tokens.weight"].shape[1]
        table = reference_sinusoids(64 + PAD + 1, dim, PAD)
        return weights[f"model.{side}.embed_tokens.weight"][ids] * math.sqrt(dim) + table[reference_positions(ids, PAD)]

    source_allowed = source.ne(PAD)[:, None, :]
    states = embed("encoder", source)
    for index in range(config.encoder_layers):
        prefix = f"model.encoder.layers.{index}"
        states = sublayer(
            f"{prefix}.self_attn_layer_norm", states, config.encoder_normalize_before,
            lambda x, p=prefix: reference_attention(
                weights, f"{p}.self_attn", x, x, source_allowed, config.encoder_attention_heads
            )[0],
        )
        states = sublayer(
            f"{prefix}.final_layer_norm", states, config.encoder_normalize_before,
            lambda x, p=prefix: feed_forward(p, x),
        )
    if config.encoder_normalize_before:
        states = layer_norm("model.encoder.layer_norm", states)
    encoder_states = states

    length = target.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None]
    states = embed("decoder", target)
    heads = config.decoder_attention_heads
    for index in range(config.decoder_layers):
        prefix = f"model.decoder.layers.{index}"
        states = sublayer(
            f"{prefix}.self_attn_layer_norm", states, config.decoder_normalize_before,
            lambda x, p=prefix: reference_attention(weights, f"{p}.self_attn", x, x, causal, heads)[0],
        )
        states = sublayer(
            f"{prefix}.encoder_attn_layer_norm", states, config.decoder_normalize_before,
            lambda x, p=prefix: reference_attention(
                weights, f"{p}.encoder_attn", x, encoder_states, source_allowed, heads
            )[0],
        )
        states = sublayer(
            f"{prefix}.final_layer_norm", states, config.decoder_normalize_before,
            lambda x, p=prefix: feed_forward(p, x),
        )
    if config.decoder_normalize_before:
        states = layer_norm("model.decoder.layer_norm", states)
    return states @ weights["lm_head.weight"].T


def reference_label_smoothed_loss(logits, labels, epsilon, ignore_index=-100):
    """fairseq 0.12's `label_smoothed_nll_loss`: with ε_i = ε / (V − 1),
    loss = Σ_t (1 − ε − ε_i)·(−log p_{y_t}) + ε_i·Σ_v (−log p_v) over non-ignored tokens, divided by their count.
    Returns (loss, nll)."""
    log_probs = logits.log_softmax(-1)
    kept = labels.ne(ignore_index)
    safe = labels.masked_fill(~kept, 0)
    nll = -log_probs.gather(-1, safe[..., None]).squeeze(-1) * kept
    smooth = -log_probs.sum(-1) * kept
    spread = epsilon / (logits.shape[-1] - 1)
    tokens = kept.sum()
    return ((1 - epsilon - spread) * nll.sum() + spread * smooth.sum()) / tokens, nll.sum() / tokens


# --------------------------------------------------------------------------------------------------------------------
# 1. Attention
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("heads", [4, 2])
def test_attention_matches_the_formula_and_torch_multihead_attention(implementation, heads):
    """Each attention module (causal self-attention, self-attention with a key padding mask, cross-attention) equals
    softmax(QKᵀ/√head_dim + mask)V with its weights copied, and `torch.nn.MultiheadAttention` with them too;
    head_dim (8 or 16) ≠ embed_dim (32), so a 1/√embed_dim scale fails."""
    model = randomized_model(
        attn_implementation=implementation, encoder_attention_heads=heads, decoder_attention_heads=heads
    )
    weights = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(5)
    queries = torch.randn(3, 5, 32, generator=generator)
    memory = torch.randn(3, 6, 32, generator=generator)
    allowed_keys = SOURCE.ne(PAD)
    encoder_layer, decoder_layer = model.model.encoder.layers[0], model.model.decoder.layers[0]
    cases = {
        "causal self-attention": (
            decoder_layer.self_attn, "model.decoder.layers.0.self_attn", queries, None, None,
            torch.ones(5, 5, dtype=torch.bool).tril()[None],
        ),
        "padded self-attention": (
            encoder_layer.self_attn, "model.encoder.layers.0.self_attn", memory, None,
            padding_mask(allowed_keys.long(), torch.float32), allowed_keys[:, None, :],
        ),
        "cross-attention": (
            decoder_layer.encoder_attn, "model.decoder.layers.0.encoder_attn", queries, memory,
            padding_mask(allowed_keys.long(), torch.float32), allowed_keys[:, None, :],
        ),
    }
    for case, (module, prefix, hidden, key_value_states, mask, allowed) in cases.items():
        keys_values = hidden if key_value_states is None else key_value_states
        with torch.no_grad():
            output, returned_weights = module(
                hidden, key_value_states=key_value_states, attention_mask=mask, output_attentions=True
            )
            plain_output, _ = module(hidden, key_value_states=key_value_states, attention_mask=mask)
            expected_output, expected_weights = reference_attention(weights, prefix, hidden, keys_values, allowed, heads)
            torch_attention = torch.nn.MultiheadAttention(32, heads, batch_first=True)
            torch_attention.in_proj_weight.copy_(
                torch.cat([weights[f"{prefix}.{name}.weight"] for name in ("q_proj", "k_proj", "v_proj")])
            )
            torch_attention.in_proj_bias.copy_(
                torch.cat([weights[f"{prefix}.{name}.bias"] for name in ("q_proj", "k_proj", "v_proj")])
            )
            torch_attention.out_proj.weight.copy_(weights[f"{prefix}.out_proj.weight"])
            torch_attention.out_proj.bias.copy_(weights[f"{prefix}.out_proj.bias"])
            torch_output, torch_weights = torch_attention(
                hidden, keys_values, keys_values,
                attn_mask=~allowed.expand(hidden.shape[0], hidden.shape[1], -1).repeat_interleave(heads, 0),
                need_weights=True, average_attn_weights=False,
            )
        for name, actual in (("output", output), ("output without weights", plain_output)):
            torch.testing.assert_close(actual, expected_output, atol=1e-5, rtol=1e-4, msg=f"{case}: {name}")
            torch.testing.assert_close(actual, torch_output, atol=1e-5, rtol=1e-4, msg=f"{case}: {name} vs torch")
        torch.testing.assert_close(returned_weights, expected_weights, atol=1e-6, rtol=1e-4, msg=f"{case}: weights")
        torch.testing.assert_close(returned_weights, torch_weights, atol=1e-6, rtol=1e-4, msg=f"{case}: torch weights")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_output_attentions_of_the_model_match_the_formula(implementation):
    """`output_attentions=True` on the whole model: the first encoder block's weights, the first decoder block's
    self-attention weights (on the embeddings) and its cross-attention weights (on the self-attention sub-layer's
    LayerNorm-ed output, post-norm) are the formula's."""
    model = randomized_model(attn_implementation=implementation)
    weights = dict(model.named_parameters())
    with torch.no_grad():
        outputs = model(input_ids=SOURCE, decoder_input_ids=TARGET, output_attentions=True)
        encoder_input = model.model.encoder.embed(SOURCE)
        decoder_input = model.model.decoder.embed(TARGET)
    _, expected_encoder = reference_attention(
        weights, "model.encoder.layers.0.self_attn", encoder_input, encoder_input, SOURCE.ne(PAD)[:, None, :], 4
    )
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None]
    _, expected_decoder = reference_attention(
        weights, "model.decoder.layers.0.self_attn", decoder_input, decoder_input, causal, 4
    )
    self_attention_output, _ = reference_attention(
        weights, "model.decoder.layers.0.self_attn", decoder_input, decoder_input, causal, 4
    )
    cross_attention_input = F.layer_norm(
        decoder_input + self_attention_output, (32,), weights["model.decoder.layers.0.self_attn_layer_norm.weight"],
        weights["model.decoder.layers.0.self_attn_layer_norm.bias"],
    )
    _, expected_cross = reference_attention(
        weights, "model.decoder.layers.0.encoder_attn", cross_attention_input, outputs.encoder_last_hidden_state,
        SOURCE.ne(PAD)[:, None, :], 4,
    )
    torch.testing.assert_close(outputs.encoder_attentions[0], expected_encoder, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(outputs.decoder_attentions[0], expected_decoder, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(outputs.cross_attentions[0], expected_cross, atol=1e-6, rtol=1e-4)


# --------------------------------------------------------------------------------------------------------------------
# 2. The whole model
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "overrides",
    [
        {},  # post-norm, untied output layer
        {"encoder_normalize_before": True, "decoder_normalize_before": True, "share_all_embeddings": True},
    ],
    ids=["post-norm", "pre-norm-shared"],
)
def test_logits_match_the_plain_torch_reference(implementation, overrides):
    """The whole encoder-decoder equals a plain-torch fairseq transformer at equal weights, post-norm and pre-norm
    (with its final LayerNorms) alike."""
    model = randomized_model(attn_implementation=implementation, **overrides)
    with torch.no_grad():
        logits = model(input_ids=SOURCE, decoder_input_ids=TARGET).logits
        expected = reference_forward(model, SOURCE, TARGET)
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_logits_match_transformers_fsmt(implementation):
    """Transformers' FSMT (fairseq's post-norm transformer ported to HF; it has no pre-norm, so only post-norm is
    compared) with our weights copied gives our logits."""
    from transformers import FSMTConfig, FSMTForConditionalGeneration

    model = randomized_model(attn_implementation=implementation)
    config = FSMTConfig(
        langs=["en", "de"], src_vocab_size=60, tgt_vocab_size=60, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        activation_function="relu", dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        max_position_embeddings=64, pad_token_id=PAD, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        scale_embedding=True, tie_word_embeddings=False,
    )
    fsmt = FSMTForConditionalGeneration(config).eval()
    ours = model.state_dict()
    copied = {}
    for name, value in fsmt.state_dict().items():
        if "embed_positions" in name:  # FSMT's own sinusoidal table (not a parameter of ours)
            copied[name] = value
        elif name == "model.decoder.output_projection.weight":
            copied[name] = ours["lm_head.weight"]
        else:
            copied[name] = ours[name.replace(".fc1", ".ffn.fc1").replace(".fc2", ".ffn.fc2")]
    fsmt.load_state_dict(copied, strict=True)
    with torch.no_grad():
        logits = model(input_ids=SOURCE, decoder_input_ids=TARGET).logits
        # use_cache=False: FSMT builds its causal mask only then
        expected = fsmt(
            input_ids=SOURCE, attention_mask=SOURCE.ne(PAD).long(), decoder_input_ids=TARGET, use_cache=False
        ).logits
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-4)


# --------------------------------------------------------------------------------------------------------------------
# 3. Positions and the loss
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [32, 7])
def test_sinusoidal_positions_match_fairseqs_formula(dim):
    """The table is fairseq's (sin half, cos half, zero padding row), and a padded batch's positions start at
    padding_idx + 1 counting only real tokens (left padding shifts nothing); incremental steps continue them."""
    torch.testing.assert_close(sinusoidal_table(70, dim, PAD), reference_sinusoids(70, dim, PAD), atol=2e-6, rtol=0)
    embedding = SinusoidalPositionalEmbedding(dim, PAD, init_size=8)  # grown on demand past 8
    table = reference_sinusoids(70, dim, PAD)
    ids = torch.cat([SOURCE, SOURCE[:, :4]], dim=1)
    torch.testing.assert_close(embedding(ids), table[reference_positions(ids, PAD)], atol=2e-6, rtol=0)
    step = torch.tensor([[7], [8], [9]])
    torch.testing.assert_close(embedding(step, past_length=5), table[PAD + 6].expand(3, 1, dim), atol=2e-6, rtol=0)


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_label_smoothed_loss_and_gradient_match_fairseqs_formula(epsilon):
    """`label_smoothed_nll_loss` (its own fused autograd function) equals fairseq's formula — loss, logged NLL and
    the gradient of the logits — with ignored (-100) tokens, and with Trainer's num_items_in_batch."""
    generator = torch.Generator().manual_seed(3)
    logits = (2 * torch.randn(3, 5, 11, generator=generator)).requires_grad_()
    labels = torch.randint(0, 11, (3, 5), generator=generator)
    labels[1, 3:] = -100
    labels[2, 0] = -100
    loss, nll = label_smoothed_nll_loss(logits, labels, epsilon)
    (gradient,) = torch.autograd.grad(loss, logits)
    reference_logits = logits.detach().double().requires_grad_()
    expected_loss, expected_nll = reference_label_smoothed_loss(reference_logits, labels, epsilon)
    (expected_gradient,) = torch.autograd.grad(expected_loss, reference_logits)
    torch.testing.assert_close(loss.double(), expected_loss.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(nll.double(), expected_nll.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gradient.double(), expected_gradient, atol=1e-6, rtol=1e-5)
    assert float(gradient[1, 3:].abs().sum()) == 0.0  # ignored tokens get no gradient
    tokens = int(labels.ne(-100).sum())
    scaled_loss, _ = label_smoothed_nll_loss(logits, labels, epsilon, num_items_in_batch=2 * tokens)
    torch.testing.assert_close(scaled_loss.double(), expected_loss.detach() / 2, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------------------------------------------------
# 4. Stored outputs of every model type
# --------------------------------------------------------------------------------------------------------------------

EXPECTED_FILE = ROOT / "tests" / "data" / "expected_outputs.json"


def assert_matches_stored(actual, stored, where: str) -> None:
    """Floats within atol 1e-5 + rtol 1e-4 (survives torch versions and both attention functions); integers (token
    ids, counts) and None exactly."""
    if isinstance(stored, dict):
        assert set(actual) == set(stored), f"{where}: fields {sorted(actual)} != stored {sorted(stored)}"
        for key in stored:
            assert_matches_stored(actual[key], stored[key], f"{where}.{key}")
    elif isinstance(stored, list):
        assert len(actual) == len(stored), f"{where}: length {len(actual)} != stored {len(stored)}"
        for index, (value, expected) in enumerate(zip(actual, stored)):
            assert_matches_stored(value, expected, f"{where}[{index}]")
    elif isinstance(stored, float):
        assert math.isclose(actual, stored, rel_tol=1e-4, abs_tol=1e-5), f"{where}: {actual!r} != stored {stored!r}"
    else:
        assert actual == stored, f"{where}: {actual!r} != stored {stored!r}"


@pytest.fixture(scope="module")
def stored_outputs() -> dict:
    return json.loads(EXPECTED_FILE.read_text())


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("model_type", make_expected_outputs.MODEL_TYPES)
def test_outputs_match_the_stored_numbers(stored_outputs, model_type, implementation):
    """Loss, logits, greedy tokens, the method's own outputs and one SGD step of each seeded tiny model are the
    stored ones (benchmarks/make_expected_outputs.py wrote them), with either attention function."""
    actual = make_expected_outputs.expected_outputs(model_type, implementation)
    assert_matches_stored(actual, stored_outputs[model_type], model_type)


@pytest.mark.parametrize("model_type", make_expected_outputs.MODEL_TYPES)
def test_initialisation_is_deterministic_from_the_seed(model_type):
    """Two models built from the same seed hold the same parameters (what the stored numbers rely on)."""
    first = make_expected_outputs.build_model(model_type).state_dict()
    second = make_expected_outputs.build_model(model_type).state_dict()
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_expected_outputs_script_refuses_to_overwrite(tmp_path, capsys):
    """Regenerating the stored numbers is deliberate: an existing file is kept unless --overwrite is passed."""
    existing = tmp_path / "expected_outputs.json"
    existing.write_text("{}\n")
    assert make_expected_outputs.main(["--output", str(existing)]) == 2
    assert existing.read_text() == "{}\n"
    assert "--overwrite" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------------
# Round 2 mutation survivors (issue 65)
# --------------------------------------------------------------------------------------------------------------------

from flexformers.modeling.losses import token_loss_terms  # noqa: E402


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_label_smoothed_loss_ignores_the_given_ignore_index(epsilon):
    """With `ignore_index` the padding id (fairseq's `ignore_index=padding_idx`), the padding targets drop out of
    the loss, the logged NLL, the token count and the gradient exactly as -100 targets do by default, and
    `token_loss_terms` (per-token NLL and smoothing term, checked against log-softmax here) zeroes them."""
    generator = torch.Generator().manual_seed(4)
    logits = (2 * torch.randn(3, 6, 9, generator=generator)).requires_grad_()
    labels = torch.randint(2, 9, (3, 6), generator=generator)
    labels[0, 4:] = PAD
    labels[2, 1:] = PAD
    loss, nll = label_smoothed_nll_loss(logits, labels, epsilon, ignore_index=PAD)
    (gradient,) = torch.autograd.grad(loss, logits)
    reference_logits = logits.detach().double().requires_grad_()
    expected_loss, expected_nll = reference_label_smoothed_loss(reference_logits, labels, epsilon, ignore_index=PAD)
    (expected_gradient,) = torch.autograd.grad(expected_loss, reference_logits)
    torch.testing.assert_close(loss.double(), expected_loss.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(nll.double(), expected_nll.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gradient.double(), expected_gradient, atol=1e-6, rtol=1e-5)
    assert float(gradient[2, 1:].abs().sum()) == 0.0
    as_default = labels.masked_fill(labels.eq(PAD), -100)
    default_loss, default_nll = label_smoothed_nll_loss(logits, as_default, epsilon)
    torch.testing.assert_close(loss, default_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(nll, default_nll, atol=1e-6, rtol=1e-6)
    token_nll, token_smooth = token_loss_terms(logits, labels, ignore_index=PAD)
    log_probs = logits.detach().double().log_softmax(-1)
    kept = labels.ne(PAD)
    torch.testing.assert_close(
        token_nll.double(), -log_probs.gather(-1, labels[..., None]).squeeze(-1) * kept, atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(token_smooth.double(), -log_probs.sum(-1) * kept, atol=1e-4, rtol=1e-5)
