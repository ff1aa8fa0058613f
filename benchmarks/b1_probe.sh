#!/usr/bin/env bash
# Batch-1 decode probe (one device call, ~9 min): the engine's GPU test in the background (its time is
# mostly NVRTC compiles, CPU work) while the decode kernels' property tests run; then the compiled 9B
# step at batch 1 with selection variants (decode_profile --variants) and one step kernel by kernel
# under Nsight Compute (time, DRAM bytes read, issue-active share). Logs land under $OUT.
#   source .device/env.sh && bash benchmarks/b1_probe.sh
# Knobs: ENGINE=0 skips the engine test; VARIANTS (decode_profile --variants); NCU=0 skips Nsight.
export MTLQWEN_FAST_HYPOTHESIS=1 PYTHONUNBUFFERED=1
P="python -m pytest -p no:cacheprovider -rfEs -m gpu --durations=6"
if [ "${ENGINE:-1}" = 1 ]; then
  ( timeout ${ENGINE_LIMIT:-280} $P -v -s tests/test_engine.py -k gpu_kernels > $OUT/t_engine.log 2>&1
    echo "rc=$?" >> $OUT/t_engine.log ) &
fi
timeout ${KERNEL_LIMIT:-200} $P -v ${KERNEL_TESTS:-tests/test_kernels_qmatmul.py::test_qmv_residual_norm_matches_reference \
  tests/test_kernels_small.py::test_norm_kernels tests/test_kernels_attention.py::test_kernel_matches_reference} \
  > $OUT/t_kernels.log 2>&1
echo "kernel tests rc=$?: $(tail -1 $OUT/t_kernels.log)"
grep -E "PASSED|FAILED|ERROR" $OUT/t_kernels.log | grep "::" | sed 's/ *\[.*//' | sort -u
wait
if [ -f $OUT/t_engine.log ]; then
  echo "engine: $(tail -1 $OUT/t_engine.log) $(tail -3 $OUT/t_engine.log | head -1)"
  grep -E "GPU engine|decode peak|PASSED|FAILED|slowest|s call" $OUT/t_engine.log | head -12
fi
echo "[${SECONDS}s] decode profile"
timeout ${PROFILE_LIMIT:-110} python benchmarks/decode_profile.py --batches 1 --steps 30 --no-ops \
  --variants ${VARIANTS:-attn_min_split_keys=32 attn_min_split_keys=64 attn_min_split_keys=128} \
  --json $OUT/profile.json > $OUT/profile.log 2>&1
echo "profile rc=$?"; grep '^{"B' $OUT/profile.log | cut -c1-900
if [ "${NCU:-1}" = 1 ]; then
  left=$(( ${TOTAL_LIMIT:-570} - SECONDS )); echo "[${SECONDS}s] ncu, ${left}s left"
  MLX_USE_CUDA_GRAPHS=0 timeout $left ncu --profile-from-start off --clock-control none --cache-control none --csv \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,smsp__issue_active.avg.pct_of_peak_sustained_active \
    python benchmarks/step_kernels.py --batch 1 --steps 2 > $OUT/ncu1.csv 2> $OUT/ncu1.err
  echo "ncu rc=$?"; python benchmarks/step_kernels.py --summarize $OUT/ncu1.csv || tail -5 $OUT/ncu1.err
fi
