#!/usr/bin/env bash
# One device call on the H200 machine, from the repository root:
#   bash scripts/gpu-run.sh STAGE...
# Stages: install (whatever git-ignored bundles were carried along: FlashInfer .gpu, small deps
# .gpu-deps, FlashAttention-4 .gpu-fa4a/.gpu-fa4b, SmolLM2 GGUF parts .gpu-smol-*, built on a
# machine with a package index; the GGUF parts by scripts/split-gguf.sh),
# tests (GPU tests in parallel shards), quick (the GPU tests of
# recently changed code), e2e (engine vs transformers on the SmolLM2 GGUF), bench (attention
# kernels), features (Mamba and prefix caching GPU tests), engine (benchmarks/gpu_engine.py),
# tqtests (TurboQuant's GPU tests), moe (the MoE kernel's, sinks' and new families' GPU tests,
# the MoE kernel benchmark), moe_engine (the Qwen3-30B-A3B shape next to transformers), mla
# (TRITON_MLA's, FLASHINFER_MLA's, MLA decode graphs' and DiffKV's GPU tests, MLA decode
# bandwidth of both backends, DeepSeek-V2-Lite's throughput and KV capacity), flex
# (FLEX_ATTENTION's conformance and kernel timings beside TRITON and FLASHINFER), families (the
# families' GPU greedy test), stateops (the state layers' kernels),
# hybrid (the hybrid models on CUDA, Qwen3-Next decode), tqbound (TURBOQUANT where the bf16 cache
# binds, 400 x 7,680/256), coreproc (bench throughput of the bundled model's shape on this tree and .gpu-old/tree
# alternating, the host phases and kernel time per step),
# kvgroups (KV-cache groups' and the families' GPU tests), tqgraphs (TURBOQUANT's graphs: tests, 8B decode-heavy beside bf16), tp (tensor parallelism on 2+ GPUs: parity, 8B and 70B throughput, Ray), structured (guided decoding's cost), structcmp (guided decoding's cost on this tree and .gpu-old/tree, alternating), flexbench (the bundled GGUF's bench throughput on FLEX_ATTENTION
# beside TRITON and FLASHINFER), tqcuda (the CUDA TurboQuant decode kernel: tests, benchmark),
# linear (the 8B projections' GEMMs by token count), tunableop (8B decode steps without and with
# PYTORCH_TUNABLEOP_ENABLED), tune (Triton launch-shape sweep, K/V write paths), fa4 (FA4
# conformance and benchmark rows), tq (TurboQuant decode benchmark), quality (TurboQuant's bf16 quality table), measure (prefix
# caching, Mamba decode and TurboQuant decode benchmarks), prefix0 (prefix caching at 0% hits),
# export (compiled FlashInfer kernels to $OUT, which install.sh reuses when copied into .gpu/
# as kernels*.tar.xz), compare (greedy tokens and the 8B shape's bench throughput on this tree
# and on an older one carried in .gpu-old/tree), serve_latency (the 8B shape served: TTFT, TPOT
# and ITL at several request rates), mlatests (TRITON_MLA's GPU tests, left running for a later
# stage's wait), mlasweep (TRITON_MLA's launch-shape sweep), hoststep (benchmarks/host_step.py
# on the bundled GGUF: a batch-256 step's host phases and a cProfile), moeprofile (the
# Qwen3-30B-A3B shape's kernel time a step, a quantized KV dtype alone, the MoE tile sweep),
# wave25 / wave25bench / wave25eagle / wave25embed / vlm / fp8dec / first29 / rerun31 / lora31 /
# lora32 / call32 (call32tests, embedphases, lorasweep, lorarows) / call33 / int4engine /
# embed52 (#52: the embeddings' gpu tests, bge-base's LLM.embed with --phases, exact GELU) /
# int4call (the W4A16 kernel's gpu tests, launch-shape sweep and engine rows) /
# mxfp4engine / ggufengine / specrows / fp8linear /
# fp8engine (the last sessions' GPU tests and rows; see each), piecewise (piecewise CUDA graphs: their GPU tests, then the Qwen3-30B-A3B
# shape's prefill launch and throughput without and with them).
#
# The whole GPU suite: three calls back to back on one machine (10 minutes each at most):
#   1. carry .gpu .gpu-deps .gpu-smol-a:  install tests1   (Triton, FLASH_ATTN, models, graphs)
#   2. carry .gpu-smol-b:                 install tests2   (FlashInfer, TurboQuant)
#   3. nothing more to carry:             install features e2e  (Mamba, prefix caching, the
#      bundled GGUF end to end on every backend)
# (2026-12-01: all thirteen shards of tests1 + tests2 in one call timed out at 440 s with no
# failure; the split above has not run yet.)
# Logs go to $OUT (as logs.tgz at the end; OUT_ARCHIVE= keeps them loose); a summary prints
# last.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SHARD_TIMEOUT=${SHARD_TIMEOUT:-420}

export PAGEDSERVE_TEST_GGUF=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf

setup_env() {
    [ -f /tmp/site/env.sh ] && . /tmp/site/env.sh
    [ -f /tmp/deps/env.sh ] && . /tmp/deps/env.sh
    [ -f /tmp/fa4site/env.sh ] && . /tmp/fa4site/env.sh
}

