#!/usr/bin/env bash
# One device call: the named parts in order, each under its own time limit, logs and JSON under $OUT.
#
#   source .device/env.sh && bash benchmarks/device_run.sh PART[:SECONDS] ...
#
# A fresh machine compiles every kernel instantiation once (NVRTC, mostly CPU work), so the GPU tests are
# worth running side by side: a part written +PART starts in the background and runs alongside the parts
# after it; the part `wait` waits for every background part (the end of the script waits too).
#
# Parts (default limit in seconds):
#   tests-kernels (200)  GPU property tests of the kernels: $KERNEL_TESTS (pytest files or node ids),
#                        default the five kernel test files
#   tests-model   (260)  tests/test_gpu_model.py: the whole model on the kernels against fp32
#   tests-engine  (280)  tests/test_engine.py -k gpu_kernels: the engine against the one-shot forward
#   qmv-sweep     (120)  kernels_qmatmul_attn.py --only sweep, then qmv_pick.py's verdict on the prefetch
#   profile       (110)  decode_profile.py $PROFILE_ARGS (default: batches 1 and 8, 30 steps, no op chains)
#   trace         (150)  step_trace.py $TRACE_ARGS (default: batch 1, 24 steps): in-situ kernel times
#   ncu           (240)  one batch-$NCU_BATCH step (default 1) under Nsight Compute, summarised by step_kernels.py
#   suite=SPEC    (the sum of SPEC's limits + 60)  suite.py --parts SPEC on one set of weights;
#                        SPEC is comma-separated NAME:SECONDS; $SUITE_ARGS, ';'-separated
#                        PART=ARGS, goes to --args (SUITE_ARGS="e2e=--prefill-steps 1024 --repeats 2")
#   demo          (120)  demo_pair_bench.py $DEMO_ARGS: the trained demo pair's acceptance, speed-up, chat hits
#   drafter       (170)  drafter_kernels.py $DRAFTER_ARGS (default: 1 and 8 sequences): each drafter call's kernels
#   spec-trace    (200)  spec_trace.py $SPEC_TRACE_ARGS (default: 1 sequence, 0 and 7 drafts): a speculative
#                        step's host phases, device time, kernels and graph nodes
#   gdn-staged    (150)  kernels_gdn.py --only staged: the GDN recurrences with a block read ahead, staged or not,
#                        against the chunk scan
#   spec-e2e      (240)  spec_e2e_bench.py $SPEC_E2E_ARGS (default: 1 and 8 requests, tau 6, 256 tokens)
#   spec-costs    (260)  spec_bench.py: the adaptive policy's step-cost table as the engine runs (pipelined,
#                        1 / 8 / 32 sequences, 0-15 drafts) -> $OUT/spec-costs.json (spec-e2e's --costs)
#   tests-host    (300)  the CPU-written tests whose tolerances follow the device, on the GPU: $HOST_TESTS
#   wait                 wait for the background parts
# DRY=1 prints each part's command instead of running it. MTLQWEN_SELECT passes through to every part.
#
# Examples: the closing checks of a change to the decode kernels, then the end-to-end record:
#   bash benchmarks/device_run.sh +tests-engine +tests-model tests-kernels wait suite=e2e:385
# the batch-1 step with selection variants:
#   TRACE_ARGS="--batch 1 --steps 24 --variants qmv_m1_rows=8" bash benchmarks/device_run.sh trace
set -u
export MTLQWEN_FAST_HYPOTHESIS=${MTLQWEN_FAST_HYPOTHESIS:-1} PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the folder for logs and JSON}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PYTEST="python -m pytest -v -p no:cacheprovider -rfEs -m gpu --durations=6"
KERNEL_TESTS=${KERNEL_TESTS:-"tests/test_kernels_small.py tests/test_kernels_gdn.py tests/test_kernels_gdn_staged.py tests/test_kernels_attention.py tests/test_kernels_qmatmul.py"}

