#!/usr/bin/env bash
# SFT a SmolLM2 simulator on factbook-derived data and compare it with the prompt-only base model.
#   bash scripts/simulator_demo.sh [WORKDIR]    (~3 h on 2 CPU cores; MLflow store: WORKDIR/mlflow.db)
# Stage 1 is a LoRA run (fast to learn the document format), stage 2 full fine-tuning from it (the mode:
# useful vs noisy), stage 3 DPO from it (keeps the gold answer out of noisy documents).
# STEPS1/STEPS2/STEPS3/LIMIT override the step counts and the number of test questions.
set -euo pipefail
WORK=${1:-outputs/simulator-demo}
STEPS1=${STEPS1:-200}
STEPS2=${STEPS2:-150}
STEPS3=${STEPS3:-60}
LIMIT=${LIMIT:-64}
mkdir -p "$WORK"
TRACK="tracking.tracking_uri=sqlite:///$(cd "$WORK" && pwd)/mlflow.db"

# 1. Questions of the train split -> BM25 documents -> useful/noisy by answer containment -> balanced SFT rows
#    (contrasting pairs first: the same query in both modes).
zerosim simulator collect --data factbook --search bm25 --max-questions 2159 --out "$WORK/sft.jsonl"

# 2. SmolLM2-135M-Instruct: LoRA (merged), then all weights, then DPO on mode-contrast pairs.
zerosim simulator train --data "$WORK/sft.jsonl" --model smollm2 --lora --max-steps "$STEPS1" \
    --output-dir "$WORK" name=simulator-sft learning_rate=5e-4 batch_size=4 "$TRACK"
zerosim simulator train --data "$WORK/sft.jsonl" --model "$WORK/simulator-sft/final" --full \
    --max-steps "$STEPS2" --output-dir "$WORK" name=simulator-sft2 learning_rate=5e-5 batch_size=4 seed=1 "$TRACK"
zerosim simulator train --data "$WORK/sft.jsonl" --model "$WORK/simulator-sft2/final" --full objective=dpo \
    --max-steps "$STEPS3" --output-dir "$WORK" name=simulator-dpo learning_rate=2e-5 batch_size=4 seed=2 "$TRACK"

# 3. Quality on the test split: prompt-only base vs tuned, same questions, same seed.
zerosim simulator eval --model smollm2 --limit "$LIMIT" run_name=quality-base output_dir="$WORK/eval" "$TRACK"
zerosim simulator eval --model "$WORK/simulator-dpo/final" --limit "$LIMIT" run_name=quality-tuned \
    output_dir="$WORK/eval" "$TRACK"
cat "$WORK/eval/quality-base/table.md" "$WORK/eval/quality-tuned/table.md"
