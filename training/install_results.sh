#!/usr/bin/env bash
# Unpack device_train.sh's files (from DIR) and install them as the package's demo pair:
#   training/install_results.sh DIR [DEST]     (DEST defaults to mtlqwen/demo/pair)
# Runs on the machine with mtlqwen (MLX) and torch/transformers: checks PyTorch/mtlqwen parity,
# quantizes to mlx 8-bit, measures held-out loss and acceptance, writes DEST/demo.json.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC="${1:?directory holding target.tar.part-*, drafter.tar, logs.tar}"
DEST="${2:-mtlqwen/demo/pair}"
RUN="$(mktemp -d)"
cat "$SRC"/target.tar.part-* | tar -x -C "$RUN"
tar -xf "$SRC/drafter.tar" -C "$RUN"
tar -xf "$SRC/logs.tar" -C "$RUN"
python -m training.export_demo --target "$RUN/checkpoint" --drafter "$RUN/drafter" --dest "$DEST" --parity \
  --logs "$RUN/target_log.json" "$RUN/drafter_log.json"
mkdir -p training/logs && cp "$RUN"/*.json training/logs/ && echo "logs copied to training/logs/"
