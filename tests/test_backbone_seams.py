"""The baseline model's seams, which the methods extend: branch merge (MAT), relative-position bias (InDIGO), the
sub-layer order as data and per-row plans (IOT), the KV collectors and grouped caches behind them."""

import pytest
import torch
from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
    EncoderDecoderCache,
)

import flexformers  # noqa: F401  (registers the model types)
from flexformers.modeling.branch_merge import merge_branches, merge_projection
from flexformers.modeling.kv_caches import (
    PreallocatedKVLayer,
    StepKVCollector,
    new_decoder_cache,
)
from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration
from flexformers.modeling.sublayer_order import PerRowSublayerOrder
from flexformers.modeling.transformers_compat import output_cache
from tests.test_backbone import ORDERS, PAD, _cache_after_steps_and_a_copy, batch, incremental_logits, tiny_model

# ---- seams -----------------------------------------------------------------------------------------------------------


def test_branch_merge_with_one_branch_is_nn_linear():
    torch.manual_seed(0)
    merge, branch_biases = merge_projection(1, 8, 5)
    assert type(merge) is torch.nn.Linear and branch_biases is None
    torch.nn.init.normal_(merge.weight)
    torch.nn.init.normal_(merge.bias)
    x = torch.randn(2, 3, 1, 8)
    assert torch.equal(merge_branches(merge, None, x), torch.nn.functional.linear(x[:, :, 0], merge.weight, merge.bias))
    weights = torch.tensor([[0.5], [2.0]])  # one weight per row: w (x W + b)
    torch.testing.assert_close(merge_branches(merge, None, x, weights), weights[:, :, None] * merge(x[:, :, 0]))


