#!/usr/bin/env bash
# One device call that checks the GPU paths and refreshes every benchmark record (results under $OUT).
#   source .device/env.sh && bash benchmarks/h200_session.sh
# Each part has its own time limit so a slow one cannot take the others' results with it.
export MTLQWEN_FAST_HYPOTHESIS=1 PYTHONUNBUFFERED=1
T="tests/test_kernels_attention.py::test_inplace_kv_write_then_attention_matches_functional"
if ! timeout 60 python -m pytest -q -p no:cacheprovider -x -m gpu "$T" > $OUT/t_inplace.log 2>&1; then
  echo "in-place KV write FAILED: benchmarks use the functional scatter"; tail -5 $OUT/t_inplace.log
  export MTLQWEN_KV_INPLACE=0
fi
timeout 110 python -m pytest -q -p no:cacheprovider -rfEs -s -m gpu tests/test_engine.py tests/test_gpu_model.py > $OUT/t_model.log 2>&1
grep -E "passed|failed|differ|peak|reference:|greedy:" $OUT/t_model.log | tail -6
timeout 200 python benchmarks/e2e_bench.py --repeats 1 --prefill-steps 4096 --json $OUT/e2e.json > $OUT/e2e.log 2>&1; tail -12 $OUT/e2e.log
timeout 50 python benchmarks/prefix_cache_bench.py --repeats 1 --json $OUT/prefix.json > $OUT/prefix.log 2>&1; tail -6 $OUT/prefix.log
timeout 70 python benchmarks/spec_bench.py --steps 8 --warmup 2 --no-parts --json $OUT/spec.json > $OUT/spec.log 2>&1; tail -10 $OUT/spec.log
timeout 45 python benchmarks/runtime_bench.py --repeats 1 --gen-len 64 --json $OUT/runtime.json > $OUT/runtime.log 2>&1; tail -6 $OUT/runtime.log
timeout 45 python benchmarks/decode_profile.py --steps 10 --json $OUT/profile.json 2>&1 | grep '^{"B' | cut -c1-400
