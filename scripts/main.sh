#!/usr/bin/env bash
# The main job: the whole TAPAS pipeline on the built-in default model (t5-tiny), on 4
# logical CPU devices: capture, mine, search, reconstruct, then a few training steps
# verified against the single-device Keras model, with the strategy table, the collective
# audit and phase timings (sets up .venv on first use; a few minutes on 2 cores).
# Extra flags are passed on (later flags win), e.g. scripts/main.sh --model=resnet-tiny
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
defaults=(--devices=4 --steps=3 --verify)
case " $* " in
  *" --model="*) ;;
  # t5-tiny is so small that the search replicates it; batch 8 and a 2.5 MiB per-device
  # memory budget make it shard the model (tensor parallelism) instead (the plan's memory
  # counts the all-gathered inputs the backward keeps: 2 MiB leaves no plan the search finds)
  *) defaults+=(--model=t5-tiny --batch_size=8 --memory_budget_gib=0.0025) ;;
esac
tapas train "${defaults[@]}" "$@"