def test_branch_merge_is_the_weighted_sum_of_branch_linears():
    torch.manual_seed(0)
    projection, bias = merge_projection(3, 4, 5)
    assert type(projection) is torch.nn.Linear and projection.bias is None and bias.shape == (3, 5)
    torch.nn.init.normal_(projection.weight)
    torch.nn.init.normal_(bias)

    def merge(x, weights=None):
        return merge_branches(projection, bias, x, weights)

    def branch_weight(b):
        return projection.weight[:, b * 4 : (b + 1) * 4]

    x = torch.randn(2, 6, 3, 4)
    weights = torch.tensor([0.5, 0.0, 2.0])
    expected = sum(weights[b] * (x[:, :, b] @ branch_weight(b).T + bias[b]) for b in range(3))
    torch.testing.assert_close(merge(x, weights), expected, atol=1e-5, rtol=1e-5)
    per_row = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    out = merge(x, per_row)
    torch.testing.assert_close(out[0], x[0, :, 0] @ branch_weight(0).T + bias[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], x[1, :, 2] @ branch_weight(2).T + bias[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merge(x), merge(x, torch.full((3,), 1 / 3)), atol=1e-6, rtol=1e-6)


def test_branched_attention_equals_average_of_independent_attentions():
    """The MAT seam: B branches in one fused call = the average of B separate single-branch attentions."""
    branched = tiny_model(seed=3, decoder_attention_branches=2, encoder_attention_branches=2)
    source, target = batch()
    singles = []
    for branch in range(2):
        single = tiny_model(seed=4)
        state = single.state_dict()
        for name, value in branched.state_dict().items():
            if any(p in name for p in ("q_proj", "k_proj", "v_proj")):
                d = value.shape[0] // 2
                state[name] = value[branch * d : (branch + 1) * d].clone()
            elif "out_proj.weight" in name:
                d = value.shape[1] // 2
                state[name] = value[:, branch * d : (branch + 1) * d].clone()
            elif "out_proj_branch_bias" in name:
                state[name.replace("out_proj_branch_bias", "out_proj.bias")] = value[branch].clone()
            else:
                state[name] = value.clone()
        single.load_state_dict(state)
        singles.append(single)
    attention = branched.model.encoder.layers[0].self_attn
    x = torch.randn(3, 7, 32)
    expected = sum(s.model.encoder.layers[0].self_attn(x)[0] for s in singles) / 2
    torch.testing.assert_close(attention(x)[0], expected, atol=1e-5, rtol=1e-5)


def test_relative_position_bias_seam_changes_the_logits():
    model = tiny_model()
    source, target = batch()
    attention = model.model.decoder.layers[0].self_attn
    with torch.no_grad():
        plain = model(input_ids=source, decoder_input_ids=target).logits
        attention.relative_position_bias = lambda query, rows=None, **kw: torch.zeros(
            query.shape[0], query.shape[1], query.shape[2], query.shape[2]
        )
        zero_bias = model(input_ids=source, decoder_input_ids=target).logits
        attention.relative_position_bias = lambda query, rows=None, **kw: torch.randn(
            query.shape[0], query.shape[1], query.shape[2], query.shape[2]
        )
        random_bias = model(input_ids=source, decoder_input_ids=target).logits
    torch.testing.assert_close(zero_bias, plain, atol=1e-5, rtol=0)
    assert not torch.allclose(random_bias, plain, atol=1e-3)


def test_decoder_without_absolute_positions_is_order_blind_for_a_bag():
    """InDIGO's seam: with no positions and no relative bias, self-attention cannot see where tokens are."""
    model = tiny_model(decoder_use_positions=False, encoder_use_positions=False)
    assert model.model.decoder.embed_positions is None
    source = torch.tensor([[7, 8, 9, 10]])
    with torch.no_grad():
        a = model.model.encoder(input_ids=source).last_hidden_state
        b = model.model.encoder(input_ids=source.flip(1)).last_hidden_state
    torch.testing.assert_close(a.flip(1), b, atol=1e-5, rtol=0)


def test_sublayer_order_is_data_and_changes_the_function():
    model = tiny_model()
    source, target = batch()
    with torch.no_grad():
        default = model(input_ids=source, decoder_input_ids=target).logits
        explicit = model(input_ids=source, decoder_input_ids=target, decoder_sublayer_order=ORDERS[0]).logits
        other = model(input_ids=source, decoder_input_ids=target, decoder_sublayer_order=ORDERS[1]).logits
    assert torch.equal(default, explicit)
    assert not torch.allclose(default, other, atol=1e-3)
    with pytest.raises(ValueError, match="permutation"):
        model(input_ids=source, decoder_input_ids=target, decoder_sublayer_order=("ffn", "ffn", "self_attn"))


def test_per_row_plan_is_a_shortest_common_supersequence_of_the_orders():
    """Each row runs its sub-layers in its own order, each once; the steps are a shortest common supersequence
    (IOT's default 4 decoder orders: 5 calls per block instead of 8 stage by stage; all 6 orders: 7)."""
    import itertools

    from flexformers.configuration.configuration_iot import DECODER_ORDER_CODES
    from flexformers.modeling.sublayer_order import shortest_common_schedule

    def contains(schedule, order):
        remaining = iter(schedule)
        return all(name in remaining for name in order)

    default = [DECODER_ORDER_CODES[code] for code in (1, 2, 4, 6)]
    every = list(DECODER_ORDER_CODES.values())
    for orders, length in ((default, 5), (every, 7), (default[:1], 3), (default[:2], 4)):
        schedule = shortest_common_schedule(orders)
        assert len(schedule) == length and all(contains(schedule, order) for order in orders)
        names = sorted(set(orders[0]))
        shorter = itertools.product(names, repeat=length - 1)
        assert not any(all(contains(candidate, order) for order in orders) for candidate in shorter)
    per_row = PerRowSublayerOrder(torch.tensor([0, 0, 1, 2, 3, 3, 1]), default)
    applied = {row: [] for row in range(7)}
    for step in per_row.stage_plan:
        for name, rows in step:
            chosen = range(7) if rows is None else (range(7)[rows] if isinstance(rows, slice) else rows.tolist())
            for row in chosen:
                applied[row].append(name)
    assert len(per_row.stage_plan) == 5
    assert all(tuple(applied[row]) == default[int(per_row.order_index[row])] for row in range(7))


@pytest.mark.parametrize("cache_kind", ["preallocated", "dynamic"])
def test_per_row_orders_equal_each_row_alone_full_and_incremental(cache_kind):
    """Row blocks write into the `PreallocatedKVLayer`'s own buffer (the default cache) or into a per-step copy of
    the past (a plain `DynamicCache`); both equal the full forward."""
    model = tiny_model()
    source, target = batch()
    per_row = PerRowSublayerOrder(torch.tensor([1, 0, 2]), ORDERS)
    encoder_per_row = PerRowSublayerOrder(torch.tensor([1, 1, 0]), [("self_attn", "ffn"), ("ffn", "self_attn")])
    with torch.no_grad():
        together = model(
            input_ids=source, decoder_input_ids=target, decoder_sublayer_order=per_row,
            encoder_sublayer_order=encoder_per_row,
        ).logits
        for row in range(3):
            alone = model(
                input_ids=source[row : row + 1],
                decoder_input_ids=target[row : row + 1],
                decoder_sublayer_order=ORDERS[int(per_row.order_index[row])],
                encoder_sublayer_order=encoder_per_row.orders[int(encoder_per_row.order_index[row])],
            ).logits
            torch.testing.assert_close(together[row : row + 1], alone, atol=1e-5, rtol=0)
        if cache_kind == "dynamic":
            cache = EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))
        else:
            cache = new_decoder_cache(model.config)
        incremental = incremental_logits(model, source, target, cache=cache, decoder_sublayer_order=per_row)
        full = model(input_ids=source, decoder_input_ids=target, decoder_sublayer_order=per_row).logits
    expected_layer = DynamicLayer if cache_kind == "dynamic" else PreallocatedKVLayer
    assert all(type(layer) is expected_layer for layer in cache.self_attention_cache.layers)
    assert cache.get_seq_length() == target.shape[1]
    torch.testing.assert_close(incremental, full, atol=1e-5, rtol=0)


