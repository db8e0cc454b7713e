"""The baseline model's generation: cached vs uncached, beams, the preallocated and static caches, and the
prepacked inference products decoding runs on."""

import pytest
import torch
from transformers import (
    CompileConfig,
    GenerationConfig,
)
from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
    EncoderDecoderCache,
    StaticCache,
)

import flexformers  # noqa: F401  (registers the model types)
from flexformers.configuration import FlexformerConfig
from flexformers.modeling.cpu_kernels import project_vocabulary
from flexformers.modeling.kv_caches import (
    PreallocatedKVLayer,
    new_decoder_cache,
    static_cache_capacity,
)
from flexformers.modeling.modeling_flexformer import FlexformerDecoder
from flexformers.modeling.positional_embeddings import (
    _positions_for,
    make_positions,
)
from flexformers.modeling.transformers_compat import cache_field, output_cache
from tests.conftest import tiny_config_kwargs
from tests.test_backbone import PAD, batch, incremental_logits, tiny_model

# ---- generation ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        dict(do_sample=False),
        dict(num_beams=4, length_penalty=1.2),
        dict(num_beams=4, num_return_sequences=3, early_stopping=True),
        dict(num_beams=3, no_repeat_ngram_size=2, min_new_tokens=3),
    ],
)
def test_generation_with_cache_equals_without(options):
    model = tiny_model()
    source, _ = batch()
    with_cache = model.generate(source, max_new_tokens=8, **options)
    without = model.generate(source, max_new_tokens=8, use_cache=False, **options)
    assert torch.equal(with_cache, without)


def test_greedy_generation_is_argmax_of_full_forward():
    model = tiny_model()
    source, _ = batch()
    generated = model.generate(source, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    with torch.no_grad():
        logits = model(input_ids=source, decoder_input_ids=generated[:, :-1]).logits
    assert torch.equal(logits.argmax(-1), generated[:, 1:])


def test_generation_options_are_honoured():
    model = tiny_model()
    source, _ = batch()
    forced = model.generate(source, max_new_tokens=5, forced_bos_token_id=9, do_sample=False)
    assert torch.all(forced[:, 1] == 9)
    torch.manual_seed(0)
    sampled = model.generate(source, max_new_tokens=5, do_sample=True, top_k=5, num_return_sequences=2)
    assert sampled.shape[0] == 6
    config = GenerationConfig(max_new_tokens=4, num_beams=2, decoder_start_token_id=2, pad_token_id=1, eos_token_id=2)
    out = model.generate(source, generation_config=config, return_dict_in_generate=True, output_scores=True)
    assert out.sequences.shape[1] <= 5 and out.sequences_scores.shape == (3,)


def test_batched_beam_search_equals_each_sentence_alone():
    model = tiny_model()
    # A random tiny model is nearly uniform, so beams tie up to float noise; sharpen it so the search has one answer.
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    source, _ = batch()
    together = model.generate(source, max_new_tokens=6, num_beams=3, min_new_tokens=6)
    for row in range(source.shape[0]):
        length = int(source[row].ne(PAD).sum())
        alone = model.generate(source[row : row + 1, :length], max_new_tokens=6, num_beams=3, min_new_tokens=6)
        assert torch.equal(together[row, : alone.shape[1]], alone[0])


def test_preallocated_layer_behaves_like_dynamic_layer():
    """Growing past its capacity, beam reordering, cropping, batch selection and repetition all leave exactly what a
    `DynamicLayer` holds after the same calls."""
    torch.manual_seed(0)
    preallocated, dynamic = PreallocatedKVLayer(), DynamicLayer()
    PreallocatedKVLayer.min_capacity, saved = 4, PreallocatedKVLayer.min_capacity
    try:
        for step in range(11):  # 3 prefill positions, then one per step: grows 4 → 8 → 16
            new = 3 if step == 0 else 1
            keys, values = torch.randn(6, 2, new, 5), torch.randn(6, 2, new, 5)
            got = preallocated.update(keys, values)
            want = dynamic.update(keys, values)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            if step % 3 == 2:
                order = torch.randint(0, 6, (6,))
                preallocated.reorder_cache(order)
                dynamic.reorder_cache(order)
        assert preallocated.get_seq_length() == dynamic.get_seq_length() == 13
        assert preallocated._key_buffer.shape[2] == 16  # doubled, not reallocated every step
        for layer in (preallocated, dynamic):
            layer.crop(-2)
            layer.batch_select_indices(torch.tensor([0, 2, 5]))
            layer.batch_repeat_interleave(2)
        assert torch.equal(preallocated.keys, dynamic.keys) and torch.equal(preallocated.values, dynamic.values)
        keys, values = torch.randn(6, 2, 1, 5), torch.randn(6, 2, 1, 5)
        assert torch.equal(preallocated.update(keys, values)[1], dynamic.update(keys, values)[1])
        preallocated.reset()
        assert preallocated.get_seq_length() == 0 and not preallocated.is_initialized
    finally:
        PreallocatedKVLayer.min_capacity = saved


def test_layers_of_one_cache_share_one_spare_pair():
    """Beam reordering in a cache of L layers (built as `generate()` builds it) gives what `DynamicLayer`s give,
    with L + 1 key/value buffer pairs in all — each layer reorders into the pair the previous one left."""
    torch.manual_seed(0)
    config = FlexformerConfig(**tiny_config_kwargs())
    ours = new_decoder_cache(config).self_attention_cache
    plain = DynamicCache(config=config)
    layers = len(ours.layers)
    seen = set()
    for step in range(6):
        for layer_idx in range(layers):
            keys, values = torch.randn(4, 2, 1, 8), torch.randn(4, 2, 1, 8)
            got, want = ours.update(keys, values, layer_idx), plain.update(keys, values, layer_idx)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        order = torch.randint(0, 4, (4,))
        ours.reorder_cache(order)
        plain.reorder_cache(order)
        seen.update(layer._key_buffer.data_ptr() for layer in ours.layers)
    for mine, theirs in zip(ours.layers, plain.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    assert layers > 1 and len(seen) == layers + 1


@pytest.mark.parametrize("options", [dict(do_sample=False), dict(num_beams=4, num_return_sequences=2)])
def test_generation_with_preallocated_cache_equals_dynamic_cache(options):
    """`generate()` uses `PreallocatedKVLayer`s; a user-supplied plain `DynamicCache` gives the same tokens/scores."""
    model = tiny_model()
    source, _ = batch()
    kwargs = dict(max_new_tokens=40, min_new_tokens=40, return_dict_in_generate=True, output_scores=True, **options)
    ours = model.generate(source, **kwargs)
    plain_cache = EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))
    plain = model.generate(source, **cache_field(plain_cache), **kwargs)
    assert torch.equal(ours.sequences, plain.sequences)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours.scores, plain.scores))
    assert type(output_cache(ours).self_attention_cache.layers[0]) is PreallocatedKVLayer
    assert type(output_cache(plain).self_attention_cache.layers[0]) is DynamicLayer