stage_install() {
    [ -d .gpu ] && bash .gpu/install.sh >"$OUT/install.log" 2>&1
    # .gpu-deps-lite: the same without tvm_ffi, for calls that carry .gpu (which has it).
    for d in .gpu-deps .gpu-deps-lite; do
        [ -d $d ] && bash $d/install-deps.sh >>"$OUT/install.log" 2>&1
    done
    # FlashAttention-4 travels in two parts (.gpu-fa4a, then .gpu-fa4b in the next call on the
    # same machine).
    [ -d .gpu-fa4a ] && cp -r .gpu-fa4a /tmp/
    [ -d .gpu-fa4b ] && bash .gpu-fa4b/install-fa4.sh >>"$OUT/install.log" 2>&1
    # The SmolLM2 GGUF (98 MB) travels in parts (.gpu-smol-*/part*, one folder per call on the
    # same machine, written by scripts/split-gguf.sh); .gpu-smol-*/manifest says how many
    # parts and bytes the file has, and once all are here they are joined.
    mkdir -p /tmp/smol
    for f in .gpu-smol-*/part* .gpu-smol-*/manifest; do [ -f "$f" ] && cp "$f" /tmp/smol/; done
    if [ -f /tmp/smol/manifest ] && [ ! -f "$PAGEDSERVE_TEST_GGUF" ]; then
        read -r nparts nbytes </tmp/smol/manifest
        have=$(cat /tmp/smol/part* 2>/dev/null | wc -c)
        if [ "$(ls /tmp/smol/part* | wc -l)" = "$nparts" ] && [ "$have" = "$nbytes" ]; then
            cat $(ls /tmp/smol/part* | sort -V) >"$PAGEDSERVE_TEST_GGUF"
            echo "GGUF joined from $nparts parts"
        else
            echo "GGUF: $have of $nbytes bytes here"
        fi
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

MODEL_TESTS="tests/models/test_models.py tests/models/test_layer_kernels.py \
    tests/engine/test_cuda_graphs.py"
TQ_TESTS=tests/attention/turboquant

stage_tests() {  # every GPU test of the kernels, the models and TurboQuant: both halves
    stage_tests1
    stage_tests2
}

# Thirteen shards at once on one GPU ran out of time (2026-12-01: Triton compiles and
# FlashInfer's nvcc builds fight for the 16 cores), so the suite runs in two halves of at most
# seven shards, one call each.
stage_tests1() {  # Triton's kernels, FLASH_ATTN, the models and CUDA graphs
    setup_env
    shard triton-a tests/attention/test_triton_ops.py -k "d64 or d80 or gpu_float32 or split_kv"
    shard triton-b tests/attention/test_triton_ops.py -k "d96 or d128"
    shard triton-c tests/attention/test_triton_ops.py -k "d256"
    shard fa tests/attention/test_flash_attn.py -k "torch or fa4"
    shard fa-other tests/attention/test_flash_attn.py -k "not (torch or fa4)"  # fa3, fa2
    shard models $MODEL_TESTS
    wait
}

stage_tests2() {  # FlashInfer (its JIT compiles first) and TurboQuant
    setup_env
    shard fi-a tests/attention/test_flashinfer.py -k "d64 and not slow"
    shard fi-b tests/attention/test_flashinfer.py -k "not d64 and not slow"
    # The tests that compile FlashInfer's fa3 (SM90) prefill kernels, about 90 s each.
    shard fi-slow tests/attention/test_flashinfer.py -m "gpu and slow"
    tq_shards
    wait
}

tq_shards() {  # TurboQuant's GPU tests in four shards
    shard tq-a $TQ_TESTS/test_kernels.py -k "decode_tiles or fp32_options or benchmark"
    shard tq-b $TQ_TESTS/test_kernels.py $TQ_TESTS/test_backend.py \
        -k "not (decode_tiles or fp32_options or benchmark)"
    shard tq-c $TQ_TESTS/test_cuda_decode.py -k "k8v4 or 3bit"
    shard tq-d $TQ_TESTS/test_cuda_decode.py -k "not (k8v4 or 3bit)"
}

stage_tqtests() {  # TurboQuant's GPU tests in four shards, the host-side ones first
    setup_env
    tq_host
    tq_shards
    wait
}

stage_features() {  # the later features' GPU tests that `tests` leaves out, in parallel
    setup_env
    SHARD_TIMEOUT=${FEATURE_TIMEOUT:-240}
    shard mamba tests/attention/test_mamba_ops.py tests/models/test_mamba.py
    shard prefix tests/kv_cache/test_prefix_caching.py
    wait
}

stage_engine() {  # the engine's throughput figures (issue: GPU engine performance)
    setup_env
    timeout "${ENGINE_TIMEOUT:-300}" python3 benchmarks/gpu_engine.py \
        --num-prompts "${NUM_PROMPTS:-128}" ${ENGINE_ARGS:-} >"$OUT/engine.log" 2>&1
    echo "exit $?" >>"$OUT/engine.log"
}

stage_linear() {  # the 8B projections' GEMMs by token count, next to their floors
    setup_env
    timeout 200 python3 benchmarks/linear_shapes.py >"$OUT/linear.log" 2>&1
    echo "exit $?" >>"$OUT/linear.log"
}

stage_engine_sync() {  # the same with synchronous steps (async scheduling is the CUDA default)
    setup_env
    timeout "${ENGINE_TIMEOUT:-300}" python3 benchmarks/gpu_engine.py --no-async-scheduling \
        --num-prompts "${NUM_PROMPTS:-128}" ${ENGINE_ARGS:-} >"$OUT/engine-sync.log" 2>&1
    echo "exit $?" >>"$OUT/engine-sync.log"
}

stage_tunableop() {  # 8B decode steps with cuBLAS's default GEMMs, then with TunableOp's picks
    setup_env
    for tuned in 0 1; do
        PYTORCH_TUNABLEOP_ENABLED=$tuned PYTORCH_TUNABLEOP_VERBOSE=0 \
            timeout "${ENGINE_TIMEOUT:-200}" python3 benchmarks/gpu_engine.py --skip-small \
            --skip-hf --skip-prefill-heavy --skip-decode-heavy ${ENGINE_ARGS:-} \
            >"$OUT/tunableop-$tuned.log" 2>&1
        echo "exit $?" >>"$OUT/tunableop-$tuned.log"
    done
}

stage_e2e() {
    setup_env
    [ -f "$PAGEDSERVE_TEST_GGUF" ] || { echo "no GGUF at $PAGEDSERVE_TEST_GGUF"; return; }
    timeout "$SHARD_TIMEOUT" python3 -m pytest -q -s -m gpu -p no:cacheprovider -rs \
        tests/engine/test_bundled_model.py >"$OUT/e2e.log" 2>&1; echo "exit $?" >>"$OUT/e2e.log"
}

stage_bench() {
    setup_env
    timeout 300 python3 benchmarks/attention_kernels.py --backends TRITON,FLASHINFER,FLASH_ATTN \
        >"$OUT/bench.log" 2>&1; echo "exit $?" >>"$OUT/bench.log"
}

stage_quick() {  # the GPU tests of code changed since the last full run, in parallel
    setup_env
    shard conformance tests/attention/test_conformance.py -m "not slow" -k "TRITON and d128"
    shard graphs tests/engine/test_cuda_graphs.py
    shard structured tests/structured_output
    shard coreproc tests/engine/test_core_process.py tests/engine/test_data_parallel.py
    wait
}

stage_tune() {  # issue 5's launch shapes and the K/V write, on a quiet GPU
    setup_env
    timeout 300 python3 benchmarks/triton_tiles.py --workloads "${TUNE_WORKLOADS:-write,prefill}" \
        ${TUNE_ARGS:-} >"$OUT/tune.log" 2>&1
    echo "exit $?" >>"$OUT/tune.log"
    if [ -n "${TUNE_UNFUSED:-}" ]; then  # the same prefill shapes, the kernel alone
        timeout 120 python3 benchmarks/triton_tiles.py --workloads prefill --no-fused \
            --prefill-shapes "$TUNE_UNFUSED" >"$OUT/tune-unfused.log" 2>&1
        echo "exit $?" >>"$OUT/tune-unfused.log"
    fi
    timeout 200 python3 benchmarks/attention_kernels.py --backends TRITON,FLASHINFER,FLASH_ATTN \
        --write >"$OUT/bench.log" 2>&1; echo "exit $?" >>"$OUT/bench.log"
}

stage_fa4() {  # FlashAttention-4: conformance on the H200 (3 shards) and the benchmark rows
    setup_env
    export PAGEDSERVE_FLASH_ATTN_IMPL=fa4
    shard fa4-d64 tests/attention/test_flash_attn.py -k "fa4 and d64"
    shard fa4-d128 tests/attention/test_flash_attn.py -k "fa4 and d128"
    shard fa4-other tests/attention/test_flash_attn.py -k "fa4 and not d64 and not d128"
    wait
    timeout 200 python3 benchmarks/attention_kernels.py --backends FLASH_ATTN,TRITON --write \
        >"$OUT/bench-fa4.log" 2>&1
    echo "exit $?" >>"$OUT/bench-fa4.log"
    unset PAGEDSERVE_FLASH_ATTN_IMPL
}

stage_quality() {  # TurboQuant's quality table in bf16 on the SmolLM2 GGUF
    setup_env
    [ -f "$PAGEDSERVE_TEST_GGUF" ] || { echo "no GGUF at $PAGEDSERVE_TEST_GGUF"; return; }
    timeout 240 python3 benchmarks/kv_quant_quality.py --device cuda \
        --model "$PAGEDSERVE_TEST_GGUF" >"$OUT/quality.log" 2>&1
    echo "exit $?" >>"$OUT/quality.log"
}

stage_tq() {  # TurboQuant decode against bf16 Triton, 64 x 8,192
    setup_env
    timeout "${TQ_TIMEOUT:-200}" python3 benchmarks/kv_quant_quality.py --kernel-bench ${TQ_ARGS:-} \
        >"$OUT/tq.log" 2>&1
    echo "exit $?" >>"$OUT/tq.log"
}

stage_tqcuda() {  # the CUDA TurboQuant decode kernel's tests, then 64 x 8,192: CUDA, Triton
    setup_env
    tq_host
    shard tq-c $TQ_TESTS/test_cuda_decode.py -k "k8v4 or 3bit"
    shard tq-d $TQ_TESTS/test_cuda_decode.py -k "not (k8v4 or 3bit)"
    wait
    TQ_ARGS="--tq-decode-kernels cuda,triton ${TQ_ARGS:-}" stage_tq
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

stage_compare() {  # the same runs on this tree and on an older one carried in .gpu-old/tree
    setup_env        # (git archive OLD | tar x -C .gpu-old/tree): greedy tokens of the bundled
    local tree       # GGUF in bf16, then the 8B shape's bench throughput, each tree in turn
    for tree in .gpu-old/tree .; do
        local tag=new; [ "$tree" = . ] || tag=old
        [ -d "$tree" ] || { echo "no $tree"; continue; }
        (cd "$tree" && export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} &&
         if [ -f "$PAGEDSERVE_TEST_GGUF" ]; then
             timeout 150 python3 "$OLDPWD/scripts/greedy_tokens.py" model="$PAGEDSERVE_TEST_GGUF" \
                 >"$OUT/greedy-$tag.json" 2>"$OUT/greedy-$tag.log"; echo "exit $?" >>"$OUT/greedy-$tag.log"
         fi
         for shape in 1024:128 128:1024; do
             timeout "${COMPARE_TIMEOUT:-200}" python3 -m pagedserve bench throughput \
                 --config configs/llama3-8b-random.yaml --attention-backend TRITON \
                 --num-prompts "${NUM_PROMPTS:-1000}" --input-len "${shape%:*}" \
                 --output-len "${shape#*:}" >"$OUT/throughput-$tag-${shape/:/-}.log" 2>&1
             echo "exit $?" >>"$OUT/throughput-$tag-${shape/:/-}.log"
         done)
    done
    for f in "$OUT"/throughput-*.log; do echo "$(basename "$f"): $(grep -h "Throughput" "$f")"; done
    [ -f "$OUT/greedy-old.json" ] && cmp -s "$OUT/greedy-old.json" "$OUT/greedy-new.json" &&
        echo "greedy tokens: old == new" || echo "greedy tokens: DIFFER (or missing)"
}

stage_serve_latency() {  # the 8B shape served: TTFT / TPOT / ITL at several request rates
    setup_env
    python3 -m pagedserve serve --config "${SERVE_CONFIG:-configs/llama3-8b-random.yaml}" --port 8011 \
        --attention-backend TRITON >"$OUT/serve-8b.log" 2>&1 &
    local pid=$!
    for _ in $(seq 240); do
        python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/health')" \
            2>/dev/null && break
        kill -0 $pid 2>/dev/null || break
        sleep 1
    done
    timeout "${LATENCY_TIMEOUT:-420}" python3 benchmarks/serve_bench.py \
        --url http://127.0.0.1:8011 --request-rates "${RATES:-4,16,64}" \
        --num-requests "${LATENCY_REQUESTS:-160}" --input-len 1024 --output-len 256 \
        --vocab-size 128000 --json "$OUT/serve-latency.json" >"$OUT/serve-latency.log" 2>&1
    echo "exit $?" >>"$OUT/serve-latency.log"
    kill $pid; wait $pid 2>/dev/null
    cat "$OUT/serve-latency.log"
}

stage_moe() {  # the MoE kernel's and the sinks' GPU tests, then the MoE kernel benchmark
    setup_env
    shard moe-kernels tests/models/test_moe_kernels.py
    shard sinks tests/attention/test_conformance.py -k "sink"
    shard families tests/models/test_families.py
    wait
    timeout 300 python3 benchmarks/moe_kernels.py --json "$OUT/moe-kernels.json" \
        >"$OUT/moe-kernels.log" 2>&1; echo "exit $?" >>"$OUT/moe-kernels.log"
    tail -40 "$OUT/moe-kernels.log"
}

stage_moe_engine() {  # the Qwen3-30B-A3B shape through bench throughput, next to transformers
    setup_env
    timeout "${MOE_ENGINE_TIMEOUT:-540}" python3 benchmarks/moe_engine.py \
        --json "$OUT/moe-engine.json" ${MOE_ENGINE_ARGS:-} >"$OUT/moe-engine.log" 2>&1
    echo "exit $?" >>"$OUT/moe-engine.log"
    tail -20 "$OUT/moe-engine.log"
}

stage_mla() {  # TRITON_MLA, FLASHINFER_MLA (after `install` with .gpu carried: FlashInfer JIT-
    # compiles its MLA kernels on first use) and DiffKV on the H200, none run there yet; MLA
    # decode graphs against eager; then the MLA figures: decode bandwidth of both backends
    setup_env
    shard mla tests/attention/test_triton_mla.py
    shard flashinfer_mla tests/attention/test_flashinfer_mla.py
    shard mla_graphs tests/engine/test_cuda_graphs.py -k mla
    shard diffkv tests/attention/test_triton_ops.py -k "diff_kv"
    wait
    timeout 240 python3 benchmarks/mla_decode.py --backends TRITON_MLA,FLASHINFER_MLA \
        ${MLA_SWEEP:+--sweep --iters 20} >"$OUT/mla-decode.log" 2>&1
    echo "exit $?" >>"$OUT/mla-decode.log"
    [ "${MLA_ENGINE:-1}" = 0 ] && return  # MLA_ENGINE=0: the kernels only
    timeout 300 python3 benchmarks/moe_engine.py --model random:deepseek-v2-lite \
        --attention-backend TRITON_MLA --skip-hf --workloads 128/1024 \
        >"$OUT/deepseek-v2-lite.log" 2>&1; echo "exit $?" >>"$OUT/deepseek-v2-lite.log"
    tail -12 "$OUT/mla-decode.log" "$OUT/deepseek-v2-lite.log"
}

stage_mlatests() {  # TRITON_MLA's GPU tests, in the background (a later stage's wait ends them)
    setup_env
    shard mla tests/attention/test_triton_mla.py
}
stage_mlasweep() {  # TRITON_MLA's launch shapes at 64 x 4,096, 128 heads, page 16
    setup_env
    timeout "${MLA_TIMEOUT:-150}" python3 benchmarks/mla_decode.py --sweep --iters 20 \
        --block-size 16 --backends TRITON_MLA >"$OUT/mla-sweep.log" 2>&1
    echo "exit $?" >>"$OUT/mla-sweep.log"
    tail -20 "$OUT/mla-sweep.log"
}
stage_hoststep() {  # where a batch-256 step of the bundled GGUF spends its host time: the
    # phases unprofiled, then a cProfile run (which inflates Python code) for the functions
    setup_env
    [ -f "$PAGEDSERVE_TEST_GGUF" ] || { echo "no GGUF at $PAGEDSERVE_TEST_GGUF"; return; }
    local profile
    for profile in 0 30; do
        PAGEDSERVE_ATTENTION_BACKEND=${BACKEND:-TRITON} \
        timeout "${HOSTSTEP_TIMEOUT:-100}" python3 benchmarks/host_step.py --device cuda \
            --model "$PAGEDSERVE_TEST_GGUF" --num-requests 256 --prompt-len 128 \
            --output-len 128 --no-end-to-end --profile $profile >"$OUT/hoststep-$profile.log" 2>&1
        echo "exit $?" >>"$OUT/hoststep-$profile.log"
        grep -v INFO "$OUT/hoststep-$profile.log" | head -20
    done
}
stage_flex() {  # FLEX_ATTENTION on the H200 (never run there): conformance in bf16, its kernels
    setup_env
    # The physical layout's GPU tests first (the compiled kernel over the block mask), then
    # the conformance suite, which is not GPU-marked: it runs on CUDA (bf16) wherever CUDA is
    # (2026-12-02: 150 of its FLEX cases took the whole 200 s, each compiling flex).
    ( timeout "$SHARD_TIMEOUT" python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
        tests/attention/test_flex_attention.py >"$OUT/flex-gpu.log" 2>&1
      echo "exit $?" >>"$OUT/flex-gpu.log"
      timeout "$SHARD_TIMEOUT" python3 -m pytest -q -p no:cacheprovider -rs \
        tests/attention/test_conformance.py tests/attention/test_flex_attention.py \
        -k "FLEX_ATTENTION or flex or sink" >"$OUT/flex.log" 2>&1; echo "exit $?" >>"$OUT/flex.log" ) &
    wait
    # FLEX_ATTENTION (the cache as keys, GQA folded into rows), FLEX_UNFOLDED (enable_gqa),
    # FLEX_PACKED (vLLM's packed query tiles), FLEX_GATHER (the gathered keys of before): each
    # compiles per workload.
    timeout "${FLEX_BENCH_TIMEOUT:-540}" python3 benchmarks/attention_kernels.py \
        --backends "${FLEX_BACKENDS:-TRITON,FLEX_ATTENTION,FLEX_UNFOLDED,FLEX_PACKED,FLEX_GATHER}" \
        >"$OUT/flex-bench.log" 2>&1; echo "exit $?" >>"$OUT/flex-bench.log"
    tail -24 "$OUT/flex-bench.log"
}

stage_stateops() {  # the state layers' Triton kernels (GDN, lightning, SSD, conv) against torch
    setup_env
    shard stateops tests/attention/test_linear_attention_ops.py tests/attention/test_ssm_ops.py \
        tests/attention/test_mamba_ops.py
    wait
}

stage_hybrid() {  # the hybrid models' GPU greedy tests, then Qwen3-Next decode beside transformers
    setup_env
    shard hybrid tests/models/test_qwen3_next.py tests/models/test_mamba2_bamba.py \
        tests/models/test_lfm2_minimax.py tests/models/test_mamba.py
    wait
    timeout 200 python3 benchmarks/hybrid_decode.py >"$OUT/hybrid-decode.log" 2>&1
    echo "exit $?" >>"$OUT/hybrid-decode.log"
    tail -12 "$OUT/hybrid-decode.log"
}

stage_tqbound() {  # where the bf16 cache binds: 400 x 7,680/256, --max-num-seqs 512, 8B shape
    setup_env
    local kv backend
    for kv in ${TQ_PRESETS:-auto tq_4bit}; do
        backend=TURBOQUANT
        [ "$kv" = auto ] && backend=TRITON
        [ "$kv" = fp8 ] && backend=FLASHINFER  # the one fp8 cache (carry .gpu)
        timeout "${TQ_TIMEOUT:-240}" python3 -m pagedserve bench throughput \
            --config llama3-8b-random --attention-backend "$backend" --kv-cache-dtype "$kv" \
            --max-num-seqs 512 --num-prompts "${TQ_PROMPTS:-400}" --input-len "${TQ_IN:-7680}" \
            --output-len "${TQ_OUT:-256}" >"$OUT/tqbound-$kv.log" 2>&1
        echo "exit $?" >>"$OUT/tqbound-$kv.log"
        echo "$kv: $(grep -hiE "kv cache|blocks" "$OUT/tqbound-$kv.log" | head -2 | tr '\n' ' ')"
        echo "$kv: $(grep -h -A3 Throughput "$OUT/tqbound-$kv.log" | tr '\n' ' ')"
    done
}
stage_coreproc() {  # issue #26: `bench throughput` 256 x 128/512 of the bundled model's shape on
    # this tree and on an older one carried in .gpu-old/tree, alternating (the host's speed
    # drifts within a call), each with its own defaults; then this tree's host phases and its
    # kernel time per step (GPU busy = kernel time / wall time per step: nvidia-smi's samples
    # are too coarse for runs of a few seconds). The model: `random:smollm2-135m` with the
    # bundled tokenizer carried as .gpu-tok (save_pretrained), else the GGUF, else no tokenizer.
    setup_env
    local model=(--model random:smollm2-135m)
    if [ -d .gpu-tok ]; then model+=(--tokenizer "$PWD/.gpu-tok")
    elif [ -f "$PAGEDSERVE_TEST_GGUF" ]; then model=(--model "$PAGEDSERVE_TEST_GGUF"); fi
    local round tree tag
    for round in 1 2; do
        for tree in .gpu-old/tree .; do
            tag=new; [ "$tree" = . ] || tag=old
            [ -d "$tree" ] || continue
            (cd "$tree" && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 200 \
                python3 -m pagedserve bench throughput "${model[@]}" --attention-backend TRITON \
                --num-prompts 256 --input-len 128 --output-len 512 \
                >"$OUT/coreproc-$tag-$round.log" 2>&1; echo "exit $?" >>"$OUT/coreproc-$tag-$round.log")
            echo "$tag $round: $(grep -h -E 'Throughput|Engine core' "$OUT/coreproc-$tag-$round.log" | tr '\n' ' ')"
        done
    done
    PAGEDSERVE_ATTENTION_BACKEND=TRITON timeout 200 python3 benchmarks/host_step.py --device cuda \
        "${model[@]}" --num-requests 256 --prompt-len 128 --output-len 512 --max-model-len 8192 \
        --no-end-to-end --gpu-time >"$OUT/coreproc-hoststep.log" 2>&1
    grep -v INFO "$OUT/coreproc-hoststep.log" | tail -16
}
stage_kvgroups() {  # KV-cache groups on CUDA (Gemma 2/3, gpt-oss), then the families
    setup_env
    shard kvgroups tests/models/test_kv_groups.py
    shard families tests/models/test_families.py
    wait
}
stage_structured() {  # guided decoding's cost on the bundled model (needs the GGUF), its GPU test
    setup_env
    local skip=()  # .gpu-deps-lite has no openai: the server tests need it
    python3 -c "import openai" 2>/dev/null || skip=(--ignore tests/structured_output/test_server_structured.py)
    # Without the GGUF the guided CUDA tests run a random model of its shape with the bundled
    # tokenizer, carried as .gpu-tok.
    [ -d .gpu-tok ] && export PAGEDSERVE_TEST_TOKENIZER=$PWD/.gpu-tok
    shard structured tests/structured_output "${skip[@]}"
    wait  # the benchmark alone on the GPU
    # TRITON, unless BACKEND says otherwise: with .gpu installed the default would be
    # FLASHINFER, whose kernels for this model JIT-compile for minutes on a fresh machine.
    PAGEDSERVE_ATTENTION_BACKEND=${BACKEND:-TRITON} \
    timeout "${STRUCT_TIMEOUT:-200}" python3 benchmarks/structured_output.py --device cuda \
        --model "$PAGEDSERVE_TEST_GGUF" ${STRUCT_ARGS:---output-len 128 --no-seed} \
        >"$OUT/structured-bench.log" 2>&1; echo "exit $?" >>"$OUT/structured-bench.log"
    tail -12 "$OUT/structured-bench.log"
}

stage_structcmp() {  # issue #29: guided decoding's cost on this tree and on .gpu-old/tree,
    # alternating (the host's speed drifts within a call), in one process; then this tree with
    # the engine core in its own process. The model: `random:smollm2-135m` with the bundled
    # tokenizer carried as .gpu-tok (save_pretrained).
    setup_env
    local model=(--model random:smollm2-135m --tokenizer "$PWD/.gpu-tok")
    export PAGEDSERVE_TEST_TOKENIZER=$PWD/.gpu-tok  # the guided CUDA tests without the GGUF
    shard structured tests/structured_output \
        --ignore tests/structured_output/test_server_structured.py
    wait  # the benchmarks alone on the GPU
    echo "GPU tests: $(tail -2 "$OUT/structured.log" | tr '\n' ' ')"
    local round tree tag
    for round in 1 2; do
        for tree in .gpu-old/tree .; do
            tag=new; [ "$tree" = . ] || tag=old
            [ -d "$tree" ] || continue
            (cd "$tree" && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} \
                PAGEDSERVE_ATTENTION_BACKEND=TRITON timeout 200 python3 \
                benchmarks/structured_output.py --device cuda "${model[@]}" --output-len 128 \
                --no-seed --repeats 5 >"$OUT/structcmp-$tag-$round.log" 2>&1
             echo "exit $?" >>"$OUT/structcmp-$tag-$round.log")
            echo "$tag $round: $(grep -h -E 'guided /|fill' "$OUT/structcmp-$tag-$round.log" | tr '\n' ' ')"
        done
    done
    PAGEDSERVE_ATTENTION_BACKEND=TRITON timeout 200 python3 benchmarks/structured_output.py \
        --device cuda "${model[@]}" --output-len 128 --no-seed --repeats 5 --engine-core-process \
        >"$OUT/structcmp-coreproc.log" 2>&1; echo "exit $?" >>"$OUT/structcmp-coreproc.log"
    echo "new, core process: $(grep -h -E '^(un)?guided|guided /' "$OUT/structcmp-coreproc.log" | tr '\n' ' ')"
    # The host phases of a guided step beside an unguided one (batch 64, as above).
    local g
    for g in "" --guided; do
        PAGEDSERVE_ATTENTION_BACKEND=TRITON timeout 150 python3 benchmarks/host_step.py \
            --device cuda "${model[@]}" --num-requests 64 --prompt-len 32 --output-len 128 \
            --no-end-to-end $g >"$OUT/structcmp-hoststep$g.log" 2>&1
        echo "exit $?" >>"$OUT/structcmp-hoststep$g.log"
        grep -v INFO "$OUT/structcmp-hoststep$g.log" | tail -20
    done
}

