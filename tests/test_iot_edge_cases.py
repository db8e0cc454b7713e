"""IOT: the row layouts, stage plans, noise, losses and caches at the boundaries the mutation runs (issue 65) found
untested."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers.modeling_outputs import BaseModelOutput

from flexformers.configuration.configuration_iot import DECODER_ORDER_CODES
from flexformers.modeling.iot_equations import contiguous_order_arrangement, sample_gumbel
from flexformers.modeling.modeling_iot import (
    diversity_loss,
    gumbel_softmax_confidences,
    gumbel_temperature_at,
    sentence_label_smoothed_losses,
    sharpness_loss,
    weighted_path_loss,
)
from flexformers.modeling.sublayer_order import PerRowSublayerOrder, contiguous_blocks, shortest_common_schedule
from flexformers.modeling.transformers_compat import output_cache
from tests.test_iot import TINY, batch, diverse_predictors, tiny_iot

TINY_LAYERS = TINY["encoder_layers"]

# ---------------------------------------------------------------------------------------------------------------
# Issue 65: tests that catch wrong maths (surviving mutants of modeling_iot / iot_equations / sublayer_order)
# ---------------------------------------------------------------------------------------------------------------


def _sublayers_run_per_row(plan, batch_size):
    """Replay a stage plan: the sub-layers each row runs, in order (rows=None: every row; a slice, an index
    tensor or a boolean mask: those rows)."""
    runs = [[] for _ in range(batch_size)]
    for step in plan:
        for name, rows in step:
            if rows is None:
                selected = range(batch_size)
            elif isinstance(rows, slice):
                selected = range(rows.start, rows.stop)
            elif rows.dtype == torch.bool:
                selected = torch.nonzero(rows).flatten().tolist()
            else:
                selected = rows.tolist()
            for row in selected:
                runs[row].append(name)
    return runs


@pytest.mark.parametrize("codes", [[1, 2, 4, 6], [1, 2]])
def test_masked_row_plan_runs_each_row_its_own_order_once(codes):
    """The plan without host reads (what `torch.export` gets): one step per sub-layer of a shortest common
    schedule of every candidate; each row, through its mask, runs exactly its own order's sub-layers, in order —
    also after an order has finished while others still run."""
    from flexformers.configuration.configuration_iot import DECODER_ORDER_CODES as CODES

    orders = [CODES[code] for code in codes]
    order_index = torch.tensor([len(codes) - 1, 0, 1, 0, len(codes) - 1, 1])
    plan = PerRowSublayerOrder(order_index, orders)._masked_plan()
    assert len(plan) == len(shortest_common_schedule(orders))
    assert _sublayers_run_per_row(plan, 6) == [list(orders[i]) for i in order_index.tolist()]
    assert all(rows is None or rows.dtype == torch.bool for step in plan for _, rows in step)


def test_iot_masked_row_plan_gives_the_eager_plans_outputs(monkeypatch):
    """Mixed encoder and decoder orders run with the masked plan (as while `torch.export` traces: every step on
    every row, kept where it is the row's next sub-layer) give the eager per-row plan's logits and attentions."""
    model = tiny_iot(encoder_orders=[1, 2], decoder_orders=[1, 2, 4, 6])
    diverse_predictors(model)
    model.eval()
    input_ids, mask, labels = batch()
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels)
    codes = model.predict_orders(input_ids, mask)
    assert len(set(codes[0].tolist())) == 2 and len(set(codes[1].tolist())) > 2  # both sides mix orders

    def run():
        with torch.no_grad():
            return model(input_ids=input_ids, attention_mask=mask, decoder_input_ids=decoder_input_ids,
                         use_cache=False, output_attentions=True)

    eager = run()
    built = []
    original_masked_plan = PerRowSublayerOrder._masked_plan

    def recording_masked_plan(self):
        built.append(len(self.orders))
        return original_masked_plan(self)

    monkeypatch.setattr(PerRowSublayerOrder, "_masked_plan", recording_masked_plan)
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    masked = run()
    assert sorted(built) == [2, 4]  # the encoder's and the decoder's plans were both the masked ones
    torch.testing.assert_close(masked.logits, eager.logits, atol=1e-5, rtol=0)
    for name in ("encoder_attentions", "decoder_attentions", "cross_attentions"):
        for expected, got in zip(getattr(eager, name), getattr(masked, name), strict=True):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_select_keeps_each_selected_rows_order():
    """`select(rows)` (e.g. a beam reorder): row j of the result runs the order of row `rows[j]`."""
    from flexformers.configuration.configuration_iot import DECODER_ORDER_CODES as CODES

    orders = [CODES[1], CODES[2], CODES[4]]
    per_row = PerRowSublayerOrder(torch.tensor([2, 0, 1, 1]), orders)
    rows = torch.tensor([3, 0, 0, 1, 2])
    selected = per_row.select(rows)
    assert selected.order_index.tolist() == [1, 2, 2, 0, 1]
    assert _sublayers_run_per_row(selected.stage_plan, 5) == [list(orders[i]) for i in (1, 2, 2, 0, 1)]


def test_gumbel_noise_is_made_on_the_logits_device():
    """Eq. 1's noise lives where the logits do (an accelerator, here the meta device), not on the CPU."""
    meta = torch.device("meta")
    assert sample_gumbel((2, 3), meta).device == meta
    confidences, probs = gumbel_softmax_confidences(torch.zeros(2, 3, device=meta), 1.0, 0.05)
    assert confidences.device == meta and probs.device == meta


def test_gumbel_noise_comes_from_the_given_generator():
    """g = −log(−log U) with U drawn from the caller's generator: reproducible from its seed, and the global
    random state is left alone (the training step's dropout masks do not shift)."""
    state = torch.get_rng_state()
    noise = sample_gumbel((4, 3), "cpu", torch.Generator().manual_seed(11))
    assert torch.equal(torch.get_rng_state(), state)
    uniform = torch.rand((4, 3), generator=torch.Generator().manual_seed(11))
    torch.testing.assert_close(noise, -torch.log(-torch.log(uniform)), atol=0, rtol=0)
    logits = torch.tensor([[0.3, -0.2, 1.0]]).expand(4, -1)
    confidences, _ = gumbel_softmax_confidences(logits, 2.0, 0.05, generator=torch.Generator().manual_seed(11))
    expected, _ = gumbel_softmax_confidences(logits, 2.0, 0.05, gumbel_noise=noise)
    torch.testing.assert_close(confidences, expected, atol=0, rtol=0)


def test_weighted_path_loss_is_in_the_path_losses_precision():
    """Eq. 3's sum comes back in the dtype of the path losses it weights (the caller's precision), whatever the
    confidences' dtype, with the value of γ_m λ_n L^{m,n} summed."""
    path_losses = torch.tensor([[[1.0, 2.0]], [[3.0, 5.0]]])  # [b=2, M=1, N=2]
    gamma = torch.ones(2, 1)
    lam = torch.tensor([[[0.25, 0.75]], [[0.5, 0.5]]])
    low = weighted_path_loss(path_losses.bfloat16(), gamma, lam)
    assert low.dtype == torch.bfloat16 and low.item() == pytest.approx(5.75, abs=0.05)
    double = weighted_path_loss(path_losses, gamma.double(), lam.double())
    assert double.dtype == torch.float32 and double.item() == pytest.approx(5.75, abs=1e-6)


def test_auxiliary_losses_of_the_per_encoder_order_decoder_distributions():
    """The decoder predictor's distributions are `[b, M, N]`: K = N is the last dimension. L_D (Eq. 5) is then the
    mean over encoder orders of each one's L_D, L_S (Eq. 6) the mean over all (sentence, m); both 0 at uniform."""
    uniform = torch.full((3, 2, 4), 0.25)  # M = 2 ≠ N = 4
    assert diversity_loss(uniform).item() == pytest.approx(0.0, abs=1e-6)
    assert sharpness_loss(uniform, 0.05).item() == pytest.approx(0.0, abs=1e-6)
    probs = torch.softmax(torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(2)), dim=-1)
    per_m = torch.stack([diversity_loss(probs[:, m]) for m in range(2)]).mean()
    assert diversity_loss(probs).item() == pytest.approx(per_m.item(), abs=1e-6)
    assert sharpness_loss(probs, 0.05).item() == pytest.approx(sharpness_loss(probs.reshape(6, 4), 0.05).item())