# ---- static cache (generate(cache_implementation="static"), the compiled decoding step) ---------------------------


def test_positions_after_a_tensor_past_length_equal_those_after_an_int():
    ids = torch.tensor([[7, 8, 9], [7, PAD, 9]])
    for past in (0, 3):
        assert torch.equal(_positions_for(ids, PAD, torch.tensor(past)), _positions_for(ids, PAD, past))
    assert torch.equal(_positions_for(ids, PAD, torch.tensor(0)), make_positions(ids, PAD))


@pytest.mark.parametrize("padded", [False, True])
def test_static_cache_mask_is_the_dynamic_mask_with_unwritten_slots_hidden(padded):
    """With a static cache the keys are the whole buffer: the mask covers all of it, hides the slots after the
    query's position, and otherwise equals the dynamic cache's mask over the filled part."""
    batch_size, past, capacity = 2, 3, 8
    decoder_mask = torch.ones(batch_size, past + 1, dtype=torch.long)
    if padded:
        decoder_mask[1, 0] = 0
    dynamic = FlexformerDecoder.self_attention_mask(batch_size, 1, past, decoder_mask, torch.float32, "cpu")
    static = FlexformerDecoder.self_attention_mask(
        batch_size, 1, torch.tensor(past), decoder_mask, torch.float32, "cpu", key_length=capacity
    )
    assert static.shape == (batch_size, 1, 1, capacity)
    filled = static[..., : past + 1]
    if dynamic is None:
        assert bool((filled == 0).all())
    else:
        assert torch.equal(filled, dynamic)
    assert bool((static[..., past + 1 :] == torch.finfo(torch.float32).min).all())


@pytest.mark.parametrize(
    "options",
    [
        dict(do_sample=False),
        dict(num_beams=4, length_penalty=1.2),
        dict(num_beams=3, num_return_sequences=2),
        dict(do_sample=True, top_k=5),
    ],
)
@pytest.mark.parametrize("learned_pos", [False, True])
def test_static_cache_generation_equals_default_cache(options, learned_pos):
    model = tiny_model(decoder_learned_pos=learned_pos, encoder_learned_pos=learned_pos)
    source, _ = batch()
    kwargs = dict(max_new_tokens=12, return_dict_in_generate=True, output_scores=True, **options)
    torch.manual_seed(3)
    default = model.generate(source, **kwargs)
    torch.manual_seed(3)
    static = model.generate(source, cache_implementation="static", **kwargs)
    assert static_cache_capacity(output_cache(static)) is not None
    assert torch.equal(static.sequences, default.sequences)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(static.scores, default.scores))


