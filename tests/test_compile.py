"""Training that compiles (issue 23): the training forward + backward of every model type traces as one graph with
`torch.compile(fullgraph=True)` and equals eager training; the few graph breaks left are named here exactly;
`flexformers-train --torch_compile true` trains every model type with few recompiles; the CPU speed kernels step
aside (or are traced) inside a compiled region.

Compiled with the `aot_eager` backend: the same graphs inductor gets (dynamo capture, AOT autograd's joint forward +
backward), run with eager kernels, so no C++ is compiled in CI."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch._dynamo
from safetensors.torch import load_file
from torch import nn

from flexformers.modeling import cpu_kernels
from flexformers.modeling.losses import label_smoothed_nll_loss
from flexformers.training_scripts import train
from flexformers.training_scripts.indigo_orders import InDIGODataCollator
from tests.test_conformance import MODEL_TYPES, label_batch, source_batch, tiny_model
from tests.test_training import tiny_argv

BACKEND = "aot_eager"
PAD = 1


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def seq2seq_batch() -> dict:
    source = source_batch()
    return {"input_ids": source, "attention_mask": source.ne(PAD).long(), "labels": label_batch()}


def indigo_collator_batch(order: str) -> dict:
    """What flexformers-train feeds InDIGO: the collator's insertion batch for a given generation order."""
    collator = InDIGODataCollator(order=order, pad_token_id=PAD, bos_token_id=0, eos_token_id=2, eod_token_id=4)
    features = [
        {"input_ids": [t for t in source.tolist() if t != PAD], "labels": [t for t in labels.tolist() if t != -100]}
        for source, labels in zip(source_batch(), label_batch())
    ]
    return collator(features)


#: case -> (model type, config overrides, batch). Dropout stays 0 (the tiny configs'): the compiled step and the
#: eager one then compute the same function; IOT's Gumbel noise and MAT's drop-branch draw from the seeded generator
#: in the same order in both.
TRAINING_CASES = {
    "flexformer": ("flexformer", {}, seq2seq_batch),
    "mat": ("mat", {}, seq2seq_batch),  # 2 attention branches, drop-branch 0.2
    # 4 decoder orders x 2 encoder orders: the 8 order paths stacked along the batch, Gumbel-softmax predictors
    "iot": ("iot", {}, seq2seq_batch),
    "iot_path_by_path": ("iot", {"batch_order_paths": False}, seq2seq_batch),
    "depth_adaptive": ("depth_adaptive", {}, seq2seq_batch),  # aligned training: every exit's classifier (Eq. 4)
    "depth_adaptive_halting": (
        "depth_adaptive",
        {"halting_mechanism": "token_geometric", "oracle": "correctness", "exit_loss_alpha": 0.1},
        seq2seq_batch,
    ),
    "indigo_l2r": ("indigo", {}, lambda: indigo_collator_batch("l2r")),
    "indigo_fixed_order": ("indigo", {}, lambda: indigo_collator_batch("blt")),
    "indigo_labels_only": ("indigo", {}, seq2seq_batch),
}

SLOW_CASES = {"iot_path_by_path"}  # eight decoder passes to trace (~30 s)


def loss_and_gradients(forward, model, batch, seed: int = 0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = forward(**batch).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "case",
    [pytest.param(case, marks=pytest.mark.slow) if case in SLOW_CASES else case for case in TRAINING_CASES],
)
def test_compiled_training_step_is_one_graph_and_equals_eager(case):
    """`fullgraph=True` refuses any graph break, so compiling at all proves one graph; two steps (different
    seeds) give eager's loss and every gradient within 1e-5."""
    model_type, overrides, make_batch = TRAINING_CASES[case]
    model = tiny_model(model_type, **overrides).train()
    batch = make_batch()
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
    for seed in (0, 1):
        eager_loss, eager_gradients = loss_and_gradients(model, model, batch, seed)
        compiled_loss, compiled_gradients = loss_and_gradients(compiled, model, batch, seed)
        torch.testing.assert_close(compiled_loss, eager_loss, rtol=0, atol=1e-5)
        assert compiled_gradients.keys() == eager_gradients.keys() and len(eager_gradients) > 10
        for name, gradient in eager_gradients.items():
            torch.testing.assert_close(compiled_gradients[name], gradient, rtol=0, atol=1e-5, msg=name)


def break_sites(explanation) -> set[tuple[str, str]]:
    """(first line of the reason, function it broke in) of every graph break."""
    return {(reason.reason.splitlines()[0], reason.user_stack[-1].name) for reason in explanation.break_reasons}