@pytest.mark.parametrize("mode", ["predictor", "equal"])
def test_encoder_outputs_from_elsewhere_get_the_decoder_orders_of_eq4(mode):
    """Encoder outputs computed elsewhere (a plain `BaseModelOutput`, or a tuple) get the decoder order of Eq. 4 —
    the predictor's argmax per sentence, or the fixed inference order of the "equal" mode — and decode exactly as
    when the model encodes `input_ids` itself."""
    if mode == "predictor":
        model = tiny_iot(decoder_orders=[1, 2, 4, 6])
        diverse_predictors(model)
    else:
        model = tiny_iot(order_selection="equal", decoder_orders=[1, 4, 6], inference_decoder_order=6)
    model.eval()
    input_ids, mask, labels = batch()
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels)
    with torch.no_grad():
        own = model(input_ids=input_ids, attention_mask=mask, decoder_input_ids=decoder_input_ids)
        states = model.get_encoder()(input_ids=input_ids, attention_mask=mask).last_hidden_state
        for encoder_outputs in (BaseModelOutput(last_hidden_state=states), (states,)):
            given = model(attention_mask=mask, encoder_outputs=encoder_outputs, decoder_input_ids=decoder_input_ids)
            assert torch.equal(given.decoder_order_index, own.decoder_order_index)
            torch.testing.assert_close(given.logits, own.logits, atol=1e-6, rtol=0)
    if mode == "predictor":
        assert len(set(own.decoder_order_index.tolist())) > 1
    else:
        assert own.decoder_order_index.tolist() == [2] * input_ids.shape[0]  # code 6


def test_path_losses_of_a_one_token_batch_are_that_tokens_losses():
    """A batch with a single target token (an EOS-only target): each path's per-token loss is that token's loss
    on the path, and Eq. 7 with weights 1 ("equal" mode) is their sum."""
    model = tiny_iot(order_selection="equal", encoder_orders=[1, 2], decoder_orders=[1, 4], label_smoothing=0.1)
    input_ids, mask, labels = batch(size=2)
    labels[:] = -100
    labels[0, 0] = 2
    model.train()
    out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
    model.eval()
    separate = torch.zeros(2, 2)
    for m, enc_code in enumerate([1, 2]):
        for n, dec_code in enumerate([1, 4]):
            encoded = model.encode_with_orders(input_ids, mask, encoder_order=enc_code, decoder_order=dec_code)
            separate[m, n] = model(attention_mask=mask, encoder_outputs=encoded, labels=labels).loss
    assert torch.allclose(out.path_losses, separate, atol=1e-5)
    assert out.loss.item() == pytest.approx(separate.sum().item(), abs=1e-4)