def test_static_cache_incremental_decoding_equals_full_forward():
    """A StaticCache passed to `forward` step by step (the past length a device tensor) gives the full logits."""
    model = tiny_model()
    source, target = batch()
    cache = EncoderDecoderCache(
        StaticCache(config=model.config, max_cache_len=16),
        StaticCache(config=model.config, max_cache_len=source.shape[1]),
    )
    with torch.no_grad():
        full = model(input_ids=source, decoder_input_ids=target).logits
        incremental = incremental_logits(model, source, target, cache=cache)
    torch.testing.assert_close(incremental, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("options", [dict(do_sample=False), dict(do_sample=True, top_k=5)])
def test_static_cache_decoding_step_compiles_into_one_graph(options):
    """What `generate()` compiles on a GPU — the decoding step with a static cache — traces as one graph
    (`fullgraph=True` turns any graph break into an error) and gives the default cache's tokens. The "eager"
    backend checks the capture without compiling code, so this runs on a CPU in seconds."""
    torch._dynamo.reset()
    model = tiny_model()
    source, _ = batch()
    compile_config = CompileConfig(fullgraph=True, backend="eager", mode=None)
    compile_config._compile_all_devices = True  # generate() compiles only on accelerators unless told
    torch.manual_seed(5)
    default = model.generate(source, max_new_tokens=8, **options)
    torch.manual_seed(5)
    compiled = model.generate(
        source, max_new_tokens=8, cache_implementation="static", compile_config=compile_config, **options
    )
    assert hasattr(model, "_compiled_call")
    assert torch.equal(compiled, default)


@pytest.mark.parametrize("prepack", [True, False], ids=["packed", "transposed-product"])
def test_vocabulary_projection_equals_linear_with_and_without_gradients(prepack, monkeypatch):
    import flexformers.modeling.cpu_kernels as kernels

    monkeypatch.setattr(kernels, "PREPACK_INFERENCE_WEIGHTS", prepack and kernels.PREPACK_INFERENCE_WEIGHTS)
    torch.manual_seed(0)
    projection = torch.nn.Linear(16, 50, bias=True)
    for rows in (1, 7, 200):  # below and above the transposed-product threshold
        hidden = torch.randn(rows, 1, 16)
        reference = torch.nn.functional.linear(hidden, projection.weight, projection.bias)
        with torch.no_grad():
            fast = project_vocabulary(projection, hidden)
        assert fast.shape == reference.shape and fast.is_contiguous()
        assert torch.allclose(fast, reference, atol=1e-5)
    hidden = torch.randn(4, 3, 16, requires_grad=True)
    project_vocabulary(projection, hidden).sum().backward()
    assert hidden.grad is not None and projection.weight.grad is not None


# --------------------------------------------------------------------------------------------- prepacked weights


@pytest.fixture
def always_prepack(monkeypatch):
    """Take the prepacked oneDNN path for every inference linear (tiny weights never pay on their own)."""
    import flexformers.modeling.cpu_kernels as backbone

    if not backbone._prepacking_possible():
        pytest.skip("this torch build has no oneDNN linear")
    monkeypatch.setattr(backbone, "PREPACK_INFERENCE_WEIGHTS", True)
    monkeypatch.setattr(backbone, "_prepacking_pays", lambda rows, weight: True)
    return backbone


def test_prepacked_inference_equals_plain_linear(always_prepack):
    """Forward logits and greedy/beam generation are those of F.linear; the packed copies live outside the
    model (state dict unchanged, deepcopy works) and gradients never take the packed path."""
    import copy

    model = tiny_model()
    source, target = batch()
    with torch.no_grad():
        packed_logits = model(input_ids=source, decoder_input_ids=target).logits
        packed_greedy = model.generate(source, max_new_tokens=6, min_new_tokens=6)
        packed_beam = model.generate(source, max_new_tokens=6, num_beams=3)
    assert len(always_prepack._PACKED_WEIGHTS) > 0
    always_prepack.PREPACK_INFERENCE_WEIGHTS = False
    with torch.no_grad():
        plain_logits = model(input_ids=source, decoder_input_ids=target).logits
        assert torch.equal(model.generate(source, max_new_tokens=6, min_new_tokens=6), packed_greedy)
        assert torch.equal(model.generate(source, max_new_tokens=6, num_beams=3), packed_beam)
    torch.testing.assert_close(packed_logits, plain_logits, atol=1e-5, rtol=1e-5)
    assert not any("pack" in key for key in model.state_dict())
    copy.deepcopy(model)
    always_prepack.PREPACK_INFERENCE_WEIGHTS = True
    model.train()
    loss = model(input_ids=source, labels=target).loss
    loss.backward()
    assert model.model.decoder.layers[0].self_attn.q_proj.weight.grad is not None


@pytest.mark.parametrize("optimizer", [
    lambda parameters: torch.optim.SGD(parameters, lr=0.5),
    # the Trainer's default (adamw_torch_fused): writes the weights without bumping their version counters
    lambda parameters: torch.optim.AdamW(parameters, lr=0.05, fused=True),
    lambda parameters: torch.optim.AdamW(parameters, lr=0.05, foreach=True),
], ids=["sgd", "adamw-fused", "adamw-foreach"])
def test_prepacked_weights_follow_in_place_updates(always_prepack, optimizer):
    """An optimizer step changes the weights in place: the next inference call repacks them — also after a fused
    optimizer's step, which leaves the version counters alone (so evaluations during training see the new weights)."""
    model = tiny_model()
    source, target = batch()
    with torch.no_grad():
        model(input_ids=source, decoder_input_ids=target)  # packs
    model.train()
    model(input_ids=source, labels=target).loss.backward()
    optimizer(model.parameters()).step()
    model.eval()
    with torch.no_grad():
        packed = model(input_ids=source, decoder_input_ids=target).logits
        always_prepack.PREPACK_INFERENCE_WEIGHTS = False
        plain = model(input_ids=source, decoder_input_ids=target).logits
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)


