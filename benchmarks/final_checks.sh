#!/usr/bin/env bash
# Closing device call of a session (~8 min): the engine's and the whole model's GPU tests and the qmv
# property tests run side by side (correctness only: their time is mostly NVRTC compiles), then the
# end-to-end side-by-side with mlx-lm. Logs land under $OUT.
#   source .device/env.sh && bash benchmarks/final_checks.sh
export MTLQWEN_FAST_HYPOTHESIS=1 PYTHONUNBUFFERED=1
P="python -m pytest -p no:cacheprovider -rfEs -m gpu --durations=4"
( timeout 260 $P -v -s tests/test_engine.py -k gpu_kernels > $OUT/t_engine.log 2>&1; echo "rc=$?" >> $OUT/t_engine.log ) &
( timeout 260 $P -v -s tests/test_gpu_model.py > $OUT/t_model.log 2>&1; echo "rc=$?" >> $OUT/t_model.log ) &
timeout 200 $P -v tests/test_kernels_qmatmul.py::test_qmv_matches_reference \
  tests/test_kernels_qmatmul.py::test_linear_multi_and_swiglu_match_reference > $OUT/t_kernels.log 2>&1
echo "kernels: $(tail -1 $OUT/t_kernels.log)"; grep -E "::.*(PASSED|FAILED)" $OUT/t_kernels.log | sed 's/ *\[.*//' | sort -u
wait
for f in engine model; do echo "$f: $(grep -E '^rc=' $OUT/t_$f.log) $(grep -E ' passed| failed' $OUT/t_$f.log | tail -1)"; grep -E "GPU engine|decode peak|kernels vs|greedy:" $OUT/t_$f.log; done
echo "[${SECONDS}s] e2e"
timeout $(( ${TOTAL_LIMIT:-560} - SECONDS )) python benchmarks/suite.py --out $OUT --parts e2e:$(( ${TOTAL_LIMIT:-560} - SECONDS - 10 )) \
  --args 'e2e=--prefill-steps 1024 --repeats 2' > $OUT/e2e.log 2>&1
grep -E "^\[" $OUT/e2e.log | tail -14
