#!/bin/bash
# One vs two (and four) GPUs (NCCL) serving one model, as docs/distributed.md describes; run from
# the repository root on a 2- or 4-GPU machine once MLX is installed (/work/shared/gpu/README.md).
# Writes into RESULTS: the collectives' costs, `mlxserve bench serve` results (1 GPU and each
# width in WIDTHS side by side, per model) and the servers' logs. SMALL/BIG/HUGE name the models;
# HUGE (too large for one GPU) runs across HUGE_RANKS GPUs with --parallel HUGE_PARALLEL.
# STEPS picks what runs (collectives, convert, small, big, huge); BACKEND=ring (with CPU
# ranks) dry-runs it on a CPU with tiny models.
#   benchmarks/distributed/gpu.sh RESULTS
set -u
R=${1:?results folder}
mkdir -p "$R"
BACKEND=${BACKEND:-nccl}
M=${MODELS:-$HOME/models}
SMALL=${SMALL:-qwen3-4b}
BIG=${BIG:-benchmarks/distributed/qwen3-32b.json}
HUGE=${HUGE:-benchmarks/distributed/qwen2-45b.json}
DTYPE=${DTYPE:-bfloat16}
LOW=${LOW:-1,4}; LOW_N=${LOW_N:-8}; HIGH=${HIGH:-16,32}; HIGH_N=${HIGH_N:-32}; OUT_LEN=${OUT_LEN:-64}
PY=${PY:-python3}
WIDTHS=${WIDTHS:-2}
HUGE_RANKS=${HUGE_RANKS:-2}; HUGE_PARALLEL=${HUGE_PARALLEL:-tensor}
STEPS=${STEPS:-collectives convert small big huge}
step() { case " $STEPS " in *" $1 "*) return 0;; *) return 1;; esac; }
QUANT=${QUANT---quantize 4}  # empty: unquantized (a CPU dry run's tiny models)
mkdir -p "$M"
log() { echo "$(date +%T) $*" | tee -a "$R/progress.log"; }

rank_env() {  # rank world-size port: what mlx.launch sets for this backend
  if [ "$BACKEND" = nccl ]; then
    echo "CUDA_VISIBLE_DEVICES=$1 MLX_RANK=$1 MLX_WORLD_SIZE=$2 NCCL_HOST_IP=127.0.0.1 NCCL_PORT=$(( $3 + 100 ))"
  else
    local hf="$R/hosts-$3.json"
    $PY -c "import json,sys; n,p=int(sys.argv[1]),int(sys.argv[2]); print(json.dumps([[f'127.0.0.1:{p+200+i}'] for i in range(n)]))" "$2" "$3" > "$hf"
    echo "MLX_RANK=$1 MLX_HOSTFILE=$hf"
  fi
}

serve() {  # ranks port model args...: start the ranks in the background
  local n=$1 port=$2 model=$3; shift 3
  for r in $(seq 0 $(( n - 1 ))); do
    if [ "$n" = 1 ]; then env_=""; [ "$BACKEND" = nccl ] && env_="CUDA_VISIBLE_DEVICES=0"
    else env_=$(rank_env "$r" "$n" "$port"); fi
    env $env_ setsid $PY -m mlxserve serve "$model" --port "$port" --max-num-seqs 32 --warmup 0 "$@" \
      > "$R/serve-$port-r$r.log" 2>&1 &
    echo $! >> "$R/pids-$port"
  done
}

wait_up() {  # port seconds
  for _ in $(seq 1 $(( $2 * 2 ))); do
    curl -sf "http://127.0.0.1:$1/health" | grep -q '"status":"ok"' && return 0
    for p in $(cat "$R/pids-$1"); do
      kill -0 "$p" 2>/dev/null || { log "a rank of the server on $1 exited"; return 1; }
    done
    sleep 0.5
  done
  log "server on $1 did not start"; return 1
}

stop() {  # port
  [ -f "$R/pids-$1" ] && for p in $(cat "$R/pids-$1"); do kill "$p" 2>/dev/null; done
  sleep 3
  [ -f "$R/pids-$1" ] && for p in $(cat "$R/pids-$1"); do kill -9 "$p" 2>/dev/null; done
  rm -f "$R/pids-$1"
}