stage_families() {  # the model families' GPU greedy test (float32 TRITON against transformers)
    setup_env
    shard families tests/models/test_families.py
    wait
}

stage_tqgraphs() {  # TURBOQUANT's graph and prefill GPU tests, then the 8B shape decode-heavy
    # beside bf16 TRITON (TQ_PROMPTS x 128/TQ_OUT; the issue's workload is 1000 x 128/1024)
    setup_env
    [ "${TQ_TESTS:-1}" = 1 ] && shard tq_graphs tests/attention/turboquant/test_graphs.py
    wait
    local kv
    for kv in ${TQ_PRESETS:-auto tq_4bit tq_k8v4 tq_3bit}; do
        local backend=TURBOQUANT
        [ "$kv" = auto ] && backend=TRITON
        timeout "${TQ_TIMEOUT:-120}" python3 -m pagedserve bench throughput \
            --config llama3-8b-random --attention-backend "$backend" \
            --kv-cache-dtype "$kv" --num-prompts "${TQ_PROMPTS:-1000}" --input-len "${TQ_IN:-128}" \
            --output-len "${TQ_OUT:-1024}" >"$OUT/tq-throughput-$kv-${TQ_IN:-128}.log" 2>&1
        echo "exit $?" >>"$OUT/tq-throughput-$kv-${TQ_IN:-128}.log"
        echo "$kv: $(grep -h Throughput "$OUT/tq-throughput-$kv-${TQ_IN:-128}.log")"
    done
}
stage_tp() {  # tensor parallelism on a machine with 2+ GPUs (nvidia-h200-x2): the GPU tests,
    # TP=2 against TP=1 (greedy share, teacher-forced KL), the 8B shape's throughput at TP=1
    # and 2 (prefill- and decode-heavy), the 70B shape at TP=2, and the Ray executor
    setup_env
    [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "stage tp needs 2 GPUs"; return; }
    shard tp tests/distributed/test_tp_gpu.py
    wait
    timeout 300 python3 benchmarks/tp_parity.py --model random:llama3-8b --dtype bfloat16 \
        --tp 2 >"$OUT/tp-parity.log" 2>&1; echo "exit $?" >>"$OUT/tp-parity.log"
    local tp shape
    for tp in 1 2; do
        for shape in 1024:128 128:1024; do
            timeout 240 python3 -m pagedserve bench throughput --config llama3-8b-random \
                --tensor-parallel-size "$tp" --num-prompts 1000 --input-len "${shape%:*}" \
                --output-len "${shape#*:}" >"$OUT/tp$tp-${shape/:/-}.log" 2>&1
            echo "exit $?" >>"$OUT/tp$tp-${shape/:/-}.log"
        done
    done
    timeout 400 python3 -m pagedserve bench throughput --model random:llama3-70b \
        --dtype bfloat16 --tensor-parallel-size 2 --num-prompts 256 --input-len 128 \
        --output-len 512 >"$OUT/tp2-70b.log" 2>&1; echo "exit $?" >>"$OUT/tp2-70b.log"
    timeout 240 python3 -m pagedserve bench throughput --config llama3-8b-random \
        --tensor-parallel-size 2 --distributed-executor-backend ray --num-prompts 1000 \
        --input-len 128 --output-len 1024 >"$OUT/tp2-ray.log" 2>&1
    echo "exit $?" >>"$OUT/tp2-ray.log"
    tail -4 "$OUT/tp-parity.log"
    for f in "$OUT"/tp[12]-*.log; do echo "$(basename "$f"): $(grep -h Throughput "$f")"; done
}
stage_flexbench() {  # the bundled GGUF through bench throughput on FLEX_ATTENTION, TRITON, FLASHINFER
    setup_env
    [ -f "$PAGEDSERVE_TEST_GGUF" ] || { echo "no GGUF at $PAGEDSERVE_TEST_GGUF"; return; }
    local b
    for b in ${FLEXBENCH_BACKENDS:-FLEX_ATTENTION TRITON FLASHINFER}; do
        timeout "${FLEXBENCH_TIMEOUT:-150}" python3 -m pagedserve bench throughput --model "$PAGEDSERVE_TEST_GGUF" \
            --attention-backend "$b" --num-prompts 128 --input-len 128 --output-len 256 \
            >"$OUT/flexbench-$b.log" 2>&1; echo "exit $?" >>"$OUT/flexbench-$b.log"
        tail -4 "$OUT/flexbench-$b.log"
    done
}

