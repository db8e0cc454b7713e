"""Pipeline multi-process training: 2 CPU processes (gloo) through torchrun end with identical weights on both
ranks; the shipped accelerate configs (multi-GPU DDP, FSDP) are valid. (``accelerate launch`` starts several CPU
processes only through mpirun, so CPU multi-process runs use torchrun.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_training import tiny_argv

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "training_scripts" / "accelerate_configs"

RANK_SCRIPT = '''
import hashlib, json, os, sys
import torch
from transformers import TrainerCallback
from flexformers.training_scripts import train


class Fingerprint(TrainerCallback):
    def on_train_end(self, args, state, control, model=None, **kwargs):
        digest = hashlib.sha256()
        for name, tensor in sorted(model.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        record = {"rank": int(os.environ["RANK"]), "world": torch.distributed.get_world_size(),
                  "steps": state.global_step, "sha": digest.hexdigest()}
        with open(os.path.join(os.environ["FINGERPRINT_DIR"], f"rank{record['rank']}.json"), "w") as handle:
            json.dump(record, handle)


train.run(*train.parse_arguments(sys.argv[1:]), extra_callbacks=[Fingerprint()])
'''


def _launch(tmp_path, launcher: list[str], name: str):
    script = tmp_path / "rank_script.py"
    script.write_text(RANK_SCRIPT)
    fingerprints = tmp_path / f"fp-{name}"
    fingerprints.mkdir()
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        FLEXFORMERS_CACHE=str(tmp_path / "cache"),
        FINGERPRINT_DIR=str(fingerprints),
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    argv = tiny_argv(tmp_path / f"out-{name}", "--max_steps", "4", "--ddp_backend", "gloo")
    completed = subprocess.run(
        [*launcher, str(script), *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-5000:]
    records = [json.loads((fingerprints / f"rank{r}.json").read_text()) for r in (0, 1)]
    return records


@pytest.mark.slow
def test_torchrun_two_cpu_processes_end_with_identical_weights(tmp_path):
    records = _launch(tmp_path, [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533"], "torchrun")
    assert [r["world"] for r in records] == [2, 2] and [r["steps"] for r in records] == [4, 4]
    assert records[0]["sha"] == records[1]["sha"]
    assert (tmp_path / "out-torchrun" / "model.safetensors").is_file()


@pytest.mark.parametrize("name", ["multi_gpu_ddp.yaml", "fsdp.yaml"])
def test_accelerate_configs_are_valid(name):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType

    config = ClusterConfig.from_yaml_file(str(CONFIGS / name))
    assert DistributedType(config.distributed_type) in (DistributedType.MULTI_GPU, DistributedType.FSDP)
    if name == "fsdp.yaml":
        import flexformers.modeling.modeling_flexformer as backbone

        for layer in config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"].split(","):
            assert hasattr(backbone, layer), layer
