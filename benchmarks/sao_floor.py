"""How fast could an SAO training step be on this machine? A lower bound from measured kernel costs.

`bench_indigo.py` times InDIGO's SAO step (beam 8 over the permutations of each reference, then training on the
best order) against the L2R step. This script asks what the SAO step would cost if the search ran nothing but
the kernels that *any* exact beam search over the 256 hypotheses (32 sentences × 8 beams) must run, at the shapes
the search runs them — no module code, no seams, no bookkeeping, no Python between the kernels beyond the call
itself. Per search (`transformer_iwslt_de_en` dims, vocabulary 10152, T = 30: the start `<s> </s>` decoded once
per sentence, then 30 cached decoder calls at 256 rows and 31 scorings):

- **weight products**: per decoder call and layer self-attention q/k/v (one fused product) and out,
  cross-attention q and out, fc1, fc2, and the new pointer keys ``H C``, ``H D``; per scoring the word query
  ``h F`` and the 10152-way vocabulary projection (Eq. 8) and the pointer query ``h E`` (Eq. 9). Each at the faster
  of `F.linear` and the packed oneDNN product for its shape. The source keys/values of the cross-attention are
  timed but left out: the training forward projects the same encoder states, so an implementation could share
  them. (`tests/test_benchmarks.py` checks that these products do exactly the real search's multiply-adds.);
- **attention**: the self-attention over the cached keys with Eq. 7's three relation logits per head, and the
  cross-attention with each sentence's 8 beam queries folded over its one copy of the source;
- **cache traffic**: writing the new keys/values, and the beam reorder of every layer's cache and of the pointer
  keys and word parts (gathered into spare buffers, filled part only);
- **elementwise**: the paper's dropout noise (19 masks per call, the backbone's fast mask), residual adds, layer
  norms, ReLU, the embedding lookup;
- **scoring**: Eq. 9's word part of each new key, Eq. 8's normaliser over the vocabulary, Eq. 9/11 over the kept
  pointer keys, the top-k.

Each group is timed alone over a whole search's worth of calls (fastest of several repetitions: a floor wants the
machine's best), and the floor of the SAO step is the L2R training step (the best-order step trains exactly the
L2R step's work, on another order) plus the search's kernel floor. Timed beside it in the same run: the real
training steps in `bench_indigo.py`'s rounds (baseline, L2R, Eq. 12 over all 8 orders, best order) and the
search, plus the encoder alone (`bench_indigo.py`'s search timing encodes first; the SAO step's search does not).
The Eq. 12 step matters beyond its own number: its allocations leave the process's heap large enough that no later
step page-faults (glibc then serves every tensor from memory it already has), so the steps run in the same
fault-free state as in `bench_indigo.py`; without it (`--skip-eq12`) an L2R step took 40k–190k minor page faults.
The median minor page faults per call are printed too.

    flock -x /tmp/flexformers-cpu.lock python benchmarks/sao_floor.py [--repeats 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_indigo as bench  # noqa: E402
from timing import fastest, interleaved  # noqa: E402

from flexformers.modeling import cpu_kernels as backbone  # noqa: E402
from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration  # noqa: E402
from flexformers.modeling.modeling_indigo import InDIGOForConditionalGeneration  # noqa: E402


def best_product(weight: torch.Tensor, bias: torch.Tensor | None, rows: int):
    """The faster of `F.linear` and the packed oneDNN product for `rows` rows of this weight, as a callable."""
    inputs = torch.randn(rows, weight.shape[1])
    candidates = {"plain": lambda x: F.linear(x, weight, bias)}
    packed = backbone._pack(weight, rows) if backbone.PREPACK_INFERENCE_WEIGHTS else None
    if packed is not None:
        candidates["packed"] = lambda x: backbone._LINEAR_POINTWISE(x, packed, bias, "none", [], "")
    timings = {name: fastest(lambda fn=fn: fn(inputs), repeats=5, calls=20) for name, fn in candidates.items()}
    return candidates[min(timings, key=timings.get)]


class SearchKernels:
    """The kernel groups of one SAO search at the benchmark's shapes, each runnable alone."""

    def __init__(self, model: InDIGOForConditionalGeneration, batch: int, length: int, beams: int):
        config = model.config
        self.model = model
        self.batch, self.length, self.beams = batch, length, beams
        self.rows = rows = batch * beams
        self.dim = dim = config.decoder_embed_dim
        self.heads = config.decoder_attention_heads
        self.head_dim = dim // self.heads
        self.layers = config.decoder_layers
        self.dropout = config.dropout
        self.capacity = length + 2
        decoder = model.get_decoder()
        call_products = []  # (weight, bias) of every product of one decoder call and its new pointer keys
        for layer in decoder.layers:
            attention, cross = layer.self_attn, layer.encoder_attn
            qkv_weight = torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight])
            qkv_bias = torch.cat([attention.q_proj.bias, attention.k_proj.bias, attention.v_proj.bias])
            call_products += [(qkv_weight, qkv_bias), (attention.out_proj.weight, attention.out_proj.bias),
                              (cross.q_proj.weight, cross.q_proj.bias), (cross.out_proj.weight, cross.out_proj.bias),
                              (layer.ffn.fc1.weight, layer.ffn.fc1.bias), (layer.ffn.fc2.weight, layer.ffn.fc2.bias)]
        call_products.append((torch.cat([model.pointer_left_proj.weight, model.pointer_right_proj.weight]), None))
        # scoring a hypothesis: Eq. 8's word query h F (when the model has F) and vocabulary, Eq. 9's h E
        word_products = [(model.lm_head.weight, None)]
        if model.word_query_proj is not None:
            word_products.insert(0, (model.word_query_proj.weight, None))
        source_kv = torch.cat([torch.cat([layer.encoder_attn.k_proj.weight, layer.encoder_attn.v_proj.weight])
                               for layer in decoder.layers])

        def priced(products, count):
            """Each (weight, bias) as (fastest product for `count` rows, an input); a merge projection of the
            earlier layout kept a `[branches, out]` bias: one branch here."""
            return [(best_product(w.detach(), None if b is None else b.detach().reshape(-1), count),
                     torch.randn(count, w.shape[1])) for w, b in products]

        with torch.no_grad():
            self.start_products = priced(call_products, 2 * batch)  # <s> </s>, once per sentence
            self.call_products = priced(call_products, rows)
            self.word_products = priced(word_products, rows)
            self.pointer_query_product = priced([(model.pointer_query_proj.weight, None)], rows)
            self.source_kv = priced([(source_kv, None)], batch * length)
        self.hidden = torch.randn(rows, dim)
        self.source_hidden = torch.randn(batch * length, dim)
        shape = (rows, self.heads, self.capacity, self.head_dim)
        self.keys = [torch.randn(shape) for _ in range(self.layers)]
        self.values = [torch.randn(shape) for _ in range(self.layers)]
        self.spare_keys, self.spare_values = torch.empty(shape), torch.empty(shape)
        self.pointer_keys = torch.randn(rows, 2, self.capacity, dim)
        self.pointer_words = torch.randn(rows, 2, self.capacity, length)
        self.spare_pointer_keys = torch.empty_like(self.pointer_keys)
        self.spare_pointer_words = torch.empty_like(self.pointer_words)
        self.source_keys = torch.randn(batch, self.heads, length, self.head_dim)
        self.source_values = torch.randn(batch, self.heads, length, self.head_dim)
        self.relations = torch.randint(-1, 2, (rows, 1, self.capacity))
        self.relation_keys = torch.randn(3, self.heads, self.head_dim)
        generator = torch.Generator().manual_seed(0)
        # beams move within their sentence: each new beam's parent is one of its sentence's 8 rows
        self.origin = (torch.randint(0, beams, (rows,), generator=generator)
                       + torch.arange(batch).repeat_interleave(beams) * beams)
        self.norm_weight, self.norm_bias = torch.ones(dim), torch.zeros(dim)
        self.embedding = decoder.embed_tokens.weight.detach()
        self.tokens = torch.randint(5, self.embedding.shape[0], (rows, 1))
        self.targets = torch.randint(5, self.embedding.shape[0], (rows, length))
        self.anchors = torch.randint(0, 2, (rows, length))

    def key_counts(self):
        """Keys the self-attention sees at each of the 30 cached decoder calls (after `<s> </s>`)."""
        return range(3, self.length + 3)

    def source_key_values(self):
        """The cross-attention keys/values of the source, once per search. Not part of the floor: an implementation
        could share them with the training forward (which projects the same encoder states again)."""
        with torch.no_grad():
            for product, inputs in self.source_kv:
                product(inputs)

    def products(self):
        """The search's weight products: the start call, 30 decoder calls, 31 word scorings, 30 pointer queries."""
        with torch.no_grad():
            for product, inputs in self.start_products:
                product(inputs)
            for _ in self.key_counts():
                for product, inputs in self.call_products:
                    product(inputs)
            for step in range(self.length + 1):
                for product, inputs in self.word_products:
                    product(inputs)
                if step < self.length:
                    for product, inputs in self.pointer_query_product:
                        product(inputs)

    def attention(self):
        rows, heads, head_dim, beams = self.rows, self.heads, self.head_dim, self.beams
        query = torch.randn(rows, heads, 1, head_dim)  # already scaled by 1/√head_dim
        with torch.no_grad():
            for n in self.key_counts():
                for layer in range(self.layers):
                    keys, values = self.keys[layer][:, :, :n], self.values[layer][:, :, :n]
                    relation_logits = torch.einsum("bhqd,rhd->bhqr", query, self.relation_keys)
                    index = (self.relations[:, :, :n] + 1).unsqueeze(1).expand(rows, heads, 1, n)
                    scores = torch.matmul(query, keys.transpose(-1, -2)).add_(relation_logits.gather(-1, index))
                    torch.matmul(scores.softmax(-1), values)
                    folded = query.view(self.batch, beams, heads, head_dim).transpose(1, 2)  # [b, h, beams, hd]
                    cross = torch.matmul(folded, self.source_keys.transpose(-1, -2))
                    torch.matmul(cross.softmax(-1), self.source_values)

    def cache_traffic(self):
        rows, heads, head_dim = self.rows, self.heads, self.head_dim
        new = torch.randn(rows, heads, 1, head_dim)
        new_pointer = torch.randn(rows, 2, 1, self.dim)
        with torch.no_grad():
            for n in self.key_counts():
                filled = slice(0, n - 1)
                for layer in range(self.layers):
                    for buffers, spare in ((self.keys, self.spare_keys), (self.values, self.spare_values)):
                        torch.index_select(buffers[layer][:, :, filled], 0, self.origin, out=spare[:, :, filled])
                    self.keys[layer][:, :, n - 1 : n] = new
                    self.values[layer][:, :, n - 1 : n] = new
                torch.index_select(self.pointer_keys[:, :, filled], 0, self.origin,
                                   out=self.spare_pointer_keys[:, :, filled])
                torch.index_select(self.pointer_words[:, :, filled], 0, self.origin,
                                   out=self.spare_pointer_words[:, :, filled])
                self.pointer_keys[:, :, n - 1 : n] = new_pointer

    def elementwise(self):
        hidden, dim, keep = self.hidden, self.dim, 1.0 - self.dropout
        wide = torch.randn(self.rows, self.model.config.decoder_ffn_embed_dim)
        with torch.no_grad():
            for _ in self.key_counts():
                x = F.embedding(self.tokens, self.embedding).mul_(dim ** 0.5)
                x = x * backbone.scaled_keep_mask(x, keep)
                for _ in range(self.layers):
                    for _ in range(3):  # after self-attention, cross-attention, feed-forward
                        out = hidden * backbone.scaled_keep_mask(hidden, keep)
                        F.layer_norm(out + hidden, (dim,), self.norm_weight, self.norm_bias)
                    F.relu(wide)

    def scoring(self):
        rows, length = self.rows, self.length
        query = torch.randn(rows, self.dim)
        logits = torch.randn(rows, self.embedding.shape[0])
        new_keys = torch.randn(self.batch, self.beams * 2, self.dim)  # a sentence's beams' new left/right keys
        start_keys = torch.randn(self.batch, self.beams * 4, self.dim)  # ... of <s> and </s>
        references = torch.randn(self.batch, self.dim, length)
        with torch.no_grad():
            # Eq. 9's word part W[y_m]·k of each new key, kept per key (ReferencePointerCache)
            self.pointer_words[:, :, :2] = torch.bmm(start_keys, references).view(rows, 2, 2, length)
            for n in self.key_counts():
                self.pointer_words[:, :, n - 1 : n] = torch.bmm(new_keys, references).view(rows, 2, 1, length)
            for step in range(length + 1):
                shifted = logits - logits.amax(-1, keepdim=True)
                words = shifted.gather(1, self.targets)
                normaliser = shifted.exp_().sum(-1).log_()
                words - normaliser[:, None]
                if step == length:
                    break
                n = step + 2
                expanded = query[:, None, :, None].expand(-1, 2, -1, -1)
                state_part = torch.matmul(self.pointer_keys[:, :, :n], expanded)
                slots = (self.pointer_words[:, :, :n] + state_part).view(rows, 2 * n, length)
                right_of_left = slots.gather(1, (self.anchors + n).unsqueeze(1))
                left_of_right = slots.gather(1, self.anchors.unsqueeze(1))
                torch.logaddexp(right_of_left, left_of_right).squeeze(1) - slots.logsumexp(1)
                torch.randn(self.batch, self.beams * length).topk(self.beams, dim=-1)


