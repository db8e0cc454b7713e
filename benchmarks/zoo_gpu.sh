#!/usr/bin/env bash
# The zoo's GPU recipes (task translation_gpu of training_scripts/zoo_recipes.yaml: the papers' IWSLT-size models)
# on one lent GPU, all at once, within one call of at most 10 minutes.
#
#     bash benchmarks/zoo_gpu.sh            (from the repository root, on a machine with a CUDA GPU)
#
# 1. A speed probe: the recipes train side by side for PROBE_MINUTES in a scratch folder; the slowest one's
#    updates per second, times the training window that is left (TRAIN_SECONDS), sets the task's budget in the
#    recipe file (rounded down to a multiple of the recipes' eval_every). The same budget must then be committed.
# 2. The recipes train side by side for that budget (flexformers-zoo run, one process each, no Hub export: the
#    weights of a lent machine cannot come back), then decode the test split; their results are written to
#    docs/zoo/results/ as on any machine.
#     BUDGET=750 RECIPES=depth-adaptive-translation-gpu-s1 bash benchmarks/zoo_gpu.sh   (no probe: a given budget)
#     HEAD_START_MINUTES=7 RECIPES="iot-translation-s1 indigo-r2l-word-order" bash benchmarks/zoo_gpu.sh
#   (a head start for CPU recipes: each trains at most that many minutes on the GPU, from its own recipe, budget
#   and seed; no probe, the recipe file is not touched. A recipe that finishes is decoded and recorded there. Each
#   unfinished run folder, with its newest checkpoint only, is packed into $OUT/head-start.tar.part-* (pieces of
#   15 MiB, as a lent machine returns files). On the CPU machine, `cat head-start.tar.part-* | tar -x -C runs/zoo`
#   and `flexformers-zoo run <recipe>` resumes each run where the GPU left it; its record lists both machines.)
# Results, logs, the rewritten recipe file and each run's trainer_state.json are packed into $OUT/zoo-gpu.tar.gz.
# A recipe recorded in docs/zoo/results is finished and is not trained again, and a cosine run does not train on to
# a new budget: to train the GPU recipes for another budget, move their records to docs/zoo/superseded/ first.
#
# What the machine lacks travels with the working tree (keep both out of git, .git/info/exclude):
# - .whl/: wheels for Python 3.12 of what the image lacks or has too old (seen 2026-11-26: transformers 5.17, no
#   datasets or evaluate, huggingface_hub 1.x), and flexformers itself. Where pip has a network:
#     P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
#        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl"
#     pip download $P transformers==5.24.0 datasets==5.2.0 evaluate==0.4.6 dill==0.4.1 multiprocess==0.70.19 \
#         huggingface_hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 hf_xet==1.8.0 click==8.5.1 \
#         fsspec==2026.9.0 filelock==4.3.1 idna==3.20 anyio==4.16.0 typing_extensions==4.16.0 h11==0.16.0 \
#         regex==2026.11.19
#     pip wheel --no-deps --no-build-isolation -w .whl .
#   (the image's pyarrow 25.0.1, tokenizers, accelerate, sacrebleu and torch 2.11 serve as they are);
# - .gpu/locale/de/LC_MESSAGES: the gettext catalogs of the machine that trains the CPU recipes. They replace the
#   GPU machine's own, so that both train and test on the same corpus and splits (a lent machine is thrown away):
#     mkdir -p .gpu/locale/de && cp -r /usr/share/locale/de/LC_MESSAGES .gpu/locale/de/
set -u
cd "$(dirname "$0")/.."
PACK=${OUT:-$PWD}
LOGS=$(mktemp -d)/zoo-gpu
mkdir -p "$LOGS"
pack() {
    cp -r docs/zoo/results "$LOGS/" 2>/dev/null
    cp training_scripts/zoo_recipes.yaml "$LOGS/"
    for run in runs/zoo/*/ /tmp/zoo-probe/*/; do
        name=$(basename "$run")
        case $run in /tmp/zoo-probe/*) name=probe-$name ;; esac
        [ -f "$run/trainer_state.json" ] && cp "$run/trainer_state.json" "$LOGS/$name.trainer_state.json"
        last=$(ls -d "$run"/checkpoint-* 2>/dev/null | sort -V | tail -1)
        [ -n "$last" ] && cp "$last/trainer_state.json" "$LOGS/$name.last_checkpoint_state.json"
    done
    tar -czf "$PACK/zoo-gpu.tar.gz" -C "$(dirname "$LOGS")" zoo-gpu
}
trap pack EXIT
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2
START=$SECONDS
LIMIT=${LIMIT_SECONDS:-575}           # the whole script, packing included
PROBE_MINUTES=${PROBE_MINUTES:-1.25}
FINISH_SECONDS=${FINISH_SECONDS:-200}  # test decoding, the methods' analyses (Depth-Adaptive's sweep: ~280 s)
RECIPES=${RECIPES:-"baseline-translation-gpu-s1 baseline-translation-gpu-s2 baseline-translation-gpu-s3
    iot-translation-gpu-s1 mat-scratch-translation-gpu-s1 depth-adaptive-translation-gpu-s1"}
RECIPE_FILE=training_scripts/zoo_recipes.yaml

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
if [ -d .gpu/locale/de/LC_MESSAGES ]; then
    rm -rf /usr/share/locale/de/LC_MESSAGES && mkdir -p /usr/share/locale/de \
        && cp -r .gpu/locale/de/LC_MESSAGES /usr/share/locale/de/ || exit 1
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  (cd /tmp && python3 -c "import torch, transformers, datasets, pyarrow, huggingface_hub; \
import flexformers.training_scripts.zoo; \
print('torch', torch.__version__, 'transformers', transformers.__version__, 'datasets', datasets.__version__, \
'pyarrow', pyarrow.__version__, 'huggingface_hub', huggingface_hub.__version__, torch.cuda.get_device_name())")
} 2>&1 | tee "$LOGS/environment.txt"
grep -q "^torch" "$LOGS/environment.txt" || exit 1
ZOO=(flexformers-zoo --recipes "$RECIPE_FILE")

# 1. The speed probe (its runs are thrown away; the corpus cache it builds is kept). BUDGET=<updates> skips it and
#    trains at that budget: the budget already recorded, to add a recipe that a cut-off call left unfinished.
if [ -n "${HEAD_START_MINUTES:-}" ]; then
    echo "head start: at most ${HEAD_START_MINUTES} minutes of training per recipe" | tee -a "$LOGS/environment.txt"
    REMAINING=$((LIMIT - (SECONDS - START) - 45))
    for recipe in $RECIPES; do
        timeout "$REMAINING" "${ZOO[@]}" run "$recipe" --no_export --max_minutes "$HEAD_START_MINUTES" \
            > "$LOGS/$recipe.log" 2>&1 &
    done
    wait
    unfinished=()
    for recipe in $RECIPES; do
        run=runs/zoo/$recipe
        echo "== $recipe"; tr '\r' '\n' < "$LOGS/$recipe.log" | grep -a -E "test BLEU|Error|[0-9]+/[0-9]+ \[" | tail -2
        [ -d "$run" ] && [ ! -f "$run/zoo_result.json" ] || continue
        # the newest checkpoint that was written whole (a call cut off mid-save leaves a partial one)
        last=$(python3 -c "import sys; from flexformers.training_scripts.checkpoints import \
find_latest_complete_checkpoint as f; print(f(sys.argv[1])[0] or '')" "$run")
        [ -n "$last" ] || continue
        # the run folder's own copy of the weights stays behind: resuming reads the checkpoint, and that copy (8 MiB
        # at d=128) pushed two runs past what a lent machine returns (2026-11-27: 64.0 MiB, one piece left out)
        unfinished+=($(find "$run" -maxdepth 1 -type f ! -name "*.safetensors" -printf "$recipe/%f\n")
                     "$recipe/$(basename "$last")")
    done
    if [ ${#unfinished[@]} -gt 0 ]; then
        tar -cf - -C runs/zoo "${unfinished[@]}" | split -b 15M -d - "$PACK/head-start.tar.part-"
        ls -la "$PACK"/head-start.tar.part-*
        # a lent machine returns 8 files, 64 MiB in all; zoo-gpu.tar.gz (~120 kB) is one of them. A d=128 run packs
        # about 25 MiB (its newest checkpoint: weights, Adam's moments, tokenizer).
        packed=$(du -cb "$PACK"/head-start.tar.part-* | tail -1 | cut -f1)
        if [ "$packed" -gt $((64 * 1048576 - 524288)) ] || [ "$(ls "$PACK"/head-start.tar.part-* | wc -l)" -gt 7 ]; then
            echo "error: the head start packed $((packed / 1048576)) MiB, more than a lent machine returns (64 MiB," \
                 "8 files): name fewer recipes (about 25 MiB a d=128 run)" >&2
            exit 1
        fi
    fi
    exit 0
elif [ -n "${BUDGET:-}" ]; then
    echo "budget ${BUDGET} updates (given, no probe)" | tee -a "$LOGS/environment.txt"
else
    for recipe in $RECIPES; do
        "${ZOO[@]}" --runs_dir /tmp/zoo-probe --records_dir /tmp/zoo-probe-records run "$recipe" --no_export \
            --max_minutes "$PROBE_MINUTES" > "$LOGS/probe-$recipe.log" 2>&1 &
    done
    wait
    TRAIN_SECONDS=$((LIMIT - (SECONDS - START) - FINISH_SECONDS - 20))
    PROBE_BUDGET=$(sed -n "/^  translation_gpu:/,/^recipes:/ s/^    updates: \([0-9]*\).*/\1/p" "$RECIPE_FILE")
    BUDGET=$(python3 benchmarks/zoo_gpu_budget.py "$LOGS" "$TRAIN_SECONDS" "$PROBE_BUDGET" 250 $RECIPES) || exit 1
    echo "training window ${TRAIN_SECONDS} s -> budget ${BUDGET} updates" | tee -a "$LOGS/environment.txt"
fi
sed -i "/^  translation_gpu:/,/^recipes:/ s/^    updates: [0-9]*/    updates: $BUDGET/" "$RECIPE_FILE"
grep -A14 "^  translation_gpu:" "$RECIPE_FILE" | grep "updates:"

# 2. The recipes, side by side.
REMAINING=$((LIMIT - (SECONDS - START) - 10))
for recipe in $RECIPES; do
    timeout "$REMAINING" "${ZOO[@]}" run "$recipe" --no_export > "$LOGS/$recipe.log" 2>&1 &
done
wait
for recipe in $RECIPES; do
    echo "== $recipe"; grep -a -E "test BLEU|error|Error" "$LOGS/$recipe.log" | tail -3
done
