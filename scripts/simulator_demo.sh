#!/usr/bin/env bash
# SFT a SmolLM2 simulator on factbook-derived data and compare it with the prompt-only base model.
#   bash scripts/simulator_demo.sh [WORKDIR]    (~40 min on 2 CPU cores; MLflow store: WORKDIR/mlflow.db)
set -euo pipefail
WORK=${1:-outputs/simulator-demo}
STEPS=${STEPS:-200}
LIMIT=${LIMIT:-64}
mkdir -p "$WORK"
TRACK="tracking.tracking_uri=sqlite:///$(cd "$WORK" && pwd)/mlflow.db"

# 1. Questions of the train split -> BM25 documents -> useful/noisy by answer containment -> balanced SFT rows.
zerosim simulator collect --data factbook --search bm25 --max-questions 2159 --out "$WORK/sft.jsonl"

# 2. LoRA SFT of SmolLM2-135M-Instruct (merged into a plain checkpoint).
zerosim simulator train --data "$WORK/sft.jsonl" --model smollm2 --lora --max-steps "$STEPS" \
    --output-dir "$WORK" learning_rate=5e-4 batch_size=4 "$TRACK"

# 3. Quality on the test split: prompt-only base vs tuned, same questions, same seed.
zerosim simulator eval --model smollm2 --limit "$LIMIT" run_name=quality-base \
    output_dir="$WORK/eval" "$TRACK"
zerosim simulator eval --model "$WORK/simulator-sft/final" --limit "$LIMIT" run_name=quality-tuned \
    output_dir="$WORK/eval" "$TRACK"
cat "$WORK/eval/quality-base/table.md" "$WORK/eval/quality-tuned/table.md"