stage_moeprofile() {  # issue #47 item 5: the Qwen3-30B-A3B shape's steps (kernel time as the
    # union of the kernels' intervals, the top kernels, the allocator), a quantized KV dtype
    # chosen without naming the backend, and the MoE GEMMs' launch-shape sweep at 2,048 and
    # 8,192 tokens (an H100 needs --gpu-memory-utilization 0.93 for the 30B shape)
    setup_env
    timeout 300 python3 benchmarks/step_profile.py --config qwen3-30b-a3b-random \
        --num-prompts 400 --input-len 1024 --output-len 128 --top 20 \
        --gpu-memory-utilization 0.93 >"$OUT/step_profile.log" 2>&1
    echo "exit $?" >>"$OUT/step_profile.log"; grep -v " INFO " "$OUT/step_profile.log" | tail -30
    timeout 90 python3 -m pagedserve bench throughput --config smollm2-random-gpu \
        --num-prompts 64 --input-len 256 --output-len 64 --kv-cache-dtype tq_4bit \
        >"$OUT/tq-auto.log" 2>&1; echo "exit $?" >>"$OUT/tq-auto.log"
    grep -E "kv_cache_dtype|Throughput|rror" "$OUT/tq-auto.log" | head -5
    timeout 150 python3 benchmarks/moe_kernels.py --sections time --batches 2048,8192 --sweep \
        --top 6 --warmup 3 --iters 20 >"$OUT/moe_sweep.log" 2>&1
    echo "exit $?" >>"$OUT/moe_sweep.log"; grep -v " INFO " "$OUT/moe_sweep.log" | tail -24
}