def test_step_kv_collector_refuses_a_partial_write():
    model = tiny_model()
    source, target = batch()
    out = model(input_ids=source, decoder_input_ids=target[:, :1], use_cache=True)
    collector = StepKVCollector(output_cache(out).self_attention_cache, 0, 3)
    keys = torch.zeros(1, 4, 1, 8)
    collector.add(torch.tensor([0]), keys, keys)
    with pytest.raises(RuntimeError, match="every row"):
        collector.flush()


def test_collector_takes_all_rows_at_once_and_is_ready_for_the_next_step_after_a_flush():
    """`add` without rows (every row in one call) hands those keys and values to the cache as they are; a flushed
    collector starts its next step from nothing, so it can collect step after step."""
    model = tiny_model()
    with torch.no_grad():
        cache, reference_cache = _cache_after_steps_and_a_copy(model, 1)
        attention = model.model.decoder.layers[0].self_attn
        collector = StepKVCollector(cache.self_attention_cache, 0, 3)
        for step in range(2):
            keys, values = attention.project_key_value(torch.randn(3, 1, 32))
            if step == 0:
                collector.add(None, keys, values)
            else:  # in two subsets of rows, after the full-batch step
                collector.add(torch.tensor([2, 0]), keys[[2, 0]], values[[2, 0]])
                collector.add(torch.tensor([1]), keys[1:2], values[1:2])
            collector.flush()
            reference_cache.self_attention_cache.update(keys, values, 0)
    written, expected = cache.self_attention_cache.layers[0], reference_cache.self_attention_cache.layers[0]
    assert written.keys.shape[2] == 3
    torch.testing.assert_close(written.keys, expected.keys, rtol=0, atol=0)
    torch.testing.assert_close(written.values, expected.values, rtol=0, atol=0)


def test_row_subset_attention_with_collector_equals_full_batch_step():
    """The Depth-Adaptive / IOT primitive: attending for two row subsets with deferred cache writes gives the
    same outputs and the same cache as one full-batch step."""
    model = tiny_model()
    with torch.no_grad():
        cache, reference_cache = _cache_after_steps_and_a_copy(model, 1)
        attention = model.model.decoder.layers[0].self_attn
        x = torch.randn(3, 1, 32)
        expected, _ = attention(x, past_key_values=reference_cache)
        collector = StepKVCollector(cache.self_attention_cache, 0, 3)
        rows_a, rows_b = torch.tensor([2, 0]), torch.tensor([1])
        out_a, _ = attention(x[rows_a], past_key_values=cache, rows=rows_a, kv_collector=collector)
        out_b, _ = attention(x[rows_b], past_key_values=cache, rows=rows_b, kv_collector=collector)
        collector.flush()
    torch.testing.assert_close(out_a, expected[rows_a], atol=1e-6, rtol=0)
    torch.testing.assert_close(out_b, expected[rows_b], atol=1e-6, rtol=0)
    torch.testing.assert_close(
        cache.self_attention_cache.layers[0].keys, reference_cache.self_attention_cache.layers[0].keys
    )


