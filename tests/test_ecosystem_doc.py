"""docs/ecosystem.md runs as written: its Python snippets, in order, in one fresh interpreter (as a reader pastes
them), in an empty folder, offline. Each snippet prints what it shows; the test checks those lines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "ecosystem.md"


def python_snippets(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_the_page_has_a_snippet_per_workflow():
    snippets = python_snippets(PAGE.read_text(encoding="utf-8"))
    joined = "\n".join(snippets)
    for workflow in ("Seq2SeqTrainer(", "get_peft_model(", "quantize_dynamic(", "compute_transition_scores(",
                     "streamer=", "stopping_criteria=", "output_attentions=True", "torch.export.export("):
        assert workflow in joined, workflow


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["iot", "depth_adaptive"])
def test_the_ecosystem_page_runs_as_written(tmp_path, model_type):
    """As written (IOT), and with the page's one line naming the type changed ("works the same for ...")."""
    pytest.importorskip("peft")
    script = "\n\n".join(python_snippets(PAGE.read_text(encoding="utf-8")))
    assert 'MODEL_TYPE = "iot"' in script
    script = script.replace('MODEL_TYPE = "iot"', f"MODEL_TYPE = {model_type!r}")
    environment = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                       TOKENIZERS_PARALLELISM="false")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=environment, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    printed = result.stdout
    model_class = {"iot": "IOTForConditionalGeneration", "depth_adaptive": "DepthAdaptiveForConditionalGeneration"}
    assert f"saved {model_class[model_type]}" in printed
    assert re.search(r"^eval_loss \d+\.\d+$", printed, flags=re.M)
    assert f"merged and reloaded {model_class[model_type]}" in printed
    int8 = int(re.search(r"^int8 projections (\d+)$", printed, flags=re.M).group(1))
    # encoder blocks: q, k, v, out, fc1, fc2; decoder blocks: and cross-attention's 4; lm_head, and Depth-Adaptive's
    # exit classifier below the top block
    assert int8 == 2 * (4 + 2) + 2 * (8 + 2) + 1 + (model_type == "depth_adaptive")
    assert re.search(r"^sequences \(2, \d+\) transition scores \(2, \d+\)$", printed, flags=re.M)
    assert "stopped at length 3" in printed
    assert "2 encoder attention maps, 3 decoder hidden states" in printed
    assert "export matches eager: True" in printed
