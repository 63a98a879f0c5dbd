#!/usr/bin/env bash
# The one-call device check (docs/scaling.md, "The first hour on a GPU"): installs the kit that
# benchmarks/gpu_kit.sh built (.kit/, offline), then runs benchmarks/gpu_check.py — versions and GPU, GRPO steps on
# a random model of Qwen2.5-3B's shape, a step at configs/zerosearch-qwen2.5-3b.yaml's shape whose peak memory
# must be within 15% of the memory plan's, the same for the LoRA recipe configs/zerosearch-qwen2.5-7b-lora.yaml,
# the precision check, a PPO step, zerosim's decode loop against generate — and prints PASS/FAIL with the
# figures, within 8 minutes.
#   bash benchmarks/gpu_check.sh [OUT_DIR]          # on one NVIDIA GPU (no network needed)
#   bash benchmarks/gpu_check.sh --cpu [OUT_DIR]    # the same, end to end on CPU with a tiny model
set -uo pipefail
cd "$(dirname "$0")/.."
CPU=""
if [ "${1:-}" = "--cpu" ]; then CPU=--cpu; shift; fi
OUT=${1:-${OUT:-/tmp/zerosim-gpu-check}}
PY=${PYTHON:-python3}
mkdir -p "$OUT" || { echo "FAIL  output: cannot make the folder $OUT (give a writable OUT_DIR)"; exit 2; }
export TRL_EXPERIMENTAL_SILENCE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
SITE=""
if [ -z "$CPU" ] && [ -d .kit/wheels ]; then
  SITE=/tmp/zerosim-kit
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .kit/wheels/*.whl \
    || { echo "FAIL  kit: the wheels in .kit/wheels did not install"; exit 3; }
fi
export PYTHONPATH="$PWD${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"   # the working tree first, then the kit
if [ -z "$CPU" ]; then
  echo "== machine"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "FAIL  no NVIDIA GPU"; exit 2; }
fi
timeout 480 "$PY" benchmarks/gpu_check.py $CPU --out "$OUT/gpu_check.json"
code=$?
[ $code -eq 124 ] && echo "FAIL  the check ran past 8 minutes"
exit $code
