#!/usr/bin/env bash
# Train the demo pair in one device call: target for TARGET_S seconds, then the drafter for DRAFTER_S
# seconds (wall clock, each stage checkpoints at its end), and leave the results in $OUT as at most
# 6 files of at most 15 MiB:
#   target.tar.part-aa, -ab, ...  the HF-layout target checkpoint (tar split in 15 MiB parts)
#   drafter.tar                   the drafter checkpoint (published DFlash layout)
#   logs.tar                      target_log.json, drafter_log.json, env.json, both stages' stdout
# Usage: OUT=/some/dir training/device_train.sh [--smoke]   (env TARGET_S, DRAFTER_S, TOTAL_S, PYTHON override)
set -euo pipefail
cd "$(dirname "$0")/.."
SMOKE=""
if [[ "${1:-}" == "--smoke" ]]; then SMOKE="--smoke"; fi
OUT="${OUT:?set OUT to the output directory}"
TARGET_S="${TARGET_S:-300}"
DRAFTER_S="${DRAFTER_S:-140}"
TOTAL_S="${TOTAL_S:-520}"  # the whole call; the drafter's budget shrinks to fit it after the target stage
RESERVE_S=45  # drafter stage's load, held-out evaluation and save
if [[ -z "${PYTHON:-}" ]]; then  # the interpreter that has torch
  PYTHON=python3; if ! python3 -c "import torch" 2>/dev/null && command -v python >/dev/null; then PYTHON=python; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
RUN="$(mktemp -d)"
mkdir -p "$OUT"
T0=$(date +%s)

"$PYTHON" - > "$RUN/env.json" <<'PY' || echo '{"error": "environment probe failed"}' > "$RUN/env.json"
import json, os, platform, subprocess, sys, torch, transformers, tokenizers
try:  # the device copy may have no git
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:
    commit = None
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
print(json.dumps({"python": sys.version, "platform": platform.platform(), "torch": torch.__version__,
                  "transformers": transformers.__version__, "tokenizers": tokenizers.__version__, "gpu": gpu,
                  "cpus": os.cpu_count(), "commit": commit}))
PY

pack_logs() {  # always leave the logs, whatever stage failed
  tar -C "$RUN" -cf "$OUT/logs.tar" $(cd "$RUN" && ls *.json *.txt 2>/dev/null)
}
trap pack_logs EXIT
if [[ -n "$SMOKE" ]]; then "$PYTHON" -m training.check_blocks; fi

"$PYTHON" -m training.train_target --out "$RUN" --budget-s "$TARGET_S" $SMOKE 2>&1 | sed "/falling back/d" | tee "$RUN/target_stdout.txt"
tar -C "$RUN" -cf - checkpoint | split -b 15m -a 2 - "$OUT/target.tar.part-"
ELAPSED=$(( $(date +%s) - T0 ))
echo "target done at $ELAPSED s"
LEFT=$(( TOTAL_S - ELAPSED - RESERVE_S ))
if (( LEFT < DRAFTER_S )); then DRAFTER_S=$(( LEFT > 10 ? LEFT : 10 )); echo "drafter budget cut to $DRAFTER_S s"; fi

"$PYTHON" -m training.train_drafter --target "$RUN/checkpoint" --out "$RUN" --budget-s "$DRAFTER_S" $SMOKE 2>&1 \
  | sed "/falling back/d" | tee "$RUN/drafter_stdout.txt"
tar -C "$RUN" -cf "$OUT/drafter.tar" drafter
echo "drafter done at $(( $(date +%s) - T0 )) s"
ls -la "$OUT"
