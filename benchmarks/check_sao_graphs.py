"""Does the SAO search replayed as CUDA graphs (`model.sao_search_cuda_graphs`) find what the eager search finds?

At paper size (vocabulary 10152, batch 32 × 30, B = 8) on a GPU:
- without dropout (`sao_search_dropout = False`) the graph's orders equal the eager search's and its scores agree
  (a shape's first call runs eagerly, the second captures);
- after an optimizer step (parameters updated in place) the replayed graph still equals the eager search;
- with dropout two replays draw different noise, and every returned order is a permutation of its sentence;
- a training step with searched orders runs on the graph and gives a finite loss.

    python benchmarks/check_sao_graphs.py --device cuda
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flexformers.configuration.configuration_indigo import InDIGOConfig  # noqa: E402
from flexformers.modeling.indigo_search_state import _CAPTURED_SEARCHES  # noqa: E402
from flexformers.modeling.modeling_indigo import InDIGOForConditionalGeneration  # noqa: E402
from flexformers.training_scripts.indigo_orders import InDIGODataCollator  # noqa: E402

from bench_indigo import VOCAB, make_batch  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":
        raise SystemExit("check_sao_graphs.py needs a CUDA device (--device cuda): CUDA graphs exist only there")
    torch.manual_seed(0)
    config = InDIGOConfig.from_preset("transformer_iwslt_de_en", vocab_size=VOCAB, label_smoothing=0.1)
    model = InDIGOForConditionalGeneration(config).to(device)
    source, target = make_batch(args.batch, 30)
    features = [{"input_ids": s.tolist(), "labels": t.tolist()} for s, t in zip(source, target)]
    batch = {k: v.to(device) for k, v in InDIGODataCollator(order="sao", pad_to_multiple_of=None)(features).items()}
    mask = batch["attention_mask"]
    failures = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
        if not ok:
            failures.append(name)

    def encode():  # once per comparison: the encoder runs in train mode here (its dropout differs per call)
        with torch.no_grad():
            return model.model.encoder(batch["input_ids"], attention_mask=mask).last_hidden_state

    def search(graphs: bool, encoder: torch.Tensor):
        model.sao_search_cuda_graphs = graphs
        return model.search_adaptive_orders(encoder, mask, batch["target_ids"], batch["target_lengths"], beam_size=8)

    model.train()
    model.sao_search_dropout = False  # the search runs in eval mode: no noise, so graph and eager must agree
    encoder = encode()
    eager = search(False, encoder)
    search(True, encoder)  # a shape's first call runs eagerly; the second captures the graph and replays it
    graphed, graphed_again = search(True, encoder), search(True, encoder)
    finite = torch.isfinite(eager[1])
    check("no dropout: graph orders equal eager orders", torch.equal(eager[0], graphed[0]))
    check("no dropout: replay equals the first graph call", torch.equal(graphed[0], graphed_again[0]))
    difference = (eager[1][finite] - graphed[1][finite]).abs().max().item()
    check("no dropout: scores agree", difference < 1e-3, f"(max |Δ| {difference:.2e})")
    check("one graph captured", len(_CAPTURED_SEARCHES[model]) == 1)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model.use_searched_orders, model.sao_beam_size = True, 8
    model.sao_search_cuda_graphs = True
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    check("a training step on the graph gives a finite loss", bool(torch.isfinite(loss)), f"(loss {loss.item():.3f})")
    encoder = encode()
    eager, graphed = search(False, encoder), search(True, encoder)
    check("after an optimizer step: graph orders equal eager orders", torch.equal(eager[0], graphed[0]))
    check("still one graph (parameters updated in place)", len(_CAPTURED_SEARCHES[model]) == 1)

    model.sao_search_dropout = True  # the paper's noise (train mode: a new shape key, so seen once, then captured)
    encoder = encode()
    search(True, encoder)
    first, second = search(True, encoder), search(True, encoder)
    check("dropout: a second graph (train mode)", len(_CAPTURED_SEARCHES[model]) == 2)
    check("dropout: two replays draw different noise", not torch.equal(first[1], second[1]))
    lengths = batch["target_lengths"].tolist()
    permutations = all(
        sorted(first[0][row, beam, : lengths[row]].tolist()) == list(range(lengths[row]))
        for row in range(first[0].shape[0])
        for beam in range(first[0].shape[1])
        if torch.isfinite(first[1][row, beam])
    )
    check("dropout: every returned order is a permutation of its sentence", permutations)
    print(f"{len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
