#!/bin/bash
# Issue 35 on the GPU machine: the batch's KV contiguous (mlx-lm's batch caches) against paged
# (--kv-layout paged), and both against vllm-mlx 0.6.0. Run from the repository root, one step a
# device call (a call carries at most 64 MiB; see /work/shared/gpu/README.md):
#   setup-a  (carry .gpu-a)              the first half of the MLX CUDA wheel
#   setup-b  (carry .gpu-b)              MLX, mlx-lm
#   setup-c  (carry .gpu-extra .gpu-vllm) mlxserve's other packages; vllm-mlx apart in ~/vllm-site
#   engine   R SHAPE..   `bench engine`, contiguous then paged, per shape (dummy 4-bit)
#   serve    R SHAPE..   `bench serve --start vllm-mlx,mlxserve,mlxserve@contiguous`, per shape
#                        (mlxserve: the default, --kv-layout auto, paged on CUDA)
#   step     R SHAPE..   decode step time under bare BatchGenerator by KV layout and matmul (step.py)
#   matmul   R SHAPE..   one decode step's quantized matmuls, (B, 1, K) against (B, K) (matmul.py)
#   tests    R           the paged and quantized-layer tests on the GPU (the CUDA kernel's included)
#   profile  R SHAPE LABEL[=ARGS]..  py-spy on each server under a 4-stream load (spy.py; carry
#                        .gpu-prof, py-spy's binary)
# R: the results folder. LEVELS, REQUESTS, ARGS (extra mlxserve args for both layouts) override.
set -u
step=${1:?step}; shift
export PYTHONPATH=$HOME/site:$PWD MLX_PTX_CACHE_DIR=$HOME/stash/ptx MLXSERVE_CACHE_DIR=$HOME/stash/.gpu-extra/cache
LEVELS=${LEVELS:-1,4,16,32,64}; REQUESTS=${REQUESTS:-32}; ARGS=${ARGS:-}
START=${START:-vllm-mlx,mlxserve,mlxserve@contiguous}; VARIANTS=${VARIANTS:-}  # VARIANTS: more --peer-args
model() { local d=/tmp/m-$1; [ -d "$d" ] || python3 -m mlxserve convert --load-format dummy "$1" --quantize 4 --out-dir "$d" >/dev/null; echo "$d"; }
case $step in
setup-a) mkdir -p ~/stash && cp .gpu-a/part.00 ~/stash/ ;;
setup-b)
  W=~/stash/$(cat .gpu-b/CUDA_WHEEL_NAME); cat ~/stash/part.00 .gpu-b/part.01 > "$W"
  [ "$(sha256sum "$W" | cut -d' ' -f1)" = "$(cat .gpu-b/CUDA_WHEEL_SHA256)" ] || { echo bad wheel; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target ~/site "$W" .gpu-b/mlx-*.whl .gpu-b/mlx_lm-*.whl
  ln -sfn "$(python3 -c 'import nvidia;print(list(nvidia.__path__)[0])')" ~/site/nvidia ;;
setup-c)
  cp -r .gpu-extra ~/stash/
  python3 -m pip install -q --no-index --no-deps --no-compile --target ~/site ~/stash/.gpu-extra/*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --target ~/vllm-site .gpu-vllm/*.whl
  python3 -c "import mlx.core as mx; print(mx.default_device(), mx.cuda.is_available())" ;;
engine)
  R=$1; shift; mkdir -p "$R"
  for shape in "$@"; do
    d=$(model "$shape")
    for layout in contiguous paged; do
      python3 -m mlxserve bench engine --models "$d" --concurrency "${LEVELS#1,}" --prompt-len 128 \
        --output-len 128 --kv-layout $layout --out-dir "$R" 2>&1 | grep -v "it/s\]" | tail -30
    done
  done ;;
serve)
  R=$1; shift; mkdir -p "$R"
  for shape in "$@"; do
    d=$(model "$shape")
    eval "extra=($VARIANTS)"
    python3 -m mlxserve bench serve --start "$START" --model-dir "$d" "${extra[@]}" \
      --peer-path vllm-mlx=$HOME/vllm-site --peer-args "mlxserve=--warmup 0 $ARGS" \
      --peer-args "mlxserve@paged=--warmup 0 --kv-layout paged $ARGS" \
      --peer-args "mlxserve@contiguous=--warmup 0 --kv-layout contiguous $ARGS" --endpoint completions \
      --concurrency "$LEVELS" --requests "$REQUESTS" --input-len 128 --output-len 128 --timeout 120 \
      --start-timeout 240 --out-dir "$R" 2>&1 | grep -v "req/s\]" | tail -40
  done ;;
step)
  R=$1; shift; mkdir -p "$R"
  for shape in "$@"; do
    python3 benchmarks/paged-kv/step.py "$(model "$shape")" "${BATCHES:-1,4,8,16}" 2>&1 | tee "$R/step-$shape.md" | head -30
  done ;;
matmul)
  R=$1; shift; mkdir -p "$R"
  for shape in "$@"; do
    python3 benchmarks/paged-kv/matmul.py "$(model "$shape")" 1,2,3,4,6,8,12,16,32 2>&1 | tee "$R/matmul-$shape.md"
  done ;;
profile)
  R=$1; d=$(model "$2"); shift 2; mkdir -p "$R"
  python3 benchmarks/paged-kv/spy.py "$d" "$R" "$PWD/.gpu-prof/py-spy" "$@" --peer-path vllm-mlx=$HOME/vllm-site \
    2>&1 | grep -v "req/s\]" | tail -150 ;;
tests)
  R=$1; mkdir -p "$R"
  timeout 400 python3 -m pytest -q -x tests/test_paged_attention.py tests/test_paged_kv.py tests/test_dense.py \
    2>&1 | tail -15 ;;
esac
