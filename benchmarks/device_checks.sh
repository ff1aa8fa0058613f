#!/usr/bin/env bash
# First device call of a session: the GPU equivalence tests (kernels, then model and engine), then the
# decode profile (with the qmv prefetch switched on when SWEEP=1 finds it faster). Logs and JSON land under $OUT.
#   source .device/env.sh && bash benchmarks/device_checks.sh
# Knobs (environment): KERNEL_TESTS (pytest files or node ids, default the three kernel files),
# KERNEL_LIMIT (s, 170), MODEL_TEST=0 skips tests/test_gpu_model.py, SWEEP=1 runs the qmv blocking /
# prefetch sweep and switches the prefetch variant on when it is faster at batch 1 (benchmarks/qmv_pick.py).
export MTLQWEN_FAST_HYPOTHESIS=1 PYTHONUNBUFFERED=1
P="python -m pytest -v -p no:cacheprovider -rfEs -m gpu --durations=5"
KERNEL_TESTS=${KERNEL_TESTS:-"tests/test_kernels_small.py tests/test_kernels_gdn.py tests/test_kernels_attention.py"}
sel=""
timeout ${KERNEL_LIMIT:-170} $P $KERNEL_TESTS > $OUT/t_kernels.log 2>&1
rc_k=$?; echo "kernel tests rc=$rc_k: $(tail -1 $OUT/t_kernels.log)"
grep -E "PASSED|FAILED|ERROR" $OUT/t_kernels.log | grep "::" | sed 's/ *\[.*//' | sort -u
if [ "${SWEEP:-0}" = 1 ]; then
  timeout 120 python benchmarks/kernels_qmatmul_attn.py --only sweep --json $OUT/sweep.json > $OUT/sweep.log 2>&1
  echo "sweep rc=$?"; pick=$(python benchmarks/qmv_pick.py $OUT/sweep.json); echo "$pick"
  grep -q "^prefetch wins" <<< "$pick" && grep -q "::test_qmv_matches_reference PASSED" $OUT/t_kernels.log \
    && sel="${sel:+$sel,}qmv_prefetch=1"
fi
export MTLQWEN_SELECT="$sel"; echo "MTLQWEN_SELECT=$sel (switched on for the rest of this call)"
if [ "${MODEL_TEST:-1}" = 1 ]; then
  timeout 200 $P -s tests/test_gpu_model.py > $OUT/t_model.log 2>&1
  echo "whole model rc=$?: $(tail -1 $OUT/t_model.log)"; grep -E "kernels vs|greedy:" $OUT/t_model.log
fi
timeout 150 $P -s tests/test_engine.py > $OUT/t_engine.log 2>&1
echo "engine rc=$?: $(tail -1 $OUT/t_engine.log)"; grep -E "GPU engine|decode peak" $OUT/t_engine.log
timeout 80 python benchmarks/decode_profile.py --steps 20 --json $OUT/profile.json > $OUT/profile.log 2>&1
grep '^{"B' $OUT/profile.log | cut -c1-400; tail -3 $OUT/profile.log