shard_any() {  # name, pytest args...: every test selected, gpu-marked or not (the unmarked
    # conformance and kernel cases run on CUDA when it is there)
    local name=$1; shift
    ( timeout "$SHARD_TIMEOUT" python3 -m pytest -q -p no:cacheprovider -rs "$@" \
        >"$OUT/$name.log" 2>&1; echo "exit $?" >>"$OUT/$name.log" ) &
}

stage_wave25() {  # the twenty-fifth session's GPU tests (fp8 KV on TRITON, encoder attention,
    # LoRA kernels and graphs, EAGLE/MTP and verify graphs (shard spec), GGUF and 4-bit expert
    # kernels), then the GGUF and int4 linear benchmarks; the images' GPU tests beside the graphs'
    setup_env
    SHARD_TIMEOUT=${WAVE_TIMEOUT:-330}
    shard_any fp8kv tests/attention/test_conformance.py tests/models/test_kv_scales.py -k fp8
    shard encoder tests/attention/test_encoder_attention.py tests/pooling/test_cross_encoders.py \
        tests/pooling/test_embed.py
    shard_any lora tests/lora/test_lora_kernels.py tests/lora/test_lora_cuda_graphs.py
    shard spec tests/spec_decode tests/attention/test_flashinfer_verify.py
    shard quant tests/quantization/test_gguf_kernels.py tests/quantization/test_w4_moe_kernels.py \
        tests/quantization/test_w4a16_kernel.py tests/quantization/test_random_fp8.py
    shard graphs tests/engine/test_cuda_graphs.py tests/multimodal
    wait
    [ "${WAVE_BENCH:-1}" = 1 ] || return 0  # WAVE_BENCH=0: the tests alone (a short call)
    timeout 100 python3 benchmarks/gguf_linear.py >"$OUT/gguf_linear.log" 2>&1
    echo "exit $?" >>"$OUT/gguf_linear.log"; tail -12 "$OUT/gguf_linear.log"
    timeout 100 python3 benchmarks/int4_linear.py --tokens 1,16,256 >"$OUT/int4_linear.log" 2>&1
    echo "exit $?" >>"$OUT/int4_linear.log"; tail -20 "$OUT/int4_linear.log"
}

stage_wave25bench() {  # issue #54's LoRA rows on the 8B shape (EAGLE-3's: wave25eagle): ~360 s
    # on an H100 with FlashInfer's kernels built
    setup_env
    timeout 480 python3 benchmarks/lora_engine.py --json "$OUT/lora.json" \
        >"$OUT/lora_engine.log" 2>&1
    echo "exit $?" >>"$OUT/lora_engine.log"; tail -6 "$OUT/lora_engine.log"
}

stage_wave25eagle() {  # issue #49's EAGLE-3 row on the 8B shape twice: the default backend
    # (FLASHINFER on CUDA, verify graphs through its graph prefill wrappers) and TRITON;
    # EAGLE_PROFILE=1: batch 1 again under the profilers (GPU busy share, host functions, syncs)
    setup_env
    local backend args
    for backend in ${EAGLE_BACKENDS:-default TRITON}; do
        args='{}'
        [ "$backend" = default ] || args="{\"attention_backend\": \"$backend\"}"
        timeout ${EAGLE_TIMEOUT:-250} python3 benchmarks/spec_decode.py --model random:llama3-8b \
            --random-prompts 128 --random-eagle3-head 32000 --batch-sizes 1 32 \
            --output-len 128 --repeats 1 --engine-args "$args" ${EAGLE_PROFILE:+--profile} \
            --speculative-config '{"method": "eagle3", "num_speculative_tokens": 3, "model": "-",
                "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 0.8}' \
            >"$OUT/eagle3-$backend.log" 2>&1
        echo "exit $?" >>"$OUT/eagle3-$backend.log"
        grep -E "verify|graphs|backend" "$OUT/eagle3-$backend.log" | grep -v " DEBUG " | head -4
        grep -v " INFO " "$OUT/eagle3-$backend.log" | grep -A8 "^batch" | head -12
        [ -n "${EAGLE_PROFILE-}" ] && grep -v " INFO " "$OUT/eagle3-$backend.log" \
            | sed -n '/^profiled/,$p' | head -70
        tail -1 "$OUT/eagle3-$backend.log"
    done
}

