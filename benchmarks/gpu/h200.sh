#!/usr/bin/env bash
# The H200 runs, in the phases the device tool's calls allow (see benchmarks/README.md).
# Expects vLLM 0.26 staged into /tmp/site (../shared/gpu/stage_vllm.sh) and the data the
# calls carried under /tmp/data: conv-26.json, tok/ (SmolLM2 tokenizer), minilm/ (fp16).
# Each phase writes its results and logs to $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export INFERSCALE_HOME=/tmp/inferscale-home INFERSCALE_EMBEDDER_PATH=/tmp/data/minilm
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
D=/tmp/data
run() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc"; tail -n 4 "$OUT/$name.log"
}
case "${1:-}" in
  tests)  # the CUDA paths of the unit tests (those needing MiniLM run in `retrieval`)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    run gpu-tests 200 python -m pytest -q -p no:cacheprovider tests/encode/test_rope.py \
      tests/hydrate/test_resident.py tests/vllm_plugin/test_inject.py tests/hydrate/test_slab.py \
      tests/vllm_plugin/test_kernels.py \
      -k "cuda or CUDA or gpu"
    ;;
  encode-hydrate)
    run encode-h200 300 python benchmarks/encode.py --model llama-3.1-8b-shape --device cuda \
      --conversation $D/conv-26.json --tokenizer $D/tok --out "$OUT/encode-h200.json"
    run hydrate-h200 150 python benchmarks/hydrate.py --device cuda --size-gb 4 \
      --root /tmp/hydrate-bench --out "$OUT/hydrate-h200.json"
    ;;
  retrieval-ttft-llama)
    run gpu-tests-retrieval 120 python -m pytest -q -p no:cacheprovider tests/serve/test_retrieval.py \
      -k cuda
    run retrieval-h200 120 python benchmarks/retrieval.py --device cuda \
      --embedder-path $D/minilm --out "$OUT/retrieval-h200.json"
    run ttft-h200-llama31-8b 420 python benchmarks/ttft.py --model llama-3.1-8b-shape \
      --conversation $D/conv-26.json --tokenizer $D/tok --embedder $D/minilm \
      --out "$OUT/ttft-h200-llama31-8b.json"
    ;;
  ttft-llama)  # TTFT alone (the fused Triton injection; its self-check is in the log)
    run ttft-h200-llama31-8b 420 python benchmarks/ttft.py --model llama-3.1-8b-shape \
      --conversation $D/conv-26.json --tokenizer $D/tok --embedder $D/minilm \
      --out "$OUT/ttft-h200-llama31-8b.json"
    grep -h "fused injection" "$OUT"/ttft-h200-llama31-8b.log | tail -n 1
    ;;
  ttft-qwen)
    run ttft-h200-qwen3-14b 540 python benchmarks/ttft.py --model qwen3-14b-shape \
      --conversation $D/conv-26.json --tokenizer $D/tok --embedder $D/minilm \
      --out "$OUT/ttft-h200-qwen3-14b.json"
    grep -h "fused injection" "$OUT"/ttft-h200-qwen3-14b.log | tail -n 1
    ;;
  *) echo "usage: $0 tests|encode-hydrate|retrieval-ttft-llama|ttft-llama|ttft-qwen"; exit 2 ;;
esac