def test_collector_writes_an_all_rows_stage_in_place_into_the_preallocated_cache():
    """A stage that every row runs (`rows=None`, e.g. IOT's shared self-attention slot) attends over a view of the
    cache's own buffer — no concatenated copy of the past — and leaves the same cache and outputs as a plain step."""
    model = tiny_model()
    with torch.no_grad():
        cache, reference_cache = _cache_after_steps_and_a_copy(model, 2)
        layer = cache.self_attention_cache.layers[0]
        assert isinstance(layer, PreallocatedKVLayer)
        attention = model.model.decoder.layers[0].self_attn
        x = torch.randn(3, 1, 32)
        expected, _ = attention(x, past_key_values=reference_cache)
        collector = StepKVCollector(cache.self_attention_cache, 0, 3)
        keys, values = attention.project_key_value(x)
        full_keys, _, past_length = collector.extend(None, keys, values)
        assert past_length == 2 and full_keys.data_ptr() == layer._key_buffer.data_ptr()
        collector = StepKVCollector(cache.self_attention_cache, 0, 3)
        out, _ = attention(x, past_key_values=cache, kv_collector=collector)
        collector.flush()
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(layer.keys, reference_cache.self_attention_cache.layers[0].keys)
    assert layer.get_seq_length() == 3


@pytest.mark.parametrize("cache_kind", ["preallocated", "dynamic"])
def test_collector_mixes_a_block_of_rows_and_a_row_tensor_in_one_step(cache_kind):
    """A step whose rows come partly as a contiguous block (`slice`) and partly as a row tensor: the rows after the
    block attend over the block's buffer (past + new), and the flushed cache equals one full-batch step."""
    model = tiny_model()
    with torch.no_grad():
        preallocated, dynamic = _cache_after_steps_and_a_copy(model, 2)
        cache = preallocated if cache_kind == "preallocated" else dynamic
        reference = DynamicCache()
        past = cache.self_attention_cache.layers[0]
        reference.update(past.keys.clone(), past.values.clone(), 0)
        attention = model.model.decoder.layers[0].self_attn
        keys, values = attention.project_key_value(torch.randn(3, 1, 32))
        reference.update(keys, values, 0)
        expected = reference.layers[0]
        collector = StepKVCollector(cache.self_attention_cache, 0, 3)
        block_keys, _, block_past = collector.extend(slice(0, 2), keys[:2], values[:2])
        row_keys, row_values, row_past = collector.extend(torch.tensor([2]), keys[2:], values[2:])
        assert block_past == row_past == 2
        torch.testing.assert_close(block_keys, expected.keys[:2], rtol=0, atol=0)
        torch.testing.assert_close(row_keys, expected.keys[2:], rtol=0, atol=0)
        torch.testing.assert_close(row_values, expected.values[2:], rtol=0, atol=0)
        collector.flush()
    written = cache.self_attention_cache.layers[0]
    assert written.get_seq_length() == 3
    torch.testing.assert_close(written.keys, expected.keys, rtol=0, atol=0)
    torch.testing.assert_close(written.values, expected.values, rtol=0, atol=0)


def test_whole_groups_recognises_all_beams_of_some_sentences():
    from flexformers.modeling.kv_caches import whole_groups

    assert torch.equal(whole_groups(torch.tensor([3, 4, 5, 9, 10, 11]), 3), torch.tensor([1, 3]))
    assert whole_groups(torch.tensor([3, 4, 5, 9, 10]), 3) is None  # a partial sentence
    assert whole_groups(torch.tensor([4, 5, 6]), 3) is None  # straddles two sentences
    assert whole_groups(torch.tensor([5, 4, 3]), 3) is None  # beams out of order
    assert whole_groups(torch.tensor([], dtype=torch.long), 3) is None
    rows = torch.tensor([0, 1, 2])
    assert torch.equal(whole_groups(rows, 3), torch.tensor([0]))
    assert torch.equal(whole_groups(rows, 3), torch.tensor([0]))  # asked again: the remembered answer
    assert whole_groups(rows, 2) is None and whole_groups(rows, 2) is None
    rows[0] = 2  # the remembered answer follows in-place changes of the same tensor
    assert whole_groups(rows, 3) is None