command_for() {  # part name [spec] -> the command line of that part
  case "$1" in
    tests-kernels) echo "$PYTEST $KERNEL_TESTS" ;;
    tests-model) echo "$PYTEST -s tests/test_gpu_model.py" ;;
    tests-engine) echo "$PYTEST -s tests/test_engine.py -k gpu_kernels" ;;
    qmv-sweep) echo "python benchmarks/kernels_qmatmul_attn.py --only sweep --json $OUT/qmv-sweep.json && python benchmarks/qmv_pick.py $OUT/qmv-sweep.json" ;;
    profile) echo "python benchmarks/decode_profile.py ${PROFILE_ARGS:---batches 1 8 --steps 30 --no-ops} --json $OUT/decode-profile.json" ;;
    trace) echo "python benchmarks/step_trace.py ${TRACE_ARGS:---batch 1 --steps 24} --json $OUT/step-trace.json" ;;
    ncu) echo "MLX_USE_CUDA_GRAPHS=0 ncu --profile-from-start off --clock-control none --cache-control none --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,smsp__issue_active.avg.pct_of_peak_sustained_active python benchmarks/step_kernels.py --batch ${NCU_BATCH:-1} --steps 2 > $OUT/ncu.csv && python benchmarks/step_kernels.py --summarize $OUT/ncu.csv" ;;
    demo) echo "python benchmarks/demo_pair_bench.py ${DEMO_ARGS:-} --json $OUT/demo-pair.json" ;;
    drafter) echo "python benchmarks/drafter_kernels.py ${DRAFTER_ARGS:---seqs 1 8 --steps 4 --warmup 1 --calls 5} --json $OUT/drafter-kernels.json" ;;
    spec-trace) echo "python benchmarks/spec_trace.py ${SPEC_TRACE_ARGS:---seqs 1 --n-draft 0 7 --accept 6 --steps 6 --warmup 2} --json $OUT/spec-trace.json" ;;
    gdn-staged) echo "python benchmarks/kernels_gdn.py --only staged --out $OUT/gdn-staged.json" ;;
    spec-e2e) echo "python benchmarks/spec_e2e_bench.py ${SPEC_E2E_ARGS:---seqs 1 8 --accept 5 --gen 256} --json $OUT/spec-e2e.json" ;;
    spec-costs) echo "python benchmarks/spec_bench.py --seqs 1 8 32 --n-draft 0 1 3 7 15 --commit auto --accept 6 --compile on --pipeline on --no-parts --steps 10 --warmup 2 --json $OUT/spec-costs.json" ;;
    tests-host) echo "python -m pytest -q -p no:cacheprovider -rfEs ${HOST_TESTS:-tests/test_context_backlog.py tests/test_kv_manager.py tests/test_draft_policy.py tests/test_penalties.py tests/test_logprobs.py tests/test_structured.py tests/test_prompt_file.py tests/test_tool_grammar.py tests/test_server_tools.py}" ;;
    suite) local a extra=""; IFS=';' read -ra a <<< "${SUITE_ARGS:-}"
           [ ${#a[@]} -gt 0 ] && extra=" --args$(printf " '%s'" "${a[@]}")"
           echo "python benchmarks/suite.py --out $OUT --parts ${2//,/ }$extra" ;;
    *) return 1 ;;
  esac
}

default_limit() {  # part name [spec]
  case "$1" in
    tests-kernels) echo 200 ;; tests-model) echo 260 ;; tests-engine) echo 280 ;; qmv-sweep) echo 120 ;;
    profile) echo 110 ;; trace) echo 150 ;; ncu) echo 240 ;; demo) echo 120 ;;
    drafter) echo 170 ;; spec-trace) echo 200 ;; spec-e2e) echo 240 ;; gdn-staged) echo 150 ;;
    spec-costs) echo 260 ;; tests-host) echo 300 ;;
    suite) local s=60 p; for p in ${2//,/ }; do s=$(( s + ${p#*:} )); done; echo $s ;;
  esac
}

summary() {  # part name, log: the lines worth reading in the call's output
  case "$1" in
    tests-*) grep -E "::.*(PASSED|FAILED|ERROR)|GPU engine|decode peak|kernels vs|greedy:" "$2" | sed 's/ *\[.*%\]//' | sort -u
             tail -1 "$2" ;;
    qmv-sweep) tail -3 "$2" ;;
    demo) grep -E "^(tau|speed-up|chat|  )" "$2" ;;
    drafter) grep -E "^##|launch order" "$2" | cut -c1-1500 ;;
    profile) grep '^{"B' "$2" | cut -c1-900; tail -2 "$2" ;;
    suite) grep -E "^\[" "$2" | tail -16 ;;
    *) tail -20 "$2" ;;
  esac
}

run_part() {  # PART[:SECONDS] -> runs it, prints rc and summary
  local arg=$1 name spec="" limit cmd log rc
  name=${arg%%:*}; [ "$name" != "$arg" ] && [[ "$arg" != suite=* ]] && limit=${arg#*:}
  if [[ "$name" == suite=* ]]; then spec=${arg#suite=}; name=suite; fi
  cmd=$(command_for "$name" "$spec") || { echo "unknown part '$arg' (see the header of $0)"; exit 2; }
  limit=${limit:-$(default_limit "$name" "$spec")}
  log=$OUT/$name.log
  if [ "${DRY:-0}" = 1 ]; then echo "[$name, ${limit}s] $cmd"; return 0; fi
  echo "[${SECONDS}s] $name (limit ${limit}s)"
  timeout "$limit" bash -c "$cmd" > "$log" 2>&1; rc=$?
  echo "[${SECONDS}s] $name rc=$rc$([ $rc = 124 ] && echo ' (cut by its limit)')"
  summary "$name" "$log"
}

[ $# -gt 0 ] || { sed -n '2,32p' "$0"; exit 2; }
for arg in "$@"; do  # check every part before spending device time on the first
  a=${arg#+}; [ "$a" = wait ] && continue
  n=${a%%:*}; [[ "$a" == suite=* ]] && n=suite
  command_for "$n" x > /dev/null || { echo "unknown part '$arg' (see the header of $0)"; exit 2; }
  if [ "$n" = suite ]; then limits=${a#suite=}; limits=${limits//,/ }; else limits=""; [ "$a" != "$n" ] && limits=$a; fi
  for l in $limits; do
    [[ "$l" =~ ^[a-z0-9-]+:[0-9]+$ ]] || { echo "'$l' in '$arg' is not NAME:SECONDS"; exit 2; }
  done
done
for arg in "$@"; do
  case "$arg" in
    wait) wait ;;
    +*) run_part "${arg#+}" & ;;
    *) run_part "$arg" ;;
  esac
done
wait
