#!/usr/bin/env bash
# The GPU rows of docs/BENCHMARKS.md in one go, on a machine with a CUDA GPU and PyTorch but no network.
#
#     bash benchmarks/gpu_suite.sh [check] [backbone] [static] [profile] [indigo] [indigo_graphs] [depth_adaptive]
#                                  [iot] [mat]   (default: all of these)
#                                  [backbone_blocked] [backbone_b256] [static_b256] [mat_static]
#     static: generation with a static cache, whose decoding step generate() compiles (CUDA graphs): the tokens
#     against the default cache (check_static_cache.py), then bench_backbone --static-cache; mat_static: bench_mat
#     with a static-cache (compiled) greedy row; indigo_graphs: the SAO search as CUDA graphs (check, then speed).
#
# Wheels for what the machine lacks are read from .whl/ (keep it out of git). For a Python 3.12 x86-64 machine,
# fetch them where pip has a network (antlr4 4.9.3 exists only as an sdist, so it is built locally):
#
#     P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
#        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
#     pip download --no-deps $P -d .whl transformers==5.23.0            # the image's transformers is older
#     pip download --no-deps $P -d .whl fairseq-fixed==0.12.3.1 hydra-core==1.3.2 omegaconf==2.3.0 bitarray
#     pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3          # the fairseq peer's needs
#
# Logs and JSON are written to a results folder and packed into $OUT/gpu-results.tar.gz (default OUT: the
# repository root).
set -u
cd "$(dirname "$0")/.."
PACK=${OUT:-$PWD}
OUT=$(mktemp -d)/gpu-results
mkdir -p "$OUT"
trap 'tar -czf "$PACK/gpu-results.tar.gz" -C "$(dirname "$OUT")" gpu-results' EXIT
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(check backbone static profile indigo indigo_graphs depth_adaptive iot mat)

if ls .whl/transformers-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/transformers-*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
FAIRSEQ_ARGS=()
if ls .whl/fairseq*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fairseq-site \
        .whl/fairseq*.whl .whl/hydra*.whl .whl/omegaconf*.whl .whl/antlr4*.whl .whl/bitarray*.whl || exit 1
    printf '#!/bin/sh\nPYTHONPATH=/tmp/fairseq-site exec python3 "$@"\n' > /tmp/fairseq-python
    chmod +x /tmp/fairseq-python
    FAIRSEQ_ARGS=(--fairseq-python /tmp/fairseq-python)
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/environment.txt"

run() {  # run NAME TIMEOUT COMMAND...: log to $OUT/NAME.log, keep going on failure
    local name=$1 limit=$2; shift 2
    echo "=== $name: $*"
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local status=$?
    echo "=== $name: exit $status after $((SECONDS - start)) s"
    grep -v -i -E "warn|max_new_tokens" "$OUT/$name.log" | grep -v "^ *$" | tail -n "${TAIL_LINES:-40}"
}

for part in "${parts[@]}"; do
    case $part in
        check) run check 240 python3 benchmarks/check_device.py --device cuda ;;
        backbone) run backbone 300 python3 benchmarks/bench_backbone.py --device cuda --repeats 10 \
            --precision fp32 bf16 "${FAIRSEQ_ARGS[@]}" --json "$OUT/backbone.json" ;;
        backbone_blocked) run backbone_blocked 300 python3 benchmarks/bench_backbone.py --device cuda --repeats 10 \
            --schedule blocked "${FAIRSEQ_ARGS[@]}" --json "$OUT/backbone_blocked.json" ;;
        backbone_b256) run backbone_b256 300 python3 benchmarks/bench_backbone.py --device cuda --repeats 10 \
            --batch 256 --precision fp32 bf16 "${FAIRSEQ_ARGS[@]}" --json "$OUT/backbone_b256.json" ;;
        static) run static_check 180 python3 benchmarks/check_static_cache.py --device cuda
            run backbone_static 390 python3 benchmarks/bench_backbone.py --device cuda --repeats 10 --static-cache \
            --precision fp32 bf16 "${FAIRSEQ_ARGS[@]}" --json "$OUT/backbone_static.json" ;;
        static_b256) run backbone_static_b256 300 python3 benchmarks/bench_backbone.py --device cuda --repeats 5 \
            --static-cache --batch 256 --json "$OUT/backbone_static_b256.json" ;;
        mat_static) run mat_static 420 python3 benchmarks/bench_mat.py --device cuda --train_steps 5 --repeats 5 \
            --static-cache --output "$OUT/mat_static.json" ;;
        indigo_graphs) run sao_graphs_check 240 python3 benchmarks/check_sao_graphs.py --device cuda
            run indigo_graphs 360 python3 benchmarks/bench_indigo.py --device cuda --repeats 5 --sao-cuda-graphs \
            --json "$OUT/indigo_graphs.json" ;;
        profile) run profile 200 python3 benchmarks/profile_backbone.py --device cuda --top 25 --repeats 10 ;;
        indigo) run indigo 240 python3 benchmarks/bench_indigo.py --device cuda --repeats 5 --precision fp32 bf16 \
            --json "$OUT/indigo.json" ;;
        depth_adaptive) run depth_adaptive 240 python3 benchmarks/bench_depth_adaptive.py --device cuda --repeats 5 \
            --out "$OUT/depth_adaptive.json" ;;
        iot) run iot 240 python3 benchmarks/bench_iot.py --device cuda --repeats 10 --precision fp32 bf16 \
            --json "$OUT/iot.json" ;;
        mat) run mat 240 python3 benchmarks/bench_mat.py --device cuda --train_steps 10 --repeats 5 \
            --output "$OUT/mat.json" ;;
        *) echo "unknown part $part"; exit 2 ;;
    esac
done