stage_rerun27() {  # the gpu tests that failed at the twenty-seventh session's first call
    # (memory profiles counting another engine's cache, heads under 64, CPU tensors given to
    # compiled kernels), in parallel shards of small caches
    setup_env
    SHARD_TIMEOUT=${WAVE_TIMEOUT:-240}
    shard spec tests/spec_decode tests/attention/test_flashinfer_verify.py
    shard_any lora tests/lora/test_lora_kernels.py tests/lora/test_lora_cuda_graphs.py
    shard embed tests/pooling/test_embed.py tests/multimodal/test_llava.py
    shard fp8 tests/quantization/test_random_fp8.py
    wait
}

stage_first29() {  # the first call after four sessions without one: every gpu test no call has
    # run yet, in parallel shards (correctness before speed), then the FP8 decode rows
    setup_env
    SHARD_TIMEOUT=${WAVE_TIMEOUT:-200}
    shard spec tests/spec_decode tests/attention/test_flashinfer_verify.py
    shard_any lora tests/lora/test_lora_kernels.py tests/lora/test_lora_cuda_graphs.py
    shard embed tests/pooling/test_embed.py tests/multimodal/test_llava.py
    shard quant tests/quantization/test_random_fp8.py tests/quantization/test_fp8_small_m.py \
        tests/quantization/test_w4a16_kernel.py
    shard piecewise tests/engine/test_piecewise_cuda.py
    wait
}

stage_rerun30() {  # first29's two shards that ran out of time (the thirtieth session's one
    # call): spec with its failures' tracebacks (three failed there), and quant
    setup_env
    SHARD_TIMEOUT=${WAVE_TIMEOUT:-240}
    shard spec tests/spec_decode tests/attention/test_flashinfer_verify.py -v --tb=short \
        --maxfail=4 --durations=10
    shard quant tests/quantization/test_random_fp8.py tests/quantization/test_fp8_small_m.py \
        tests/quantization/test_w4a16_kernel.py -v --tb=short --durations=10
    wait
    grep -E "FAILED|PASSED|Error|error|passed|failed|exit" "$OUT/spec.log" | tail -40
    grep -E "FAILED|Error|passed|failed|exit" "$OUT/quant.log" | tail -15
}

stage_rerun31() {  # the three gpu tests mended after the thirtieth session's call, unrun since
    setup_env
    timeout "${WAVE_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
        tests/spec_decode/test_engine.py tests/spec_decode/test_state_layer_drafts.py \
        -k "test_cuda_greedy_equals or on_cuda_equals" --tb=short >"$OUT/rerun31.log" 2>&1
    echo "exit $?" >>"$OUT/rerun31.log"; tail -15 "$OUT/rerun31.log"
}

stage_lora31() {  # LoRA's grouped kernels (the thirty-first session's): their GPU tests, their
    # time beside the base projections (8B shape), then issue #54's rows (wave25bench)
    setup_env
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/lora/test_lora_kernels.py \
        tests/lora/test_lora_cuda_graphs.py >"$OUT/lora-tests.log" 2>&1
    echo "exit $?" >>"$OUT/lora-tests.log"; tail -4 "$OUT/lora-tests.log"
    timeout 150 python3 benchmarks/lora_kernels.py >"$OUT/lora_kernels.log" 2>&1
    echo "exit $?" >>"$OUT/lora_kernels.log"; tail -50 "$OUT/lora_kernels.log"
    stage_wave25bench
}

stage_lora32() {  # lora31 split for a fresh machine: LoRA's GPU tests (and the sampler's)
    # beside a small 8B engine run that builds FlashInfer's modules (export then keeps them for the next call),
    # then the kernels' time beside the base projections; issue #54's rows are wave25bench's
    setup_env
    timeout 240 python3 benchmarks/lora_engine.py --num-prompts 16 --output-len 16 \
        --skip one,mixed --no-warmup >"$OUT/fi-warm.log" 2>&1 &
    local warm=$!
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/lora/test_lora_kernels.py \
        tests/lora/test_lora_cuda_graphs.py tests/engine/test_sampler.py \
        >"$OUT/lora-tests.log" 2>&1
    echo "exit $?" >>"$OUT/lora-tests.log"; tail -4 "$OUT/lora-tests.log"
    wait $warm; echo "exit $?" >>"$OUT/fi-warm.log"; tail -3 "$OUT/fi-warm.log"
    timeout 150 python3 benchmarks/lora_kernels.py >"$OUT/lora_kernels.log" 2>&1
    echo "exit $?" >>"$OUT/lora_kernels.log"; tail -50 "$OUT/lora_kernels.log"
}

stage_call32() {  # the thirty-second session's changes on a GPU: their tests, the embeddings'
    # host phases, the LoRA kernels' sweep and #54's rows under its best shape, then EAGLE-3
    # on FLASHINFER and the FP8 batch-1 row while CALL_LIMIT (default 580) seconds allow. A
    # shorter call runs the parts it can afford, e.g. `install call32tests lorarows`.
    stage_call32tests
    stage_embedphases
    stage_lorasweep
    stage_lorarows
    [ $(( ${CALL_LIMIT:-580} - SECONDS )) -gt 60 ] && EAGLE_BACKENDS=default EAGLE_PROFILE=1 \
        stage_wave25eagle
    [ $(( ${CALL_LIMIT:-580} - SECONDS )) -gt 70 ] && stage_fp8engine
    return 0
}

stage_call33() {  # call32's parts, EAGLE-3 first (both backends, profiled: the verify and
    # proposer steps no longer wait on blocking copies), then the LoRA sweep and rows, the
    # embeddings' phases and the FP8 batch-1 row while CALL_LIMIT (default 580) allows
    stage_call32tests
    EAGLE_BACKENDS="default TRITON" EAGLE_PROFILE=1 EAGLE_TIMEOUT=170 stage_wave25eagle
    [ $(( ${CALL_LIMIT:-580} - SECONDS )) -gt 200 ] && stage_lorasweep && stage_lorarows
    stage_embedphases
    [ $(( ${CALL_LIMIT:-580} - SECONDS )) -gt 70 ] && stage_fp8engine
    return 0
}

stage_call32tests() {  # the gpu tests of the thirty-second session's changes, in parallel
    setup_env
    SHARD_TIMEOUT=${WAVE_TIMEOUT:-120}
    shard_any lora tests/lora/test_lora_kernels.py tests/lora/test_lora_cuda_graphs.py \
        tests/engine/test_sampler.py
    shard verify tests/attention/test_flashinfer_verify.py tests/quantization/test_random_fp8.py
    wait
    tail -2 "$OUT/lora.log" "$OUT/verify.log"
}

stage_embedphases() {  # where LLM.embed's host time goes (bge-base, 10,000 x 256 tokens),
    # within what is left of CALL_LIMIT; FLASH_ATTN: FlashInfer's head-64 ragged prefill
    # would compile (~90 s) on a fresh machine
    setup_env
    local left=$(( ${CALL_LIMIT:-580} - SECONDS - 5 ))
    [ "$left" -gt 40 ] || { echo "embedphases skipped: ${left} s left"; return 0; }
    [ "$left" -lt 80 ] || left=80
    PAGEDSERVE_ATTENTION_BACKEND=FLASH_ATTN timeout "$left" python3 \
        benchmarks/embed_throughput.py --device cuda --dtype bfloat16 --shape bge-base \
        --num-texts 10000 --tokens 256 --st-batch-sizes 256 --phases \
        >"$OUT/embed-phases.log" 2>&1
    echo "exit $?" >>"$OUT/embed-phases.log"
    grep -E "texts/s|phases:|host syncs|^  +[0-9]+  |exit" "$OUT/embed-phases.log"
    grep -A22 "Ordered by" "$OUT/embed-phases.log" | tail -20
}