def test_indigo_labels_with_their_shifted_copy_break_only_at_the_check():
    """A `DataCollatorForSeq2Seq` batch (labels + their shifted copy as `decoder_input_ids`): InDIGO checks on the
    host that the decoder inputs are that copy before training on the labels alone (`_check_labels_alone`,
    `torch.equal`), the one data-dependent branch left (dynamo counts 2 breaks there, 3 graphs). Labels alone, or
    the InDIGO collator's batch, are one graph (above)."""
    model = tiny_model("indigo").train()
    batch = seq2seq_batch()
    batch["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(batch["labels"])
    explanation = torch._dynamo.explain(lambda **inputs: model(**inputs).loss)(**batch)
    assert explanation.graph_count == 3 and explanation.graph_break_count == 2
    assert break_sites(explanation) == {("Data dependent operator", "_check_labels_alone")}


def test_depth_adaptive_mixed_training_breaks_only_where_it_groups_positions_by_exit():
    """Mixed training (Eq. 5, not the paper's choice) classifies each position with its sampled exit's classifier
    only, gathering each exit's positions (`classify_by_exit`: `torch.unique`, a data-dependent shape); nothing
    else breaks the graph."""
    model = tiny_model("depth_adaptive", training_mode="mixed", mixed_num_samples=2).train()
    explanation = torch._dynamo.explain(lambda **inputs: model(**inputs).loss)(**seq2seq_batch())
    assert explanation.graph_break_count > 0
    assert break_sites(explanation) == {("Dynamic shape operator", "classify_by_exit")}


# ------------------------------------------------------------------------------------ the CPU kernels when compiled
def captured_graphs():
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    return graphs, backend


def call_targets(graph_module) -> list:
    return [node.target for node in graph_module.graph.nodes if node.op == "call_function"]


def test_cpu_dropout_uses_the_half_draw_mask_eagerly_and_F_dropout_when_compiled():
    x = torch.randn(6, 10)
    torch.manual_seed(3)
    eager = cpu_kernels.dropout(x, 0.3, True)
    torch.manual_seed(3)
    assert torch.equal(eager, x * cpu_kernels.scaled_keep_mask(x, 0.7))
    graphs, backend = captured_graphs()
    compiled = torch.compile(lambda t: cpu_kernels.dropout(t, 0.3, True), fullgraph=True, backend=backend)
    out = compiled(x)
    assert call_targets(graphs[0]) == [torch.nn.functional.dropout]
    kept = out != 0
    torch.testing.assert_close(out[kept], x[kept] / 0.7)


@pytest.mark.skipif(not cpu_kernels.PREPACK_INFERENCE_WEIGHTS, reason="no oneDNN packed linear in this torch build")
def test_prepacked_weights_step_aside_when_compiled():
    """Eager inference packs a d=512 weight for a decoding step's few rows; compiled, the product is a plain
    `F.linear` the compiler lays out itself, and nothing is packed."""
    torch.manual_seed(0)
    layer, x = nn.Linear(512, 512), torch.randn(4, 512)
    with torch.no_grad():
        graphs, backend = captured_graphs()
        product = torch.compile(
            lambda t: cpu_kernels.linear(layer, t, layer.weight, layer.bias), fullgraph=True, backend=backend
        )
        out = product(x)
        assert call_targets(graphs[0]) == [torch.nn.functional.linear]
        assert layer not in cpu_kernels._PACKED_WEIGHTS
        eager = cpu_kernels.linear(layer, x, layer.weight, layer.bias)
        assert layer in cpu_kernels._PACKED_WEIGHTS  # the eager call did take the packed path
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-5)


def test_fused_loss_is_traced_into_the_compiled_graph_and_equals_eager():
    """`_TokenLossTerms` (the forward's exp buffer turned into the gradient in place) is traced whole, as one
    autograd-function node, not replaced: loss and gradient equal eager, a second backward too."""
    torch.manual_seed(0)
    logits = torch.randn(12, 37, requires_grad=True)
    labels = torch.randint(0, 37, (12,))
    labels[[2, 7]] = -100

    def loss_fn(z, y):
        return label_smoothed_nll_loss(z, y, 0.1)[0]

    graphs, capture = captured_graphs()
    torch.compile(loss_fn, fullgraph=True, backend=capture)(logits, labels)
    assert "autograd_function_apply" in [getattr(t, "__name__", str(t)) for t in call_targets(graphs[0])]

    eager = loss_fn(logits, labels)
    (eager_gradient,) = torch.autograd.grad(eager, logits)
    compiled = torch.compile(loss_fn, fullgraph=True, backend=BACKEND)(logits, labels)
    first = torch.autograd.grad(compiled, logits, retain_graph=True)[0]
    second = torch.autograd.grad(compiled, logits)[0]
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-6)
    torch.testing.assert_close(first, eager_gradient, rtol=0, atol=1e-6)
    torch.testing.assert_close(second, eager_gradient, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- flexformers-train --torch_compile
#: Graphs compiled for a training run whose batches come in several padded shapes: one for the first batch's shapes
#: (static), then one with dynamic batch and length dimensions (torch.compile's automatic dynamic shapes) that serves
#: every later shape.
GRAPHS_PER_RUN = 2


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_train_with_torch_compile_for_every_model_type(model_type, tmp_path, monkeypatch):
    """`flexformers-train --torch_compile true` (backend aot_eager here) trains, saves a loadable model, compiles the
    step without graph breaks, and recompiles at most once over batches of several padded lengths (the collators
    pad lengths to multiples of 8)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("FLEXFORMERS_CACHE", str(tmp_path / "cache"))
    argv = tiny_argv(tmp_path / "out", "--max_steps", "6", "--torch_compile", "true",
                     "--torch_compile_backend", BACKEND, "--logging_steps", "2")
    argv[argv.index("--model_type") + 1] = model_type
    spec, *arguments = train.parse_arguments(argv)
    shapes = set()

    def recording_collator(tokenizer, model, method_args):
        collate = spec.make_data_collator(tokenizer, model, method_args)

        def collate_and_record(features):
            batch = collate(features)
            shapes.add(tuple(batch["input_ids"].shape) + tuple(batch["labels"].shape))
            return batch

        return collate_and_record

    recording = dataclasses.replace(spec, data_collator=recording_collator)
    counters = torch._dynamo.utils.counters
    counters.clear()
    train.run(recording, *arguments)

    assert len(shapes) >= 3, shapes
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == GRAPHS_PER_RUN
    history = json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
    losses = [entry["loss"] for entry in history if "loss" in entry]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    if model_type == "iot":  # the order statistics accumulated inside the compiled step reach the log lines
        assert all("iot/diversity_loss" in entry for entry in history if "loss" in entry)
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert not any(name.startswith("_orig_mod") for name in saved)  # the model's own names, not the wrapper's
    spec.model_class.from_pretrained(tmp_path / "out")