def test_weights_version_changes_with_every_kind_of_in_place_update():
    """The key of the copies made from weights (packed products, Depth-Adaptive's fused K/V): a fused optimizer step
    leaves the version counter as it was, so the key also counts optimizer steps."""
    from flexformers.modeling.cpu_kernels import weights_version

    weight = torch.nn.Parameter(torch.randn(4, 4))
    weight.grad = torch.randn(4, 4)
    before = weights_version(weight)
    version = weight._version
    torch.optim.AdamW([weight], lr=0.1, fused=True).step()
    assert weight._version == version  # what makes the version counter alone insufficient
    assert weights_version(weight) != before
    after_step = weights_version(weight)
    with torch.no_grad():
        weight.mul_(2)
    assert weights_version(weight) != after_step


def test_self_attention_projections_run_as_one_packed_product(always_prepack):
    """q, k, v of a decoding step come from one packed product over the three weights side by side: equal to the
    three separate products, repacked after an in-place update of any one weight or bias, and not used for a
    projection with a hook or its own `forward` (an adapter's or offloader's forward must run)."""
    attention = tiny_model().model.decoder.layers[0].self_attn
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    hidden = torch.randn(4, 1, attention.embed_dim)

    def separate():
        return [torch.nn.functional.linear(hidden, p.weight, p.bias) for p in projections]

    with torch.no_grad():
        fused = always_prepack.fused_linears(attention, hidden, projections)
        assert always_prepack._PACKED_WEIGHTS[attention][1] is not None  # the fused path ran
        for got, expected in zip(fused, separate()):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
        attention.k_proj.weight.add_(0.5)
        attention.v_proj.bias.add_(1.0)
        for got, expected in zip(always_prepack.fused_linears(attention, hidden, projections), separate()):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
        calls = []
        handle = attention.v_proj.register_forward_hook(lambda module, args, output: calls.append(1))
        always_prepack.fused_linears(attention, hidden, projections)
        handle.remove()
        plain_forward = attention.k_proj.forward
        attention.k_proj.forward = lambda x: calls.append(2) or plain_forward(x)  # as accelerate's hooks do
        always_prepack.fused_linears(attention, hidden, projections)
    assert calls == [1, 2]


def test_a_weight_onednn_cannot_pack_falls_back_to_plain_products(always_prepack, monkeypatch):
    def refuse(weight, rows):
        raise RuntimeError("unsupported layout")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    model = tiny_model()
    source, target = batch()
    with torch.no_grad():
        fallback = model(input_ids=source, decoder_input_ids=target).logits
        always_prepack.PREPACK_INFERENCE_WEIGHTS = False
        plain = model(input_ids=source, decoder_input_ids=target).logits
    assert torch.equal(fallback, plain)
