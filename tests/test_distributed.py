"""Pipeline multi-process training: 2 CPU processes (gloo) through torchrun end with identical weights on both
ranks; the shipped accelerate configs (multi-GPU DDP, FSDP) are valid. (``accelerate launch`` starts several CPU
processes only through mpirun, so CPU multi-process runs use torchrun.)

FSDP on the CPU: accelerate (1.15) turns FSDP on only for accelerator devices (its ``AcceleratorState`` picks
``DistributedType.FSDP`` for MULTI_GPU/NPU/XPU/..., never MULTI_CPU), so ``--fsdp`` through Trainer would run plain
DDP on CPU processes; ``flexformers-train`` refuses it there. What the FSDP config does to a model — FSDP2
(``fully_shard``) units chosen by accelerate's own wrap policy from the shipped ``fsdp.yaml``, parameters sharded
across the ranks, a full state dict gathered for the checkpoint — is tested with 2 CPU processes directly below."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_conformance import MODEL_TYPES, tiny_model
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


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_the_fsdp_config_makes_every_encoder_and_decoder_block_a_shard_unit(model_type):
    """accelerate's own wrap policy, from the shipped fsdp.yaml, on each model type (it used to name
    FlexformerDecoderLayer, which IOT does not contain: accelerate refused IOT)."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    model = tiny_model(model_type)
    policy = fsdp2_prepare_auto_wrap_policy(fsdp_plugin_from_config(), model)
    units = [name for name, module in model.named_modules() if policy(module)]
    assert units == [f"model.{side}.layers.{i}" for side in ("encoder", "decoder") for i in range(2)]


def test_fsdp_on_the_cpu_is_refused_not_silently_ddp():
    """accelerate runs CPU processes with DDP whatever --fsdp says (every process would hold the whole model)."""
    from flexformers.training_scripts import train

    with pytest.raises(ValueError, match="--fsdp needs GPUs"):
        train.parse_arguments(tiny_argv("unused", "--fsdp", "full_shard"))


# ------------------------------------------------------------------------------------------------------ FSDP2
FSDP_STEPS = 3
FSDP_GLOBAL_ROWS = 8


def fsdp_plugin_from_config():
    """accelerate's FSDP plugin with the settings of the shipped fsdp.yaml (as ``accelerate launch`` passes them)."""
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.commands.config.config_args import ClusterConfig

    settings = ClusterConfig.from_yaml_file(str(CONFIGS / "fsdp.yaml")).fsdp_config
    return FullyShardedDataParallelPlugin(
        fsdp_version=settings["fsdp_version"],
        auto_wrap_policy=settings["fsdp_auto_wrap_policy"],
        transformer_cls_names_to_wrap=settings.get("fsdp_transformer_layer_cls_to_wrap"),
        reshard_after_forward=settings["fsdp_reshard_after_forward"],
        state_dict_type=settings["fsdp_state_dict_type"],
        cpu_ram_efficient_loading=settings["fsdp_cpu_ram_efficient_loading"],
        cpu_offload=settings["fsdp_offload_params"],
    )


@contextlib.contextmanager
def without_gumbel_noise():
    """IOT's Gumbel noise comes from each process's own generator, so two processes of 4 rows cannot draw what one
    process of 8 draws: the comparison runs the predictors noise-free (g = 0; everything else of Eq. 1-7 as is)."""
    from flexformers.modeling import iot_equations

    original = iot_equations.sample_gumbel
    iot_equations.sample_gumbel = lambda shape, device, generator=None: torch.zeros(shape, device=device)
    try:
        yield
    finally:
        iot_equations.sample_gumbel = original


def fsdp_global_batches(model_type: str) -> list[dict]:
    """FSDP_STEPS global batches of FSDP_GLOBAL_ROWS sentence pairs of different lengths, padded as the training
    collators pad them (InDIGO: its own collator, left-to-right insertions)."""
    from flexformers.training_scripts.indigo_orders import InDIGODataCollator

    batches = []
    for step in range(FSDP_STEPS):
        generator = torch.Generator().manual_seed(100 + step)

        def sentence(low, high):
            length = int(torch.randint(low, high, (1,), generator=generator))
            return torch.randint(5, 60, (length,), generator=generator).tolist() + [2]

        pairs = [(sentence(3, 9), sentence(2, 8)) for _ in range(FSDP_GLOBAL_ROWS)]
        if model_type == "indigo":
            batches.append(InDIGODataCollator(order="l2r")([{"input_ids": s, "labels": t} for s, t in pairs]))
            continue
        width = max(len(s) for s, _ in pairs), max(len(t) for _, t in pairs)
        input_ids = torch.tensor([s + [1] * (width[0] - len(s)) for s, _ in pairs])
        labels = torch.tensor([t + [-100] * (width[1] - len(t)) for _, t in pairs])
        batches.append({"input_ids": input_ids, "attention_mask": input_ids.ne(1).long(), "labels": labels})
    return batches


