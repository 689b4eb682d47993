#!/usr/bin/env bash
# One device call on the H200 machine, from the repository root:
#   bash scripts/gpu-run.sh STAGE...
# Stages: install (FlashInfer + small deps from the git-ignored .gpu/.gpu-deps folders carried
# along, see ../shared/gpu/README.md), tests (GPU tests in parallel shards), e2e (engine vs
# transformers on the SmolLM2 GGUF, joined from .gpu-smol-a/.gpu-smol-b), bench (attention
# kernels), features (CUDA graphs, TurboQuant, Mamba, prefix caching GPU tests), engine
# (benchmarks/gpu_engine.py), tune (Triton launch-shape sweep, K/V write paths), measure
# (prefix caching, Mamba decode and TurboQuant decode benchmarks), export (compiled FlashInfer
# kernels to $OUT, which install.sh reuses when copied into .gpu/ as kernels*.tar.xz).
# Logs go to $OUT; a summary prints last.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SHARD_TIMEOUT=${SHARD_TIMEOUT:-420}

setup_env() {
    [ -f /tmp/site/env.sh ] && . /tmp/site/env.sh
    [ -f /tmp/deps/env.sh ] && . /tmp/deps/env.sh
    [ -f /tmp/fa4site/env.sh ] && . /tmp/fa4site/env.sh
    export PAGEDSERVE_TEST_GGUF=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
}

stage_install() {
    [ -d .gpu ] && bash .gpu/install.sh >"$OUT/install.log" 2>&1
    [ -d .gpu-deps ] && bash .gpu-deps/install-deps.sh >>"$OUT/install.log" 2>&1
    # The SmolLM2 GGUF (98 MB) travels in parts (.gpu-smol-a/part1, -b/part2, -c/part3), one
    # per call on the same machine; once all are here they are joined.
    mkdir -p /tmp/smol
    for part in .gpu-smol-*/part*; do [ -f "$part" ] && cp "$part" /tmp/smol/; done
    if [ -f /tmp/smol/part1 ] && [ -f /tmp/smol/part2 ] && [ -f /tmp/smol/part3 ]; then
        cat /tmp/smol/part1 /tmp/smol/part2 /tmp/smol/part3 \
            >/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
    fi
    setup_env
    nvidia-smi -L
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    python3 -m pagedserve backends
}

shard() {  # name, pytest args...
    local name=$1; shift
    ( timeout "$SHARD_TIMEOUT" python3 -m pytest -q -m gpu -p no:cacheprovider -rs "$@" \
        >"$OUT/$name.log" 2>&1; echo "exit $?" >>"$OUT/$name.log" ) &
}

stage_tests() {
    setup_env
    shard triton-a tests/test_triton_ops.py -k "d64 or d80 or gpu_float32 or split_kv"
    shard triton-b tests/test_triton_ops.py -k "d96 or d128"
    shard triton-c tests/test_triton_ops.py -k "d256"
    shard fi-a tests/test_flashinfer_gpu.py -k "d64 and not slow"
    shard fi-b tests/test_flashinfer_gpu.py -k "not d64 and not slow"
    shard fa tests/test_flash_attn_gpu.py -k "torch or fa4"
    shard models tests/test_models.py tests/test_layer_kernels.py tests/test_cuda_graphs_gpu.py
    wait
}

stage_features() {  # the later features' GPU tests, in parallel
    setup_env
    SHARD_TIMEOUT=${FEATURE_TIMEOUT:-240}
    shard graphs tests/test_cuda_graphs_gpu.py
    shard turboquant tests/test_turboquant_gpu.py
    shard mamba tests/test_mamba_gpu.py
    shard prefix tests/test_prefix_caching.py
    wait
}

stage_engine() {  # the engine's throughput figures (issue: GPU engine performance)
    setup_env
    timeout "${ENGINE_TIMEOUT:-300}" python3 benchmarks/gpu_engine.py \
        --num-prompts "${NUM_PROMPTS:-128}" ${ENGINE_ARGS:-} >"$OUT/engine.log" 2>&1
    echo "exit $?" >>"$OUT/engine.log"
}

stage_e2e() {
    setup_env
    [ -f "$PAGEDSERVE_TEST_GGUF" ] || { echo "no GGUF at $PAGEDSERVE_TEST_GGUF"; return; }
    timeout "$SHARD_TIMEOUT" python3 -m pytest -q -s -m gpu -p no:cacheprovider -rs \
        tests/test_gpu_e2e.py >"$OUT/e2e.log" 2>&1; echo "exit $?" >>"$OUT/e2e.log"
}

stage_bench() {
    setup_env
    timeout 300 python3 benchmarks/attention_kernels.py --backends TRITON,FLASHINFER,FLASH_ATTN \
        >"$OUT/bench.log" 2>&1; echo "exit $?" >>"$OUT/bench.log"
}

stage_tune() {  # issue 5's launch shapes and issue 6's K/V write, on a quiet GPU
    setup_env
    timeout 300 python3 benchmarks/triton_tiles.py >"$OUT/tune.log" 2>&1
    echo "exit $?" >>"$OUT/tune.log"
    timeout 200 python3 benchmarks/attention_kernels.py --backends TRITON,FLASHINFER,FLASH_ATTN \
        --write >"$OUT/bench.log" 2>&1; echo "exit $?" >>"$OUT/bench.log"
}

stage_measure() {  # benchmarks of prefix caching, Mamba and TurboQuant on the H200
    setup_env
    timeout 240 python3 benchmarks/prefix_caching.py --device cuda --dtype bfloat16 \
        --model random:smollm2-135m >"$OUT/prefix.log" 2>&1; echo "exit $?" >>"$OUT/prefix.log"
    timeout 180 python3 benchmarks/mamba_decode.py >"$OUT/mamba.log" 2>&1
    echo "exit $?" >>"$OUT/mamba.log"
    timeout 120 python3 benchmarks/kv_quant_quality.py --kernel-bench >"$OUT/tq.log" 2>&1
    echo "exit $?" >>"$OUT/tq.log"
}

stage_prefix0() {  # what prefix caching costs with nothing to hit, more repeats
    setup_env
    timeout 200 python3 benchmarks/prefix_caching.py --device cuda --dtype bfloat16 \
        --model random:smollm2-135m --workloads unique --repeats 6 >"$OUT/prefix0.log" 2>&1
    echo "exit $?" >>"$OUT/prefix0.log"
}

stage_export() {
    setup_env
    python3 - "$OUT" <<'PY'
import glob, os, sys, tarfile
from flashinfer.jit import env
sos = glob.glob(str(env.FLASHINFER_JIT_DIR / "*" / "*.so"))
path = os.path.join(sys.argv[1], "kernels.tar.xz")
with tarfile.open(path, "w:xz") as tf:
    for so in sos:
        tf.add(so, arcname=os.path.join(os.path.basename(os.path.dirname(so)), os.path.basename(so)))
print(f"exported {len(sos)} kernels, {os.path.getsize(path) / 2**20:.1f} MiB")
PY
}

for stage in "$@"; do
    echo "=== $stage $(date +%T)"
    "stage_$stage"
done
echo "=== summary $(date +%T)"
for f in "$OUT"/*.log; do
    [ "$(basename "$f")" = install.log ] && continue
    echo "--- $(basename "$f")"
    grep -E "passed|failed|error|exit [0-9]+" "$f" | tail -3
done
