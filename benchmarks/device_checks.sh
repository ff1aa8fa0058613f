#!/usr/bin/env bash
# First device call of a session: the GPU equivalence tests (kernels, then model and engine), then the
# decode profile with the variants whose tests passed switched on. Logs and JSON land under $OUT.
#   source .device/env.sh && bash benchmarks/device_checks.sh
export MTLQWEN_FAST_HYPOTHESIS=1 PYTHONUNBUFFERED=1
P="python -m pytest -q -p no:cacheprovider -rfEs -m gpu"
sel=""
timeout 170 $P tests/test_kernels_gdn.py tests/test_kernels_attention.py > $OUT/t_kernels.log 2>&1
rc_k=$?; echo "gdn+attention rc=$rc_k: $(tail -1 $OUT/t_kernels.log)"
[ $rc_k = 0 ] && sel="gdn_state_inplace=1"
timeout 90 $P tests/test_kernels_qmatmul.py > $OUT/t_qmm.log 2>&1
rc_q=$?; echo "qmatmul rc=$rc_q: $(tail -1 $OUT/t_qmm.log)"
[ $rc_q = 0 ] && sel="${sel:+$sel,}qmv_mma_min_rows=5"
export MTLQWEN_SELECT="$sel"; echo "MTLQWEN_SELECT=$sel"
timeout 170 $P -s tests/test_engine.py tests/test_gpu_model.py > $OUT/t_model.log 2>&1
echo "engine+model rc=$?: $(tail -1 $OUT/t_model.log)"
grep -E "differ|peak|reference:|greedy:|max abs" $OUT/t_model.log | tail -8
timeout 90 python benchmarks/decode_profile.py --steps 20 --json $OUT/profile.json > $OUT/profile.log 2>&1
grep '^{"B' $OUT/profile.log | cut -c1-600; tail -3 $OUT/profile.log