def test_decoder_pieces_compose_to_forward():
    """`embed` → `run_layer`… → `finalize` is the decoder's forward (the Depth-Adaptive seam)."""
    model = tiny_model(decoder_normalize_before=True)
    source, target = batch()
    with torch.no_grad():
        encoder_out = model.model.encoder(input_ids=source).last_hidden_state
        decoder = model.model.decoder
        hidden = decoder.embed(target)
        from flexformers.modeling.modeling_flexformer import padding_mask

        cross_mask = padding_mask(source.ne(PAD).long(), hidden.dtype)
        for idx in range(len(decoder.layers)):
            hidden, _, _ = decoder.run_layer(
                idx, hidden, encoder_hidden_states=encoder_out, encoder_attention_mask=cross_mask
            )
        manual = model.lm_head(decoder.finalize(hidden))
        reference = model(input_ids=source, decoder_input_ids=target).logits
    torch.testing.assert_close(manual, reference, atol=1e-6, rtol=0)


def test_layerdrop_only_while_training():
    model = tiny_model(decoder_layerdrop=0.5, encoder_layerdrop=0.5)
    source, target = batch()
    with torch.no_grad():
        a = model(input_ids=source, decoder_input_ids=target).logits
        b = model(input_ids=source, decoder_input_ids=target).logits
    assert torch.equal(a, b)
    model.train()
    torch.manual_seed(0)
    outputs = {model(input_ids=source, decoder_input_ids=target).logits.sum().item() for _ in range(8)}
    assert len(outputs) > 1