#: What a step of two processes cannot compute like one process, set aside for the comparison: randomness (dropout
#: is 0 in the tiny configs; MAT's drop-branch) and IOT's L_D and L_S (Eq. 5-6), which are statistics of each
#: process's own batch (the mean order distribution, the mean sharpness), as in the official code's data-parallel
#: training: two batches of 4 sentences do not have the statistics of one of 8.
FSDP_DETERMINISTIC = {
    "mat": {"drop_branch_rate": 0.0},
    "iot": {"diversity_loss_coef": 0.0, "sharpness_loss_coef": 0.0},
}


def fsdp_case(model_type: str):
    """A tiny model whose training step is the same function of a batch in one process or split over two, and its
    global batches."""
    return tiny_model(model_type, **FSDP_DETERMINISTIC.get(model_type, {})).train(), fsdp_global_batches(model_type)


def train_steps(model, batches, rank: int = 0, world: int = 1) -> list[float]:
    """Plain SGD, each process taking its share of every global batch. The loss is summed over the process's tokens
    and divided by the global batch's (Trainer's ``num_items_in_batch``), times the world size because FSDP averages
    the gradients over processes, as Trainer does. (SGD, not Adam, for the comparison: Adam divides each gradient
    element by its own magnitude, so elements whose exact gradient is 0 — the key-projection biases, a per-query
    constant softmax ignores — turn summation-order noise of 1e-9 into ±lr updates in either run.)"""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for batch in batches:
        share = batch["input_ids"].shape[0] // world
        local = {name: value[rank * share : (rank + 1) * share] for name, value in batch.items()}
        loss = model(**local, num_items_in_batch=batch["labels"].ne(-100).sum()).loss * world
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


FSDP_RANK_SCRIPT = '''
import json, os, sys
import torch.distributed as dist
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from tests.test_distributed import fsdp_case, fsdp_plugin_from_config, train_steps, without_gumbel_noise

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
plugin = fsdp_plugin_from_config()
output_dir = sys.argv[1]
record = {}
with without_gumbel_noise():
    for model_type in sys.argv[2:]:
        model, batches = fsdp_case(model_type)
        # accelerate's fsdp2_prepare_model: the policy's modules innermost first, then the root
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
        units = [name for name, module in model.named_modules() if policy(module)]
        for name in reversed(units):
            fully_shard(model.get_submodule(name), mesh=mesh, reshard_after_forward=plugin.reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=plugin.reshard_after_forward)
        parameters = list(model.parameters())
        record[model_type] = {
            "units": units,
            "sharded": all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in parameters),
            "local": sum(p.to_local().numel() for p in parameters),
            "total": sum(p.numel() for p in parameters),
            "losses": train_steps(model, batches, rank, world),
        }
        # FULL_STATE_DICT, as accelerate's get_state_dict gathers it for Trainer's save_model
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            model.save_pretrained(os.path.join(output_dir, model_type), state_dict=state)
        dist.barrier()
with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as handle:
    json.dump(record, handle)
dist.destroy_process_group()
# Everything this process had to do is written. Skipping the interpreter's teardown avoids a rare abort there
# ("terminate called without an active exception", SIGABRT, seen once in CI after all checkpoints were written):
# a C++ thread still joinable when static objects are destroyed, which no part of the test exercises.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
'''


@pytest.mark.slow
def test_fsdp2_two_cpu_processes_train_like_one_and_save_a_loadable_checkpoint(tmp_path):
    """Every model type, sharded with FSDP2 by the shipped fsdp.yaml's settings over 2 CPU processes (gloo):
    parameters are sharded (each process holds about half), each step's loss is one process's on the same global
    batch, 3 updates on global batches of 8 end with one process's weights (within 1e-5), and the gathered
    full-state-dict checkpoint loads with ``from_pretrained`` in one process. (fp32: the config's bf16 mixed precision
    is a GPU setting.)"""
    script = tmp_path / "fsdp_rank.py"
    script.write_text(FSDP_RANK_SCRIPT)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    model_types = list(MODEL_TYPES)
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29535", str(script),
         str(tmp_path), *model_types],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-5000:]
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    with without_gumbel_noise():
        for model_type in model_types:
            sharded = [record[model_type] for record in records]
            assert all(entry["sharded"] for entry in sharded), model_type
            assert sum(entry["local"] for entry in sharded) == sharded[0]["total"], model_type
            assert max(entry["local"] for entry in sharded) < 0.6 * sharded[0]["total"], model_type
            assert len(sharded[0]["units"]) == 4, (model_type, sharded[0]["units"])
            reference, batches = fsdp_case(model_type)
            losses = train_steps(reference, batches)
            # each process's loss is its tokens' share of the global batch's, times the world size
            mean_of_processes = [(a + b) / 2 for a, b in zip(sharded[0]["losses"], sharded[1]["losses"])]
            assert mean_of_processes == pytest.approx(losses, abs=1e-5), model_type
            loaded = type(reference).from_pretrained(tmp_path / model_type)
            expected, got = reference.state_dict(), loaded.state_dict()
            assert got.keys() == expected.keys(), model_type
            initial = fsdp_case(model_type)[0].state_dict()
            assert max((expected[name] - initial[name]).abs().max() for name in expected) > 1e-2, model_type
            for name, tensor in expected.items():
                torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5, msg=f"{model_type}: {name}")