stage_embed52() {  # #52's embeddings after the host cuts and the encoder's fused kernels: their
    # gpu tests, the fused kernels against torch's at a step (encoder_kernels.py), then
    # bge-base's LLM.embed with --phases (the device's busy time a step too), once more with
    # the GELU in the GEMM's epilogue (PAGEDSERVE_APPROXIMATE_GELU=1) and once with the engine
    # core in its own process, within CALL_LIMIT
    setup_env
    SHARD_TIMEOUT=${WAVE_TIMEOUT:-150}
    shard embed52 tests/models/test_layer_kernels.py tests/pooling/test_encoders.py \
        tests/attention/test_encoder_attention.py tests/pooling/test_embed.py \
        tests/pooling/test_cross_encoders.py
    wait
    tail -3 "$OUT/embed52.log"
    timeout 60 python3 benchmarks/encoder_kernels.py 2>&1 | tail -7
    local args="--device cuda --dtype bfloat16 --shape bge-base --num-texts 10000 --tokens 256"
    local left=$(( ${CALL_LIMIT:-580} - SECONDS - 5 ))
    [ "$left" -gt 60 ] || { echo "embed52 rows skipped: ${left} s left"; return 0; }
    PAGEDSERVE_ATTENTION_BACKEND=FLASH_ATTN PAGEDSERVE_DEVICE_TIMING=1 timeout "$left" python3 \
        benchmarks/embed_throughput.py $args --st-batch-sizes 256 --phases \
        >"$OUT/embed52-phases.log" 2>&1
    echo "exit $?" >>"$OUT/embed52-phases.log"
    grep -E "texts/s|phases:|host syncs|^  +[0-9]+  |exit" "$OUT/embed52-phases.log"
    grep -A22 "Ordered by" "$OUT/embed52-phases.log" | tail -20
    left=$(( ${CALL_LIMIT:-580} - SECONDS - 5 ))
    [ "$left" -gt 60 ] || { echo "embed52 tanh-GELU row skipped: ${left} s left"; return 0; }
    PAGEDSERVE_ATTENTION_BACKEND=FLASH_ATTN PAGEDSERVE_APPROXIMATE_GELU=1 timeout "$left" python3 \
        benchmarks/embed_throughput.py $args --st-batch-sizes 256 \
        >"$OUT/embed52-tanh-gelu.log" 2>&1
    echo "exit $?" >>"$OUT/embed52-tanh-gelu.log"
    grep -E "texts/s|exit" "$OUT/embed52-tanh-gelu.log"
    left=$(( ${CALL_LIMIT:-580} - SECONDS - 5 ))
    [ "$left" -gt 60 ] || { echo "embed52 core-process row skipped: ${left} s left"; return 0; }
    PAGEDSERVE_ATTENTION_BACKEND=FLASH_ATTN timeout "$left" python3 \
        benchmarks/embed_throughput.py $args --st-batch-sizes 256 --engine-core-process \
        >"$OUT/embed52-core-process.log" 2>&1
    echo "exit $?" >>"$OUT/embed52-core-process.log"
    grep -E "texts/s|exit" "$OUT/embed52-core-process.log"
}

stage_lorasweep() {  # the LoRA kernels' launch shapes at 256 tokens; its last line ("best:")
    # is what lorarows runs under
    setup_env
    timeout 70 python3 benchmarks/lora_kernels.py --sweep --tokens 256 \
        >"$OUT/lora_sweep.log" 2>&1
    echo "exit $?" >>"$OUT/lora_sweep.log"; tail -16 "$OUT/lora_sweep.log"
}

stage_lorarows() {  # issue #54's base and one-adapter rows, under lorasweep's best shape when
    # it ran (else the defaults), in what is left of CALL_LIMIT
    setup_env
    local tiles left=$(( ${CALL_LIMIT:-580} - SECONDS - 5 ))
    tiles=$(sed -n 's/^best: //p' "$OUT/lora_sweep.log" 2>/dev/null)
    echo "LoRA rows: ${left} s left"
    timeout "$left" python3 benchmarks/lora_engine.py --skip mixed --json "$OUT/lora.json" \
        ${tiles:+--lora-tiles "$tiles"} >"$OUT/lora_engine.log" 2>&1
    echo "exit $?" >>"$OUT/lora_engine.log"; grep -v " INFO " "$OUT/lora_engine.log" | tail -6
}

stage_fp8linear() {  # fp8dec's per-projection times and launch-shape sweep alone (14 rows
    # took 270 s on an H100)
    setup_env
    timeout 270 python3 benchmarks/fp8_linear.py --models 8b --tokens 1,4,16 --sweep-small-m \
        --json "$OUT/fp8_linear.json" >"$OUT/fp8_linear.log" 2>&1
    echo "exit $?" >>"$OUT/fp8_linear.log"; tail -30 "$OUT/fp8_linear.log"
}

stage_fp8engine() {  # fp8dec's 8B batch-1 decode and KL, bf16 against FP8, alone
    setup_env
    timeout 240 python3 benchmarks/quant_engine.py --skip throughput --quality-prompts 8 \
        --json "$OUT/fp8_engine.json" >"$OUT/fp8_engine.log" 2>&1
    echo "exit $?" >>"$OUT/fp8_engine.log"; tail -12 "$OUT/fp8_engine.log"
}

stage_int4engine() {  # issue #50's W4A16 rows, 8B shape: random GPTQ int4 weights (group 128,
    # symmetric; quantization/random_packed.py) on the W4A16 kernel against bf16 on the same
    # weights: weight memory, KL, batch rows 1/16/64/256 (x 256 out), batch-1 decode
    setup_env
    printf '%s' '{"base": "llama3-8b", "quantization_config": {"quant_method": "gptq",
        "bits": 4, "group_size": 128, "sym": true, "desc_act": false}}' >/tmp/llama3-8b-gptq.json
    PAGEDSERVE_W4A16_KERNEL=1 timeout ${INT4_TIMEOUT:-400} python3 benchmarks/quant_engine.py \
        --quantized random:/tmp/llama3-8b-gptq.json --skip throughput --quality-prompts 8 \
        --batch-rows 1,16,64,256 --json "$OUT/int4_engine.json" >"$OUT/int4_engine.log" 2>&1
    echo "exit $?" >>"$OUT/int4_engine.log"; grep -v " INFO " "$OUT/int4_engine.log" | tail -14
}

stage_int4call() {  # #50's W4A16 path after the kernel's rework: the launch-shape sweep over
    # the 8B projections in CUDA graphs (M 1..256; the winners to $OUT/w4a16_tiles.json), the
    # per-projection table, the engine rows under the swept tiles (TRITON attention:
    # FlashInfer's modules would compile on a fresh machine; bf16 runs under the same), the
    # GGUF step (Q4_K_M layout, now on the same kernel), then the gpu tests of both
    setup_env
    timeout ${SWEEP_TIMEOUT:-240} python3 benchmarks/int4_linear.py --sweep \
        --tokens 1,16,64,256,1024,8192 --write-tiles "$OUT/w4a16_tiles.json" \
        --json "$OUT/int4_linear.json" >"$OUT/int4_linear.log" 2>&1
    echo "exit $?" >>"$OUT/int4_linear.log"; grep -v "^  M=" "$OUT/int4_linear.log" | tail -36
    [ -f "$OUT/w4a16_tiles.json" ] && export PAGEDSERVE_W4A16_TILES=$OUT/w4a16_tiles.json
    PAGEDSERVE_ATTENTION_BACKEND=TRITON INT4_TIMEOUT=${INT4_TIMEOUT:-170} stage_int4engine
    timeout 80 python3 benchmarks/gguf_linear.py --shape 8b --tokens 1,16 \
        >"$OUT/gguf_linear.log" 2>&1
    echo "exit $?" >>"$OUT/gguf_linear.log"; tail -4 "$OUT/gguf_linear.log"
    local left=$(( ${CALL_LIMIT:-580} - SECONDS - 5 ))
    [ "$left" -gt 30 ] || { echo "gpu tests skipped: ${left} s left"; return 0; }
    timeout "$left" python3 -m pytest -q -x -m gpu tests/quantization/test_w4a16_kernel.py \
        tests/quantization/test_gguf_kernels.py >"$OUT/w4a16-tests.log" 2>&1
    echo "exit $?" >>"$OUT/w4a16-tests.log"; tail -3 "$OUT/w4a16-tests.log"
}

