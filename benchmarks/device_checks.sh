#!/usr/bin/env bash
# First device call of a session: the GPU equivalence tests (kernels, then model and engine), then the
# decode profile with the variants whose tests passed switched on. Logs and JSON land under $OUT.
#   source .device/env.sh && bash benchmarks/device_checks.sh
export MTLQWEN_FAST_HYPOTHESIS=1 PYTHONUNBUFFERED=1
P="python -m pytest -v -p no:cacheprovider -rfEs -m gpu --durations=5"
sel=""
timeout 170 $P tests/test_kernels_small.py tests/test_kernels_gdn.py tests/test_kernels_attention.py > $OUT/t_kernels.log 2>&1
rc_k=$?; echo "small+gdn+attention rc=$rc_k: $(tail -1 $OUT/t_kernels.log)"
# each kernel variant that is off until its GPU test passes: switched on when that test PASSED above
on_pass() { grep -q "::$1 PASSED" $OUT/t_kernels.log && sel="${sel:+$sel,}$2"; }
on_pass test_head_norm_rope_kernel head_norm_rope=1
on_pass test_conv_inplace_kernel conv_state_inplace=1
on_pass test_gdn_fused_norm_kernel gdn_fused_norm=1
export MTLQWEN_SELECT="$sel"; echo "MTLQWEN_SELECT=$sel (switched on for the rest of this call)"
timeout 200 $P -s tests/test_gpu_model.py > $OUT/t_model.log 2>&1
echo "whole model rc=$?: $(tail -1 $OUT/t_model.log)"; grep -E "kernels vs|greedy:" $OUT/t_model.log
timeout 150 $P -s tests/test_engine.py > $OUT/t_engine.log 2>&1
echo "engine rc=$?: $(tail -1 $OUT/t_engine.log)"; grep -E "GPU engine|decode peak" $OUT/t_engine.log
timeout 80 python benchmarks/decode_profile.py --steps 20 --json $OUT/profile.json > $OUT/profile.log 2>&1
grep '^{"B' $OUT/profile.log | cut -c1-400; tail -3 $OUT/profile.log