def test_source_grouped_cache_equals_per_row_cross_attention(tmp_path):
    """Beam search's copies of a source share one set of cross-attention keys/values (SourceGroupedCache);
    logits and attention weights equal the standard per-row cache, and reordering beams leaves them valid."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    from flexformers.modeling.kv_caches import SourceGroupedCache

    tiny_model().save_pretrained(tmp_path)
    model = FlexformerForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="eager").eval()
    source, target = batch()
    group = 2
    source = source.repeat_interleave(group, dim=0)
    target = target.repeat_interleave(group, dim=0)
    caches = {
        "standard": EncoderDecoderCache(DynamicCache(), DynamicCache()),
        "grouped": SourceGroupedCache(DynamicCache(), DynamicCache(), group_size=group),
    }
    outputs = {}
    with torch.no_grad():
        for name, cache in caches.items():
            step_logits, cross = [], []
            encoder = None
            for t in range(3):
                out = model(
                    input_ids=source if encoder is None else None,
                    encoder_outputs=encoder,
                    attention_mask=source.ne(PAD).long(),
                    decoder_input_ids=target[:, t : t + 1],
                    past_key_values=cache,
                    use_cache=True,
                    output_attentions=True,
                )
                encoder = (out.encoder_last_hidden_state,)
                step_logits.append(out.logits)
                cross.append(out.cross_attentions[0])
                cache.reorder_cache(torch.tensor([1, 0, 2, 3, 5, 4]))
            outputs[name] = (torch.cat(step_logits, 1), torch.cat(cross, 2))
    assert caches["grouped"].cross_attention_cache.layers[0].keys.shape[0] == source.shape[0] // group
    torch.testing.assert_close(outputs["grouped"][0], outputs["standard"][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(outputs["grouped"][1], outputs["standard"][1], atol=1e-6, rtol=0)


def test_grouped_beam_queries_take_the_same_values_with_products_or_sdpa():
    """On CPU the folded beam queries of a SourceGroupedCache use the two batched products instead of SDPA; both
    give the same beam search."""
    from flexformers.modeling.modeling_flexformer import FlexformerAttention

    model = tiny_model()
    source, _ = batch()
    options = dict(num_beams=3, max_new_tokens=5, min_new_tokens=5, return_dict_in_generate=True, output_scores=True)
    results = {}
    try:
        for products in (True, False):
            FlexformerAttention.grouped_queries_use_products = products
            with torch.no_grad():
                results[products] = model.generate(source, **options)
    finally:
        FlexformerAttention.grouped_queries_use_products = True
    assert torch.equal(results[True].sequences, results[False].sequences)
    for with_products, with_sdpa in zip(results[True].scores, results[False].scores):
        torch.testing.assert_close(with_products, with_sdpa, atol=1e-5, rtol=1e-5)


def test_generate_infers_the_source_padding_mask():
    """Without an explicit attention_mask, a padded sentence gets exactly the scores it gets alone."""
    model = tiny_model()
    source, _ = batch()
    options = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True)
    together = model.generate(source, **options)
    length = int(source[-1].ne(PAD).sum())
    alone = model.generate(source[-1:, :length], **options)
    assert torch.equal(together.sequences[-1:], alone.sequences)
    for step_together, step_alone in zip(together.scores, alone.scores):
        torch.testing.assert_close(step_together[-1:], step_alone, atol=1e-5, rtol=0)


def test_collector_takes_blocks_of_rows_given_as_slices():
    """`add` with contiguous row blocks (slices) collects each block's new keys and values in place; `flush` then
    leaves the cache a full-batch update would."""
    model = tiny_model()
    with torch.no_grad():
        cache, reference_cache = _cache_after_steps_and_a_copy(model, 1)
        attention = model.model.decoder.layers[0].self_attn
        keys, values = attention.project_key_value(torch.randn(3, 1, 32))
        collector = StepKVCollector(cache.self_attention_cache, 0, 3)
        collector.add(slice(0, 2), keys[:2], values[:2])
        collector.add(slice(2, 3), keys[2:], values[2:])
        collector.flush()
        reference_cache.self_attention_cache.update(keys, values, 0)
    written, expected = cache.self_attention_cache.layers[0], reference_cache.self_attention_cache.layers[0]
    torch.testing.assert_close(written.keys, expected.keys, rtol=0, atol=0)
    torch.testing.assert_close(written.values, expected.values, rtol=0, atol=0)


@pytest.mark.parametrize("group", [2, 3])
@pytest.mark.parametrize("operation", ["batch_select_indices", "batch_repeat_interleave"])
def test_source_grouped_cache_ungroups_keys_and_values_before_a_batch_operation(operation, group):
    """Selecting or repeating rows of a grouped cache (contrastive search, assisted decoding) first expands its
    per-source cross-attention keys and values to one copy per row, then applies the operation as the standard
    cache does."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    from flexformers.modeling.kv_caches import SourceGroupedCache

    sources = 2
    generator = torch.Generator().manual_seed(0)
    self_keys, self_values = (torch.randn(group * sources, 2, 4, 8, generator=generator) for _ in range(2))
    cross_keys, cross_values = (torch.randn(sources, 2, 5, 8, generator=generator) for _ in range(2))
    grouped = SourceGroupedCache(DynamicCache(), DynamicCache(), group_size=group)
    standard = EncoderDecoderCache(DynamicCache(), DynamicCache())
    for cache, repeat in ((grouped, 1), (standard, group)):
        cache.self_attention_cache.update(self_keys.clone(), self_values.clone(), 0)
        cache.cross_attention_cache.update(cross_keys.repeat_interleave(repeat, dim=0),
                                           cross_values.repeat_interleave(repeat, dim=0), 0)
    argument = torch.tensor([group * sources - 1, 0, group]) if operation == "batch_select_indices" else 2
    getattr(grouped, operation)(argument)
    getattr(standard, operation)(argument)
    assert grouped.group_size == 1
    for part in ("self_attention_cache", "cross_attention_cache"):
        ours, theirs = getattr(grouped, part).layers[0], getattr(standard, part).layers[0]
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=0, atol=0)
        torch.testing.assert_close(ours.values, theirs.values, rtol=0, atol=0)


def test_ffn_branch_counts_of_the_config_reach_every_block():
    """`encoder_ffn_branches` / `decoder_ffn_branches` (MAT's N_f, fields of the shared config) are handed to the
    feed-forward seam of every encoder and decoder block."""
    model = tiny_model(encoder_ffn_branches=2, decoder_ffn_branches=3)
    assert [layer.ffn.num_branches for layer in model.model.encoder.layers] == [2] * len(model.model.encoder.layers)
    assert [layer.ffn.num_branches for layer in model.model.decoder.layers] == [3] * len(model.model.decoder.layers)
    ffn_dim = model.config.encoder_ffn_embed_dim
    assert model.model.encoder.layers[0].ffn.fc1.out_features == 2 * ffn_dim


def test_a_failing_mkldnn_query_means_no_weight_prepacking(monkeypatch):
    """A torch build whose oneDNN query raises is treated as one without it: plain products, no prepacked weights."""
    from flexformers.modeling import cpu_kernels

    def broken():
        raise RuntimeError("oneDNN not initialised")

    monkeypatch.setattr(torch.backends.mkldnn, "is_available", broken)
    assert cpu_kernels._prepacking_possible() is False