def test_training_outputs_hold_each_sentences_chosen_path_states_and_attentions():
    """In training, the returned hidden states and attention weights of the encoder and the decoder are those of
    each sentence's chosen (argmax) encoder × decoder path, as an eval pass forced onto that path gives them."""
    model = tiny_iot(encoder_orders=[1, 2], decoder_orders=[1, 2, 4, 6])
    diverse_predictors(model)
    input_ids, mask, labels = batch()
    model.train()
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=mask, labels=labels, output_hidden_states=True,
                    output_attentions=True)
    encoder_codes, decoder_codes = model.order_codes(out.encoder_order_index, out.decoder_order_index)
    assert len(set(zip(encoder_codes.tolist(), decoder_codes.tolist()))) > 2  # sentences take different paths
    fields = ("encoder_hidden_states", "encoder_attentions", "decoder_hidden_states", "decoder_attentions",
              "cross_attentions")
    model.eval()
    for sentence, (enc_code, dec_code) in enumerate(zip(encoder_codes.tolist(), decoder_codes.tolist())):
        with torch.no_grad():
            encoded = model.encode_with_orders(input_ids, mask, encoder_order=enc_code, decoder_order=dec_code,
                                               output_attentions=True, output_hidden_states=True)
            forced = model(attention_mask=mask, encoder_outputs=encoded, labels=labels, output_hidden_states=True,
                           output_attentions=True)
        for name in fields:
            got, expected = getattr(out, name), getattr(forced, name)
            assert got is not None and len(got) == len(expected), name
            for got_block, expected_block in zip(got, expected):
                torch.testing.assert_close(got_block[sentence], expected_block[sentence], atol=1e-5, rtol=0)
        torch.testing.assert_close(out.logits[sentence], forced.logits[sentence], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# Round 2 mutation survivors (issue 65)
# ---------------------------------------------------------------------------------------------------------------


def _rows_of(entry_rows, batch_size):
    """The batch rows a stage-plan entry covers (None: all; a slice, with Python's slice meaning; index tensor)."""
    if entry_rows is None:
        return list(range(batch_size))
    if isinstance(entry_rows, slice):
        return list(range(batch_size))[entry_rows]
    return entry_rows.tolist()


@pytest.mark.parametrize(
    "codes, order_index",
    [
        ([1, 4], [0, 1, 0, 1, 1, 0, 0]),
        ([1, 2, 4, 6], [3, 0, 2, 0, 1, 3, 2, 1]),
        ([1, 2, 3, 4, 5, 6], [5, 0, 4, 1, 3, 2, 0, 5, 1]),
        ([1, 3, 5], [0, 2, 1, 0, 2, 1]),  # self-attention first runs on 3 separate row blocks
        ([1, 3, 5], [0, 0, 1, 1, 2, 2]),  # sorted: one block per order
    ],
)
def test_stage_plan_runs_each_row_its_own_order_in_any_row_layout(codes, order_index):
    """The eager plan (from `order_index`, as in evaluation and generation, and from the host-side row blocks, as
    in training) runs every row's own sub-layers in its order, each once, whatever the rows' layout; rows form
    `contiguous_blocks`, the maximal runs of consecutive rows."""
    orders = [DECODER_ORDER_CODES[code] for code in codes]
    index = torch.tensor(order_index)
    expected = [list(orders[i]) for i in order_index]
    plans = [PerRowSublayerOrder(index, orders).stage_plan]
    runs = [(candidate, len(list(group))) for candidate, group in itertools.groupby(order_index)]
    plans.append(PerRowSublayerOrder.from_row_blocks(runs, orders).stage_plan)
    for plan in plans:
        performed = [[] for _ in order_index]
        for step in plan:
            for name, rows in step:
                for row in _rows_of(rows, len(order_index)):
                    performed[row].append(name)
        assert performed == expected
    assert contiguous_blocks(torch.tensor([0, 1, 2, 5, 7, 8])) == [slice(0, 3), slice(5, 6), slice(7, 9)]
    assert contiguous_blocks(torch.tensor([4])) == [slice(4, 5)]


@pytest.mark.parametrize("from_row_blocks", [False, True])
def test_stage_plan_uses_views_where_rows_are_contiguous(from_row_blocks):
    """`stage_plan`'s documented row forms (which decide views vs copies; the results are the same either way): a
    step whose rows are one contiguous block gets one slice; a self-attention step whose rows form at most as
    many blocks as there are orders runs once per block, each a slice; any other step gets its rows as one index
    tensor; a step of every row gets None."""
    cases = [([1, 4], [0, 1, 0, 1, 1, 0, 0]), ([1, 2, 4, 6], [0, 0, 2, 2, 1, 1, 3, 3]),
             ([1, 2, 4, 6], [3, 0, 2, 0, 1, 3]), ([1, 3, 5], [0, 2, 1, 0, 2, 1]), ([1, 3, 5], [0, 0, 1, 1, 2, 2])]
    forms = set()
    for codes, order_index in cases:
        forms |= _stage_plan_row_forms(codes, order_index, from_row_blocks)
    assert forms == {"all", "slice", "slices", "index"}  # the cases exercise every form


def _stage_plan_row_forms(codes, order_index, from_row_blocks):
    orders = [DECODER_ORDER_CODES[code] for code in codes]
    if from_row_blocks:
        runs = [(candidate, len(list(group))) for candidate, group in itertools.groupby(order_index)]
        per_row = PerRowSublayerOrder.from_row_blocks(runs, orders)
    else:
        per_row = PerRowSublayerOrder(torch.tensor(order_index), orders)
    forms = set()
    for step in per_row.stage_plan:
        rows = sorted(row for _, entry_rows in step for row in _rows_of(entry_rows, len(order_index)))
        name = step[0][0]
        blocks = contiguous_blocks(torch.tensor(rows))
        if len(rows) == len(order_index):
            assert step == [(name, None)]
            forms.add("all")
        elif len(blocks) == 1 or (name == "self_attn" and len(blocks) <= len(orders)):
            assert step == [(name, block) for block in blocks], (name, rows)
            forms.add("slices" if len(blocks) > 1 else "slice")
        else:
            assert len(step) == 1 and not isinstance(step[0][1], slice), (name, rows)
            assert step[0][1].tolist() == rows
            forms.add("index")
    return forms


def _arrangement_score(orders, arrangement):
    """How many (stage, sub-layer) groups of ≥ 2 candidates sit on consecutive positions of `arrangement`,
    self-attention groups counting double (`contiguous_order_arrangement`'s objective)."""
    position = {candidate: p for p, candidate in enumerate(arrangement)}
    score = 0
    for stage in range(len(orders[0])):
        for name in {order[stage] for order in orders}:
            places = [position[i] for i, order in enumerate(orders) if order[stage] == name]
            if len(places) > 1 and max(places) - min(places) == len(places) - 1:
                score += 2 if name == "self_attn" else 1
    return score


def test_contiguous_order_arrangement_keeps_the_most_stage_groups_together():
    """The paper's orders 1, 2, 4, 6 are laid out 1, 4, 2, 6 (the docstring's example); for every set of decoder
    orders the arrangement is a permutation whose score (groups of candidates running one sub-layer at one stage
    kept adjacent, self-attention counting double) is the best of all permutations. Orders 1, 2, 4, 5, 6 by hand:
    the pairs {1, 5} (SA at stage 1) and {2, 4} (SA at stage 2) count 2, {2, 6}, {1, 6}, {1, 4}, {2, 5} count 1,
    and a line of 5 holds 4 pairs: 2 + 2 + 1 + 1 = 6 at best (e.g. 4, 2, 5, 1, 6)."""
    paper = [DECODER_ORDER_CODES[code] for code in (1, 2, 4, 6)]
    assert contiguous_order_arrangement(paper) == [0, 2, 1, 3]
    assert tiny_iot(decoder_orders=[1, 2, 4, 6]).decoder_row_arrangement == [0, 2, 1, 3]
    five = [DECODER_ORDER_CODES[code] for code in (1, 2, 4, 5, 6)]
    assert _arrangement_score(five, contiguous_order_arrangement(five)) == 6
    for size in range(2, 7):
        for codes in itertools.combinations(sorted(DECODER_ORDER_CODES), size):
            orders = [DECODER_ORDER_CODES[code] for code in codes]
            arrangement = contiguous_order_arrangement(orders)
            assert sorted(arrangement) == list(range(size)), codes
            best = max(_arrangement_score(orders, p) for p in itertools.permutations(range(size)))
            assert _arrangement_score(orders, arrangement) == best, codes


@pytest.mark.parametrize("update_freq", [1, 3, 5000])
def test_temperature_schedule_is_the_stepwise_exponential_decay_from_step_0(update_freq):
    """τ = max(τ_max · exp(−r · ⌊step / f⌋ · f), τ_min), steps below 0 counting as 0: step 0 is τ_max itself,
    and with f = 1 every step decays; the model's (τ_e, τ_d) follow it from its own step."""
    tau_max, tau_min, rate = 10.0, 1.0, 0.1
    for step in [-3, -1, 0, 1, 2, 3, 4, 7, 5000, 5001, 10**6]:
        expected = max(tau_max * math.exp(-rate * (max(step, 0) // update_freq) * update_freq), tau_min)
        assert gumbel_temperature_at(step, tau_max, tau_min, rate, update_freq) == pytest.approx(expected, rel=1e-12)
    assert gumbel_temperature_at(0, tau_max, tau_min, rate, update_freq) == tau_max
    model = tiny_iot(encoder_orders=[1, 2], encoder_gumbel_temperature=8.0, decoder_gumbel_temperature=4.0,
                     gumbel_temperature_min=0.5, gumbel_temperature_decay_rate=rate,
                     gumbel_temperature_update_freq=update_freq)
    assert model.gumbel_temperatures() == (8.0, 4.0)
    assert model.gumbel_temperature.values.tolist() == [8.0, 4.0]
    model.set_gumbel_step(3)
    decay = math.exp(-rate * (3 // update_freq) * update_freq)
    assert model.gumbel_temperatures() == pytest.approx((max(8.0 * decay, 0.5), max(4.0 * decay, 0.5)), rel=1e-12)
    assert model.gumbel_temperature.values.tolist() == pytest.approx(list(model.gumbel_temperatures()), rel=1e-6)


@pytest.mark.parametrize("weight_smoothing", [True, False])
def test_loss_without_label_smoothing_is_eq7_of_the_confidence_weighted_nll(weight_smoothing):
    """ε = 0: L^{m,n} is path (m, n)'s NLL, and the training loss is Eq. 7 with Eq. 3's L_C = Σ γ_m λ_n L^{m,n}
    per target token (either `weight_smoothing_loss`: with ε = 0 there is no smoothing term to weight); the
    reported per-token `path_losses` are each path's NLL. The NLL is computed here from the paths' logits."""
    model = tiny_iot(encoder_orders=[1, 2], decoder_orders=[1, 4], label_smoothing=0.0,
                     weight_smoothing_loss=weight_smoothing, diversity_loss_coef=0.5, sharpness_loss_coef=0.25)
    input_ids, mask, labels = batch()
    model.train()
    out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
    model.eval()
    kept = labels.ne(-100)
    nll = torch.zeros(input_ids.shape[0], 2, 2)
    with torch.no_grad():
        for m, encoder_code in enumerate([1, 2]):
            for n, decoder_code in enumerate([1, 4]):
                encoded = model.encode_with_orders(
                    input_ids, mask, encoder_order=encoder_code, decoder_order=decoder_code
                )
                log_probs = model(attention_mask=mask, encoder_outputs=encoded, labels=labels).logits.log_softmax(-1)
                token_nll = -log_probs.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
                nll[:, m, n] = (token_nll * kept).sum(-1)
    tokens = kept.sum().item()
    weights = out.encoder_confidences.detach().unsqueeze(-1) * out.decoder_confidences.detach()
    expected = (weights * nll).sum() / tokens + 0.5 * out.diversity_loss + 0.25 * out.sharpness_loss
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-5)
    torch.testing.assert_close(out.path_losses, nll.sum(0) / tokens, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("encoder_orders", [[1], [1, 2]])
def test_order_statistics_are_the_means_of_the_training_forwards(encoder_orders):
    """`pop_order_statistics()` after two training forwards: each path's per-token loss (`iot/loss_dec<n>` when
    there is one encoder order, else `iot/loss_enc<m>_dec<n>`), the share of (sentence, encoder order) pairs whose
    argmax decoder order is each code, the mean predictor probabilities, L_D, L_S (means over the forwards) and
    the temperatures; nothing else."""
    decoder_orders = [1, 2, 4, 6]
    model = tiny_iot(encoder_orders=encoder_orders, decoder_orders=decoder_orders, label_smoothing=0.1,
                     encoder_gumbel_temperature=3.0, decoder_gumbel_temperature=5.0)
    diverse_predictors(model, scale=5.0)
    model.train()
    outs = []
    with torch.no_grad():
        for seed in (0, 1):
            input_ids, mask, labels = batch(seed=seed)
            outs.append(model(input_ids=input_ids, attention_mask=mask, labels=labels))
    stats = model.pop_order_statistics()
    expected = {"iot/diversity_loss": sum(o.diversity_loss.item() for o in outs) / 2,
                "iot/sharpness_loss": sum(o.sharpness_loss.item() for o in outs) / 2,
                "iot/tau_encoder": 3.0, "iot/tau_decoder": 5.0}
    path_loss = (outs[0].path_losses + outs[1].path_losses) / 2
    for m, encoder_code in enumerate(encoder_orders):
        for n, decoder_code in enumerate(decoder_orders):
            name = f"iot/loss_dec{decoder_code}" if len(encoder_orders) == 1 else (
                f"iot/loss_enc{encoder_code}_dec{decoder_code}")
            expected[name] = path_loss[m, n].item()
    decoder_choices = torch.cat([o.decoder_order_probs.argmax(-1).flatten() for o in outs])
    decoder_probs = sum(o.decoder_order_probs.reshape(-1, 4).mean(0) for o in outs) / 2
    for n, code in enumerate(decoder_orders):
        expected[f"iot/decoder_order_{code}_usage"] = (decoder_choices == n).float().mean().item()
        expected[f"iot/decoder_order_{code}_prob"] = decoder_probs[n].item()
    if len(encoder_orders) > 1:
        encoder_choices = torch.cat([o.encoder_order_probs.argmax(-1) for o in outs])
        encoder_probs = sum(o.encoder_order_probs.mean(0) for o in outs) / 2
        for m, code in enumerate(encoder_orders):
            expected[f"iot/encoder_order_{code}_usage"] = (encoder_choices == m).float().mean().item()
            expected[f"iot/encoder_order_{code}_prob"] = encoder_probs[m].item()
    assert set(stats) == set(expected)
    for name, value in expected.items():
        assert stats[name] == pytest.approx(value, abs=1e-5), name
    assert len({stats[f"iot/decoder_order_{code}_usage"] for code in decoder_orders}) > 1  # not all one order
    assert model.pop_order_statistics() == {}


def _count_key_value_projections(model, monkeypatch):
    """Count, per decoder block, the calls projecting encoder states to cross-attention keys/values."""
    counts = [0] * len(model.get_decoder().layers)
    for index, layer in enumerate(model.get_decoder().layers):
        original = layer.encoder_attn.project_key_value

        def counted(states, _index=index, _original=original):
            counts[_index] += 1
            return _original(states)

        monkeypatch.setattr(layer.encoder_attn, "project_key_value", counted)
    return counts


def test_cross_attention_keys_values_are_projected_once_per_block(monkeypatch):
    """The encoder states' keys/values are projected once per decoder block: in stacked training for all N decoder
    orders and every sub-layer call of the block (orders 1 and 4 reach cross-attention at two different steps),
    and in generation once for all steps (then kept in the cache); the results equal separate passes (tested
    above)."""
    model = tiny_iot(encoder_orders=[1, 2], decoder_orders=[1, 4], label_smoothing=0.1)
    diverse_predictors(model)
    input_ids, mask, labels = batch()
    counts = _count_key_value_projections(model, monkeypatch)
    model.train()
    model(input_ids=input_ids, attention_mask=mask, labels=labels)
    assert counts == [1, 1]
    model.eval()
    counts[:] = [0, 0]
    output = model.generate(input_ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                            return_dict_in_generate=True)
    assert len(set(output.decoder_order_codes.tolist())) == 2  # a mixed batch
    assert counts == [1, 1]


@pytest.mark.parametrize(
    "options",
    [
        {"num_beams": 1},
        {"num_beams": 2},  # a beam search's cache keeps one cross-attention row per sentence: reordered on its own
    ],
)
def test_generation_cache_comes_back_in_input_order(options):
    """`generate()` decodes the batch sorted by order and restores the input order of everything it returns, the
    cache included: each sentence's self- and cross-attention keys are those of the sentence decoded alone with
    its order."""
    model = tiny_iot(seed=1, decoder_orders=[1, 2, 4, 6])
    diverse_predictors(model)
    model.eval()
    input_ids, mask, _ = batch(seed=2, size=8)
    options = {"max_new_tokens": 4, "min_new_tokens": 4, "return_dict_in_generate": True, **options}
    output = model.generate(input_ids, attention_mask=mask, **options)
    codes = output.decoder_order_codes.tolist()
    rank = {code: model.decoder_row_arrangement.index([1, 2, 4, 6].index(code)) for code in set(codes)}
    assert [rank[code] for code in codes] != sorted(rank[code] for code in codes)  # generate had to sort
    cache = output_cache(output)
    beams = options["num_beams"]
    for row in range(input_ids.shape[0]):
        length = int(mask[row].sum())
        alone = output_cache(model.generate(input_ids[row : row + 1, :length], decoder_order=codes[row], **options))
        for ours, theirs in zip(cache.self_attention_cache.layers, alone.self_attention_cache.layers, strict=True):
            torch.testing.assert_close(ours.keys[row * beams : (row + 1) * beams], theirs.keys, atol=1e-5, rtol=0)
        for ours, theirs in zip(cache.cross_attention_cache.layers, alone.cross_attention_cache.layers, strict=True):
            per_sentence = ours.keys.shape[0] // len(codes)  # one row per sentence when beams share them
            sentence = ours.keys[row * per_sentence : (row + 1) * per_sentence, :, :length]
            torch.testing.assert_close(sentence, theirs.keys, atol=1e-5, rtol=0)


@pytest.mark.parametrize("decoder_padding_mask", [False, True])
def test_training_outputs_of_one_decoder_pass_per_path_equal_the_stacked_pass(decoder_padding_mask):
    """`batch_order_paths=False` (one decoder pass per path) returns what the stacked pass returns — loss, path
    losses, logits and each sentence's chosen-path hidden states and attention weights (checked against forced
    eval passes above) —, also with a decoder padding mask, which the stacked pass repeats for every path."""
    outputs = []
    for batch_paths in (True, False):
        model = tiny_iot(encoder_orders=[1, 2], decoder_orders=[1, 2, 4, 6], label_smoothing=0.1,
                         batch_order_paths=batch_paths)
        diverse_predictors(model)
        input_ids, mask, labels = batch()
        decoder_mask = {}
        if decoder_padding_mask:  # row 1's labels end at 4: its decoder inputs 5 and 6 are padding
            decoder_mask["decoder_attention_mask"] = torch.ones_like(labels)
            decoder_mask["decoder_attention_mask"][1, 5:] = 0
        model.train()
        torch.manual_seed(5)
        with torch.no_grad():
            outputs.append(model(input_ids=input_ids, attention_mask=mask, labels=labels, output_hidden_states=True,
                                 output_attentions=True, **decoder_mask))
    stacked, separate = outputs
    if decoder_padding_mask:  # the mask reached the decoder: the padded positions attend to fewer keys
        assert stacked.decoder_attentions[0][1, :, 6, 5:].abs().sum() == 0
        assert stacked.decoder_attentions[0][0, :, 6, 5:].abs().sum() > 0
    for name in ("loss", "path_losses", "logits", "encoder_last_hidden_state", "encoder_confidences",
                 "decoder_confidences"):
        torch.testing.assert_close(getattr(separate, name), getattr(stacked, name), atol=1e-5, rtol=0)
    for name in ("encoder_hidden_states", "encoder_attentions", "decoder_hidden_states", "decoder_attentions",
                 "cross_attentions"):
        ours, theirs = getattr(separate, name), getattr(stacked, name)
        assert ours is not None and len(ours) == len(theirs), name
        for got, expected in zip(ours, theirs):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_sentence_losses_ignore_the_given_ignore_index(epsilon):
    """Per-sentence NLL and smoothing sums (Eq. 3's L^{m,n} per sentence) skip the targets equal to `ignore_index`
    (here the padding id 1) as they skip -100 by default; the smoothing sum is 0 without label smoothing."""
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 5, 8, generator=generator)
    labels = torch.randint(2, 8, (3, 5), generator=generator)
    labels[0, 3:] = 1
    labels[2, 1:] = 1
    nll, smooth = sentence_label_smoothed_losses(logits, labels, epsilon, ignore_index=1)
    log_probs = logits.double().log_softmax(-1)
    kept = labels.ne(1)
    expected_nll = (-log_probs.gather(-1, labels[..., None]).squeeze(-1) * kept).sum(-1)
    expected_smooth = (-log_probs.sum(-1) * kept).sum(-1) if epsilon > 0 else torch.zeros(3, dtype=torch.double)
    torch.testing.assert_close(nll.double(), expected_nll, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(smooth.double(), expected_smooth, atol=1e-4, rtol=1e-5)


# ---- issue 65, round 3: the held-out sample's (seed 2) survivors ----


def test_encoder_outputs_given_with_input_ids_choose_decoder_orders_under_the_callers_mask():
    """With `encoder_outputs` given, the decoder predictor reads the caller's `attention_mask` (one that hides real
    tokens too), not a mask rebuilt from `input_ids`' padding; its probabilities come back as when the model encodes
    itself."""
    model = tiny_iot(decoder_orders=[1, 2, 4, 6])
    diverse_predictors(model)
    model.eval()
    input_ids, pad_mask, labels = batch()
    callers_mask = pad_mask.clone()
    callers_mask[:, 1:3] = 0  # the caller hides two real tokens of every row
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels)
    with torch.no_grad():
        states = model.get_encoder()(input_ids=input_ids, attention_mask=callers_mask).last_hidden_state
        given = model(input_ids=input_ids, attention_mask=callers_mask, encoder_outputs=(states,),
                      decoder_input_ids=decoder_input_ids)
        expected = torch.softmax(model.decoder_order_predictor(states, callers_mask), dim=-1)
        padding_only = torch.softmax(model.decoder_order_predictor(states, pad_mask), dim=-1)
    assert given.decoder_order_probs is not None
    torch.testing.assert_close(given.decoder_order_probs, expected, atol=1e-6, rtol=0)
    assert not torch.allclose(expected, padding_only, atol=1e-4)  # the two masks do choose differently
    assert torch.equal(given.decoder_order_index, expected.argmax(-1))


def test_an_inference_encoder_order_in_the_config_does_not_override_the_predictor():
    """`inference_encoder_order` is the fixed order of the predictor-less "equal" mode; an IOT with an encoder
    predictor still chooses each sentence's encoder order by Eq. 4 on the predictor's logits."""
    model = tiny_iot(encoder_orders=[1, 2], decoder_orders=[1, 2], inference_encoder_order=2)
    diverse_predictors(model, scale=60.0)
    model.eval()
    input_ids, mask, _ = batch(size=12)
    with torch.no_grad():
        encoded = model.encode_with_orders(input_ids, mask)
        token_embeddings = model.get_encoder().embed_tokens(input_ids)
        expected = model.encoder_order_predictor(token_embeddings, mask).argmax(-1)
    assert torch.equal(encoded.encoder_order_index, expected)
    assert len(set(expected.tolist())) > 1  # the batch mixes both orders, so the fixed code would differ


def test_gumbel_confidences_normalise_over_the_orders_of_every_leading_axis():
    """Eq. 1 / 2 on `[b, M, N]` logits (the decoder predictor's, one row per encoder order in training): a softmax
    over the last axis, N orders, for every (sentence, encoder order) — checked against the formula."""
    from flexformers.modeling.iot_equations import clamp_order_probs, gumbel_softmax_confidences

    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 2, 3, generator=generator) * 3
    noise = sample_gumbel(logits.shape, logits.device, generator)
    confidences, probs = gumbel_softmax_confidences(logits, 2.0, 0.05, gumbel_noise=noise)
    expected_probs = logits.exp() / logits.exp().sum(-1, keepdim=True)
    torch.testing.assert_close(probs, expected_probs)
    scores = (clamp_order_probs(expected_probs, 0.05).log() + noise) / 2.0
    torch.testing.assert_close(confidences, scores.exp() / scores.exp().sum(-1, keepdim=True))
    torch.testing.assert_close(confidences.sum(-1), torch.ones(4, 2))


def test_a_training_forward_adds_no_statistic_that_was_not_there_from_the_start():
    """The order statistics hold every key before the first step (a compiled step that accumulates into them must
    meet the same dict each time), and logging empties them back to those keys."""
    model = tiny_iot(encoder_orders=[1, 2], decoder_orders=[1, 2, 3]).train()
    start = {name: value.shape for name, value in model._order_statistics.sums.items()}
    input_ids, mask, labels = batch()
    model(input_ids=input_ids, attention_mask=mask, labels=labels)
    after_step = {name: value.shape for name, value in model._order_statistics.sums.items()}
    assert after_step == start
    logged = model.pop_order_statistics()
    assert {"iot/tau_encoder", "iot/tau_decoder"} <= set(logged)
    assert {name: value.shape for name, value in model._order_statistics.sums.items()} == start


def test_no_clamp_passes_the_gradient_of_a_certain_predictor():
    """clamp = 0 (the official code's default) leaves Eq. 2's probabilities untouched, gradients included: a
    predictor whose softmax reached exactly 1 and 0 still gets the gradient that clamping to [0, 1] would stop."""
    from flexformers.modeling.iot_equations import clamp_order_probs

    probs = torch.softmax(torch.tensor([[200.0, 0.0, 0.0]]), dim=-1).detach().requires_grad_()
    assert probs.tolist() == [[1.0, 0.0, 0.0]]
    (clamp_order_probs(probs, 0.0) * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert probs.grad.tolist() == [[1.0, 2.0, 3.0]]


def test_order_codes_stay_on_the_device_of_the_order_indices():
    """The paper codes of the chosen orders are made on the indices' device (a GPU model's codes stay on the GPU);
    the meta device stands in for another device here."""
    model = tiny_iot(encoder_orders=[1, 2], decoder_orders=[1, 2, 3])
    encoder_index = torch.tensor([1, 0, 1], device="meta")
    decoder_index = torch.tensor([2, 0, 1], device="meta")
    encoder_codes, decoder_codes = model.order_codes(encoder_index, decoder_index)
    assert encoder_codes.device.type == "meta" and decoder_codes.device.type == "meta"
    cpu_codes = model.order_codes(torch.tensor([1, 0, 1]), torch.tensor([2, 0, 1]))
    assert cpu_codes[0].tolist() == [2, 1, 2] and cpu_codes[1].tolist() == [3, 1, 2]


@pytest.mark.parametrize("uses_predictor", [False, True])
def test_decoder_orders_added_to_outside_encoder_outputs_stay_on_their_device(uses_predictor):
    """Encoder outputs computed elsewhere get Eq. 4's decoder order on the device of their states (a GPU model's
    order index stays on the GPU; the meta device stands in for another device), fixed order or predicted."""
    config = dict(encoder_orders=[1, 2], decoder_orders=[1, 2, 3])
    if not uses_predictor:
        config.update(decoder_orders=[3])
    with torch.device("meta"):
        model = tiny_iot(**config)
    states = torch.zeros(2, 4, TINY["encoder_embed_dim"], device="meta")
    with_orders = model._with_decoder_orders(BaseModelOutput(last_hidden_state=states), None, None)
    assert with_orders.decoder_order_index.device.type == "meta"
    assert with_orders.decoder_order_index.shape == (2,)


def test_the_encoder_takes_inputs_embeds_as_it_takes_input_ids():
    """`encode_with_orders` from token embeddings (no ids) chooses the same orders and encodes the same states as
    from the ids, with a padding mask or, for an unpadded sentence, without one."""
    model = tiny_iot(encoder_orders=[1, 2], decoder_orders=[1, 2, 3]).eval()
    diverse_predictors(model)
    input_ids, mask, _ = batch()
    embeds = model.get_encoder().embed_tokens(input_ids)
    with torch.no_grad():
        from_ids = model.encode_with_orders(input_ids, mask)
        from_embeds = model.encode_with_orders(None, mask, inputs_embeds=embeds)
        unpadded = model.encode_with_orders(None, inputs_embeds=embeds[:1])
    torch.testing.assert_close(from_embeds.last_hidden_state, from_ids.last_hidden_state)
    assert torch.equal(from_embeds.encoder_order_index, from_ids.encoder_order_index)
    assert torch.equal(from_embeds.decoder_order_index, from_ids.decoder_order_index)
    torch.testing.assert_close(unpadded.last_hidden_state, from_ids.last_hidden_state[:1])


def test_the_encoder_returns_hidden_states_only_when_asked():
    model = tiny_iot().eval()
    input_ids, mask, _ = batch()
    with torch.no_grad():
        assert model.encode_with_orders(input_ids, mask).hidden_states is None
        asked = model.encode_with_orders(input_ids, mask, output_hidden_states=True)
    assert len(asked.hidden_states) == TINY_LAYERS + 1


def test_encoder_outputs_computed_elsewhere_keep_their_attentions_and_hidden_states():
    """Given `encoder_outputs` (a plain BaseModelOutput), the model adds Eq. 4's decoder orders and returns the
    encoder's attentions and hidden states with them, as BART returns those it was given."""
    model = tiny_iot(decoder_orders=[1, 2, 3]).eval()
    diverse_predictors(model)
    input_ids, mask, labels = batch()
    with torch.no_grad():
        encoded = model.get_encoder()(input_ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
        given = BaseModelOutput(last_hidden_state=encoded.last_hidden_state, hidden_states=encoded.hidden_states,
                                attentions=encoded.attentions)
        output = model(encoder_outputs=given, attention_mask=mask, labels=labels)
    assert output.encoder_attentions is encoded.attentions
    assert output.encoder_hidden_states is encoded.hidden_states


def test_all_order_training_takes_decoder_inputs_embeds_as_it_takes_decoder_input_ids():
    """Training over every order path at once (`batch_order_paths`) feeds each path the decoder's token embeddings
    when they are given instead of ids: the loss is the same."""
    model = tiny_iot(encoder_orders=[1, 2], decoder_orders=[1, 2, 3]).train()
    input_ids, mask, labels = batch()
    decoder_input_ids = torch.cat([torch.full((labels.shape[0], 1), 2), labels[:, :-1].clamp(min=1)], dim=1)
    losses = []
    for inputs in ({"decoder_input_ids": decoder_input_ids},
                   {"decoder_inputs_embeds": model.get_decoder().embed_tokens(decoder_input_ids).detach()}):
        torch.manual_seed(4)  # the same Gumbel noise for both
        losses.append(model(input_ids=input_ids, attention_mask=mask, labels=labels, **inputs).loss)
    torch.testing.assert_close(losses[0], losses[1])


def test_generation_reorders_every_tensor_in_a_list_of_outputs():
    """Sorted generation puts each sentence's rows back in the caller's order in every batch-major output, lists
    (per-step fields) included, nested tuples too."""
    from flexformers.modeling.iot_generation import _reorder_rows

    positions = torch.tensor([2, 0, 1])
    rows = torch.arange(6.0).view(6, 1)  # two rows per sentence
    expected = torch.tensor([[4.0], [5.0], [0.0], [1.0], [2.0], [3.0]])  # block j is sentence positions[j]
    reordered = _reorder_rows([rows, (rows, torch.tensor(7.0))], positions, 3)
    assert isinstance(reordered, list)
    torch.testing.assert_close(reordered[0], expected)
    torch.testing.assert_close(reordered[1][0], expected)
    assert reordered[1][1].item() == 7.0


def test_gumbel_noise_is_float32_whatever_the_default_dtype():
    """Eq. 1's noise is drawn in fp32 (its clamps use fp32's tiny and eps) even under a float64 default dtype."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        noise = sample_gumbel((64,), torch.device("cpu"), torch.Generator().manual_seed(0))
    finally:
        torch.set_default_dtype(previous)
    assert noise.dtype == torch.float32


def test_order_statistics_start_on_the_host_even_under_a_device_context():
    """Transformers builds models under a device context (meta, or the GPU with device_map): the order statistics are
    per-process accumulators made on the host all the same, moved to the model's device by the first training step."""
    from flexformers.modeling.iot_order_statistics import IOTOrderStatistics

    config = tiny_iot(encoder_orders=[1, 2], decoder_orders=[1, 2, 3]).config
    with torch.device("meta"):
        statistics = IOTOrderStatistics(config, encoder_predictor=True, decoder_predictor=True)
    assert {value.device.type for value in statistics.sums.values()} == {"cpu"}


# ---- issue 65, round 5 ----------------------------------------------------------------------------------------


def test_outside_encoder_outputs_get_the_decoder_orders_their_input_ids_give():
    """Encoder outputs computed elsewhere (a tuple, or an IOT output without decoder orders) get Eq. 4's decoder
    order predicted over the sentence's real tokens: with only `input_ids`, the padding mask comes from the pad id,
    so the probabilities equal the model's own encoding's; an encoder order already chosen is kept; a fixed decoder
    order has no probabilities."""
    from flexformers.modeling.modeling_iot import IOTEncoderOutput

    model = tiny_iot(encoder_orders=[1, 2], decoder_orders=[1, 2, 3]).eval()
    diverse_predictors(model)
    input_ids, mask, labels = batch()
    with torch.no_grad():
        own = model.encode_with_orders(input_ids, mask)
        from_ids = model(input_ids=input_ids, encoder_outputs=(own.last_hidden_state,), labels=labels)
        unmasked = model(encoder_outputs=(own.last_hidden_state,), labels=labels)
        partial = IOTEncoderOutput(last_hidden_state=own.last_hidden_state, encoder_order_index=own.encoder_order_index)
        kept = model(input_ids=input_ids, encoder_outputs=partial, labels=labels)
    torch.testing.assert_close(from_ids.decoder_order_probs, own.decoder_order_probs)
    assert not torch.allclose(unmasked.decoder_order_probs, own.decoder_order_probs)  # padding changes the mean here
    assert torch.equal(kept.encoder_order_index, own.encoder_order_index)
    assert torch.equal(kept.decoder_order_index, own.decoder_order_index)
    fixed = tiny_iot(encoder_orders=[1, 2], decoder_orders=[3]).eval()
    with torch.no_grad():
        fixed_output = fixed(input_ids=input_ids, encoder_outputs=(own.last_hidden_state,), labels=labels)
    assert fixed_output.decoder_order_probs is None and fixed_output.decoder_order_index.tolist() == [0] * len(labels)


def test_sorted_generation_reorders_cache_rows_on_the_caches_device_and_leaves_empty_caches_alone():
    """A returned cache is put back in the caller's order on the device its keys live on (the meta device stands in
    for a GPU; the positions come from the host), and a cache with no layers yet (a cross-attention cache before
    its first step) is returned as it is."""
    from transformers import DynamicCache, EncoderDecoderCache

    from flexformers.modeling.iot_generation import _reorder_rows

    positions = torch.tensor([2, 0, 1])
    self_attention = DynamicCache()
    keys = torch.arange(6.0).view(6, 1, 1, 1)  # two rows per sentence
    self_attention.update(keys, keys.clone(), 0)
    cache = _reorder_rows(EncoderDecoderCache(self_attention, DynamicCache()), positions, 3)
    assert cache.self_attention_cache.layers[0].keys.flatten().tolist() == [4.0, 5.0, 0.0, 1.0, 2.0, 3.0]
    assert cache.cross_attention_cache.layers == []
    on_device = DynamicCache()
    on_device.update(torch.zeros(6, 1, 1, 1, device="meta"), torch.zeros(6, 1, 1, 1, device="meta"), 0)
    assert _reorder_rows(on_device, positions, 3).layers[0].keys.device.type == "meta"


def test_a_scattered_row_plan_indexes_rows_on_the_order_index_device():
    """Rows of one sub-layer step that form more blocks than a split can take are gathered with an index on the
    order index's device (the meta device stands in for a GPU), built from the host-side row layout."""
    orders = [("self_attn", "ffn"), ("ffn", "self_attn")]
    layout = [(0, 1), (1, 1), (0, 1), (1, 1), (0, 1)]
    for device in ("cpu", "meta"):
        plan = PerRowSublayerOrder.from_row_blocks(layout, orders, device=device).stage_plan
        gathered = [rows for step in plan for _, rows in step if isinstance(rows, torch.Tensor)]
        assert gathered and all(rows.device.type == device for rows in gathered)
    cpu_plan = PerRowSublayerOrder.from_row_blocks(layout, orders).stage_plan
    assert [(name, rows.tolist()) for step in cpu_plan for name, rows in step if isinstance(rows, torch.Tensor)] == [
        ("ffn", [1, 3]), ("ffn", [0, 2, 4])]  # the self-attention between them runs once per block


# ---- issue 65, round 7: the held-out sample's (seed 5) survivors ----


def test_reordering_a_cache_on_an_accelerator_builds_the_row_index_there():
    """Sorting the sentences of a generation back (`_reorder_rows`) with the cache and the sentence order on an
    accelerator (the meta device stands in for one) builds the row index on that device: an index built on the CPU
    cannot be combined with the sentence order. On the CPU, block i of the rows moves to block
    sentence_positions[i]."""
    from transformers import DynamicCache

    from flexformers.modeling.iot_generation import _reorder_rows

    cache = DynamicCache()
    keys = torch.arange(4.0)[:, None, None, None].expand(4, 1, 2, 3).clone()  # two rows per sentence
    cache.update(keys, keys.clone(), 0)
    _reorder_rows(cache, torch.tensor([1, 0]), 2)
    assert cache.layers[0].keys[:, 0, 0, 0].tolist() == [2.0, 3.0, 0.0, 1.0]

    meta = torch.device("meta")
    cache = DynamicCache()
    cache.update(torch.zeros(4, 1, 2, 3, device=meta), torch.zeros(4, 1, 2, 3, device=meta), 0)
    assert _reorder_rows(cache, torch.tensor([1, 0], device=meta), 2).layers[0].keys.device == meta