stage_mxfp4engine() {  # issue #50's MXFP4 rows: the gpt-oss-20b shape, random MXFP4 experts
    # (quantization/random_packed.py) on the 4-bit MoE kernel against bf16 on the same weights
    # at batch 1 and 64; then gpt-oss-120b in MXFP4 alone (its weight memory, 1,000 x
    # 128/1,024; an H100 may not hold its KV cache beside the 65 GB of weights)
    setup_env
    local size
    for size in 20b 120b; do
        printf '%s' "{\"base\": \"gpt-oss-$size\", \"quantization_config\": {
            \"quant_method\": \"mxfp4\"}}" >/tmp/gpt-oss-$size-mxfp4.json
    done
    PAGEDSERVE_W4A16_KERNEL=1 timeout ${MXFP4_TIMEOUT:-300} python3 benchmarks/quant_engine.py \
        --model random:gpt-oss-20b --quantized random:/tmp/gpt-oss-20b-mxfp4.json \
        --skip throughput --quality-prompts 8 --batch-rows 1,64 \
        --json "$OUT/mxfp4_20b.json" >"$OUT/mxfp4_20b.log" 2>&1
    echo "exit $?" >>"$OUT/mxfp4_20b.log"; grep -v " INFO " "$OUT/mxfp4_20b.log" | tail -12
    PAGEDSERVE_W4A16_KERNEL=1 timeout ${MXFP4_TIMEOUT:-300} python3 benchmarks/quant_engine.py \
        --model random:gpt-oss-120b --quantized random:/tmp/gpt-oss-120b-mxfp4.json \
        --skip-bf16 --skip quality,decode --json "$OUT/mxfp4_120b.json" \
        >"$OUT/mxfp4_120b.log" 2>&1
    echo "exit $?" >>"$OUT/mxfp4_120b.log"; grep -v " INFO " "$OUT/mxfp4_120b.log" | tail -8
}

stage_ggufengine() {  # issue #50's GGUF row: a random Q4_K_M-layout 8B GGUF, kept quantized
    # (--quantization gguf) against the same file dequantized to bf16 at load: weight bytes,
    # batch-1 decode (the dense load dequantizes ~7.5B values in numpy: a minute or two)
    setup_env
    PAGEDSERVE_GGUF_KERNEL=1 timeout ${GGUF_TIMEOUT:-450} python3 benchmarks/gguf_engine.py \
        --json "$OUT/gguf_engine.json" >"$OUT/gguf_engine.log" 2>&1
    echo "exit $?" >>"$OUT/gguf_engine.log"; grep -v " INFO " "$OUT/gguf_engine.log" | tail -8
}

stage_specrows() {  # issue #49's MTP row (the DeepSeek-V2-Lite shape with a random V3-style
    # MTP layer, K = 1, synthetic mean length 1.8, batch 1) and, when the bundled GGUF was
    # carried (.gpu-smol-a/b), its n-gram row (chat prompts that repeat a passage, batch 1, 64)
    setup_env
    timeout ${SPEC_TIMEOUT:-240} python3 benchmarks/spec_decode.py --model random:deepseek-v2-lite \
        --random-prompts 128 --batch-sizes 1 --output-len 128 --repeats 1 \
        --speculative-config '{"method": "mtp", "num_speculative_tokens": 1,
            "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 0.8}' \
        >"$OUT/mtp.log" 2>&1
    echo "exit $?" >>"$OUT/mtp.log"; grep -v " INFO " "$OUT/mtp.log" | grep -A2 "^batch"
    [ -f "$PAGEDSERVE_TEST_GGUF" ] || { echo "n-gram row skipped: no bundled GGUF"; return 0; }
    timeout ${SPEC_TIMEOUT:-240} python3 benchmarks/spec_decode.py --model "$PAGEDSERVE_TEST_GGUF" \
        --batch-sizes 1 64 --repeats 3 >"$OUT/ngram.log" 2>&1
    echo "exit $?" >>"$OUT/ngram.log"; grep -v " INFO " "$OUT/ngram.log" | grep -A2 "^batch"
}

stage_wave25rej() {  # issue #49's rejection sampler: torch against the Triton kernel, B
    # 1..256, K 1..4, V 128,256 (both paths' tokens checked equal on every row)
    setup_env
    timeout 300 python3 benchmarks/rejection_sampler.py --json "$OUT/rejection.json" \
        >"$OUT/rejection.log" 2>&1
    echo "exit $?" >>"$OUT/rejection.log"; tail -64 "$OUT/rejection.log"
}

stage_wave25embed() {  # issue #52's rows: bge-base and Qwen3-Embedding-0.6B shapes beside
    # sentence-transformers, and /v1/embeddings at 16 texts a request (~390 s on an H100;
    # EMBED_PROFILE=1: LLM.embed again under the profiler, its kernels' busy share)
    setup_env
    local shape
    for shape in bge-base qwen3-0.6b; do
        timeout 200 python3 benchmarks/embed_throughput.py --device cuda --dtype bfloat16 \
            --shape $shape --num-texts 10000 --tokens 256 --st-batch-sizes 32,64,128,256 \
            --serve-batch 16 ${EMBED_PROFILE:+--profile} >"$OUT/embed-$shape.log" 2>&1
        echo "exit $?" >>"$OUT/embed-$shape.log"
        grep -E "texts/s|exit|profiled|^  " "$OUT/embed-$shape.log"
    done
}

stage_fp8dec() {  # issue #48's batch-1 row: the small-M FP8 kernel's GPU tests, its per-projection
    # times and launch-shape sweep at M 1..16 (8B shapes), then the 8B engine's batch-1 decode
    # and teacher-forced KL, bf16 against FP8 on the same weights
    setup_env
    timeout 150 python3 -m pytest -q -m gpu tests/quantization/test_fp8_small_m.py \
        >"$OUT/fp8-small-m-tests.log" 2>&1
    echo "exit $?" >>"$OUT/fp8-small-m-tests.log"; tail -4 "$OUT/fp8-small-m-tests.log"
    timeout 270 python3 benchmarks/fp8_linear.py --models 8b --tokens 1,4,16 --sweep-small-m \
        --json "$OUT/fp8_linear.json" >"$OUT/fp8_linear.log" 2>&1
    echo "exit $?" >>"$OUT/fp8_linear.log"; tail -30 "$OUT/fp8_linear.log"
    timeout 240 python3 benchmarks/quant_engine.py --skip throughput --quality-prompts 8 \
        --json "$OUT/fp8_engine.json" >"$OUT/fp8_engine.log" 2>&1
    echo "exit $?" >>"$OUT/fp8_engine.log"; tail -12 "$OUT/fp8_engine.log"
}

stage_vlm() {  # issue #53's row: the Qwen2.5-VL-7B shape beside transformers' generate
    setup_env
    timeout 420 python3 benchmarks/vlm_throughput.py --json "$OUT/vlm.json" \
        >"$OUT/vlm.log" 2>&1
    echo "exit $?" >>"$OUT/vlm.log"; grep -v " INFO " "$OUT/vlm.log" | tail -14
}

stage_piecewise() {  # issue #47 item 5: piecewise CUDA graphs' GPU tests, then the Qwen3-30B-A3B
    # shape's 8,192-token prefill step (the forward's host launch) and 600 x 1,024/128 on one
    # engine, its prefill and mixed steps eager then piecewise (600 prompts, not 1,000: the
    # stage stays under ~450 s; an H100 needs --gpu-memory-utilization 0.93 for the 30B shape)
    stage_piecewisetests
    stage_piecewisebench
}

stage_piecewisetests() {  # the piecewise stage's GPU tests alone
    setup_env
    timeout 150 python3 -m pytest -q -m gpu tests/engine/test_piecewise_cuda.py \
        >"$OUT/piecewise-tests.log" 2>&1
    echo "exit $?" >>"$OUT/piecewise-tests.log"; tail -4 "$OUT/piecewise-tests.log"
}

stage_piecewisebench() {  # the piecewise stage's benchmark alone
    setup_env
    timeout 300 python3 benchmarks/moe_host.py --piecewise --rounds 1 --num-prompts 600 \
        --gpu-memory-utilization 0.93 >"$OUT/moe_host_piecewise.log" 2>&1
    echo "exit $?" >>"$OUT/moe_host_piecewise.log"
    grep -iE "piecewise (cuda )?graph" "$OUT/moe_host_piecewise.log" | head -4
    grep -v " INFO " "$OUT/moe_host_piecewise.log" | tail -10
}

# SKIP_AFTER=S: a stage that would start after S seconds of the call is skipped (named in the
# output), so that a call of several stages still ends inside its limit with its summary.
for stage in "$@"; do
    if [ "$SECONDS" -ge "${SKIP_AFTER:-1000000}" ]; then
        echo "=== $stage skipped: $SECONDS s into the call"; continue
    fi
    echo "=== $stage $(date +%T)"
    "stage_$stage"
done
echo "=== summary $(date +%T)"
for f in "$OUT"/*.log; do
    [ "$(basename "$f")" = install.log ] && continue
    echo "--- $(basename "$f")"
    grep -E "passed|failed|error|exit [0-9]+" "$f" | tail -3
done
# A call brings back at most 8 files from $OUT: the logs travel as one archive (unpack with
# `tar xzf logs.tgz`); the kernels archive of `export` stays beside it.
if [ -n "${OUT_ARCHIVE-1}" ] && ls "$OUT"/*.log >/dev/null 2>&1; then
    tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log) && rm -f "$OUT"/*.log
fi