def counting_page_faults(fn, counts: list[int]):
    """`fn`, appending the process's minor page faults during each call to `counts`."""

    def run():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        fn()
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    return run


def encoder_fn(model, batch: dict):
    """The encoder forward that `bench_indigo.search_fn` runs before its search (train mode, no gradients)."""

    def run():
        model.train()
        with torch.no_grad():
            model.model.encoder(batch["input_ids"], attention_mask=batch["attention_mask"])

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the real steps (median)")
    parser.add_argument("--kernel-repeats", type=int, default=5, help="repetitions per kernel group (fastest)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=30)
    parser.add_argument("--sao-beam", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-eq12", action="store_true",
                        help="leave the Eq. 12 step out of the rounds (its heap then no longer covers the others)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    baseline_config, config = bench.paper_configs()
    source, target = bench.make_batch(args.batch, args.length)
    l2r_batch, sao_batch = bench.insertion_batches(source, target)
    l2r_model = InDIGOForConditionalGeneration(config)
    best_model = InDIGOForConditionalGeneration(config)
    best_model.use_searched_orders, best_model.sao_beam_size, best_model.sao_train_orders = True, args.sao_beam, 1
    all_orders_model = InDIGOForConditionalGeneration(config)
    all_orders_model.use_searched_orders, all_orders_model.sao_beam_size = True, args.sao_beam
    baseline = FlexformerForConditionalGeneration(baseline_config)
    # bench_indigo.py's rounds (baseline, L2R, Eq. 12, best order, search), and the encoder alone
    tasks = {
        "baseline_step": bench.train_fn(baseline, {"input_ids": source, "labels": target}, "fp32"),
        "l2r_step": bench.train_fn(l2r_model, l2r_batch, "fp32"),
        "eq12_all_orders_step": bench.train_fn(all_orders_model, sao_batch, "fp32"),
        "best_order_step": bench.train_fn(best_model, sao_batch, "fp32"),
        "search": bench.search_fn(best_model, sao_batch, args.sao_beam, "fp32"),
        "encoder": encoder_fn(best_model, sao_batch),
    }
    if args.skip_eq12:
        del tasks["eq12_all_orders_step"]
    faults = {name: [] for name in tasks}
    real = interleaved({name: counting_page_faults(fn, faults[name]) for name, fn in tasks.items()}, args.repeats)
    kernels = SearchKernels(InDIGOForConditionalGeneration(config).train(), args.batch, args.length, args.sao_beam)
    groups = {name: fastest(getattr(kernels, name), args.kernel_repeats)
              for name in ("products", "attention", "cache_traffic", "elementwise", "scoring")}
    floor_search = sum(groups.values())
    shareable = fastest(kernels.source_key_values, args.kernel_repeats)
    results = {
        "threads": args.threads, "batch": args.batch, "length": args.length, "sao_beam": args.sao_beam,
        "real_s": real,
        "real_minor_page_faults_median": {name: statistics.median(counts) for name, counts in faults.items()},
        "real_best_order_ratio": real["best_order_step"] / real["l2r_step"],
        "kernel_floor_s": groups,
        "kernel_floor_search_s": floor_search,
        "not_in_floor_source_key_values_s": shareable,
        "products_only_ratio": (real["l2r_step"] + groups["products"]) / real["l2r_step"],
        "floor_best_order_ratio": (real["l2r_step"] + floor_search) / real["l2r_step"],
        # bench_indigo's search timing encodes the batch first; the SAO step's search reuses the training encoder's
        "real_search_over_floor": (real["search"] - real["encoder"]) / floor_search,
    }
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
