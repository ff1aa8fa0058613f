#!/usr/bin/env bash
# The tensor-parallel record on nvidia-h200-x2 (one device call): the 9B shape at 4-bit on one GPU, then
# over both GPUs through MLX's NCCL back-end, side by side (benchmarks/tp_bench.py --compare); then a shape
# that needs both GPUs' memory (122B-A10B at 8-bit, ~130 GB) loads and generates. Logs and JSON under $OUT.
#
#   source .device/env.sh && bash benchmarks/tp_two_gpu.sh
#
# TP_ARGS go to both 9B runs, TP_LARGE replaces the large shape's arguments, TP_BACKEND (default nccl) the
# back-end: the plumbing on a CPU is
#   TP_BACKEND=ring TP_ARGS="--shape demo --bits 0 --levels 1,2 --prefill 64 --prompt-len 32 --gen-len 8" \
#   TP_LARGE="--shape demo --bits 8" OUT=/tmp/tp bash benchmarks/tp_two_gpu.sh
#
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0), also in the ranks mlx.launch starts: on the lent hosts
# a program using it can take the shared GPUs out of service.
set -u
OUT=${OUT:-/tmp/tp-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
HERE=$(cd "$(dirname "$0")" && pwd)
BENCH="$HERE/tp_bench.py"
BACKEND=${TP_BACKEND:-nccl}
LAUNCH=(mlx.launch --backend $BACKEND --hosts 127.0.0.1 -n 2 --env NCCL_NVLS_ENABLE=0 --env NVSHMEM_DISABLE_NVLS=1 --)
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv 2>&1 | tee "$OUT/gpus.csv"

part() {  # NAME SECONDS COMMAND...
    local name=$1 secs=$2; shift 2
    echo "== $name ($secs s): $*"
    local t0=$SECONDS
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - t0)) s"; tail -n 25 "$OUT/$name.log"
}

part tp-9b-1gpu 200 env CUDA_VISIBLE_DEVICES=0 python "$BENCH" --json "$OUT/tp-9b-1gpu.json" ${TP_ARGS:-}
part tp-9b-2gpu 220 "${LAUNCH[@]}" python "$BENCH" --group --backend "$BACKEND" --json "$OUT/tp-9b-2gpu.json" ${TP_ARGS:-}
[ -f "$OUT/tp-9b-1gpu.json" ] && [ -f "$OUT/tp-9b-2gpu.json" ] && \
    python "$BENCH" --compare "$OUT/tp-9b-1gpu.json" "$OUT/tp-9b-2gpu.json" | tee "$OUT/tp-9b-compare.md"
part tp-122b-2gpu 150 "${LAUNCH[@]}" python "$BENCH" --group --backend "$BACKEND" ${TP_LARGE:---shape 122b-a10b --bits 8} \
    --only generate --greedy-len 16 --json "$OUT/tp-122b-2gpu.json"
nvidia-smi --query-gpu=index,memory.used --format=csv 2>&1