bench() {  # label urls labels
  $PY -m mlxserve bench serve --url "$2" --label "$3" --endpoint completions --input-len 128 \
    --output-len "$OUT_LEN" --concurrency "$LOW" --requests "$LOW_N" --out-dir "$R/$1-low" > "$R/bench-$1-low.txt" 2>&1
  $PY -m mlxserve bench serve --url "$2" --label "$3" --endpoint completions --input-len 128 \
    --output-len "$OUT_LEN" --concurrency "$HIGH" --requests "$HIGH_N" --out-dir "$R/$1-high" > "$R/bench-$1-high.txt" 2>&1
}

stats() {  # port file: every rank's memory and the cache's, as the server reports them
  curl -s "http://127.0.0.1:$1/v1/cache/stats" > "$R/$2" || true
}

for w in $WIDTHS; do
  step collectives || break
  log "collectives ($BACKEND, $w ranks)"
  for r in $(seq 0 $(( w - 1 ))); do
    env $(rank_env "$r" "$w" $(( 29400 + 10 * w ))) $PY benchmarks/distributed/collectives.py "$BACKEND" \
      > "$R/collectives-$w-r$r.json" 2> "$R/collectives-$w-r$r.err" &
  done
  wait
done

if step convert; then
  log "models: $SMALL and $BIG as 4-bit folders"
  [ -d "$M/small" ] || env $([ "$BACKEND" = nccl ] && echo CUDA_VISIBLE_DEVICES=0) $PY -m mlxserve convert --load-format dummy "$SMALL" $QUANT --dtype "$DTYPE" --out-dir "$M/small" > "$R/convert-small.log" 2>&1 &
  [ -d "$M/big" ] || env $([ "$BACKEND" = nccl ] && echo CUDA_VISIBLE_DEVICES=1) $PY -m mlxserve \
    convert --load-format dummy "$BIG" $QUANT --dtype "$DTYPE" --out-dir "$M/big" > "$R/convert-big.log" 2>&1 &
  wait
  log "converted"
fi

for which in small big; do
  step "$which" || continue
  if [ "${SEQUENTIAL:-0}" = 1 ]; then
    # One server at a time: an idle distributed server still polls its ranks with a collective
    # (engine/plans.py), which would take GPU time from a server measured beside it.
    for w in 1 $WIDTHS; do
      log "$which: $w GPU(s) alone (port 8101)"
      serve "$w" 8101 "$M/$which"
      if wait_up 8101 600; then
        bench "$which-$w" "http://127.0.0.1:8101/v1" "${w}gpu"
        stats 8101 "stats-$which-$w.json"
        log "$which: $w GPU(s) measured"
      fi
      stop 8101
    done
    continue
  fi
  log "$which: 1 GPU (port 8101) and $WIDTHS GPUs tensor parallel (ports 8102...)"
  serve 1 8101 "$M/$which"
  ports=8101; urls="http://127.0.0.1:8101/v1"; labels=1gpu; port=8101
  for w in $WIDTHS; do
    port=$(( port + 1 )); serve "$w" "$port" "$M/$which"
    ports="$ports $port"; urls="$urls,http://127.0.0.1:$port/v1"; labels="$labels,${w}gpu-tp"
  done
  up=1; for p in $ports; do wait_up "$p" 600 || up=0; done
  if [ "$up" = 1 ]; then
    log "$which: up"
    bench "$which" "$urls" "$labels"
    for p in $ports; do stats "$p" "stats-$which-$p.json"; done
    log "$which: measured"
  fi
  for p in $ports; do stop "$p"; done
done

if step huge; then
  log "huge: $HUGE ($DTYPE) across $HUGE_RANKS GPUs, $HUGE_PARALLEL parallel"
  serve "$HUGE_RANKS" 8109 "$HUGE" --load-format dummy --dtype "$DTYPE" --parallel "$HUGE_PARALLEL"
  if wait_up 8109 900; then
    log "huge: up"
    LOW=1,4 LOW_N=4 HIGH=16 HIGH_N=16 bench huge "http://127.0.0.1:8109/v1" "${HUGE_RANKS}gpu-$HUGE_PARALLEL"
    stats 8109 "stats-huge.json"
    log "huge: measured"
  fi
  stop 8109
fi
log "done"
