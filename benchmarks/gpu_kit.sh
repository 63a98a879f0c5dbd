#!/usr/bin/env bash
# Build, here, what the borrowed GPU machine lacks for benchmarks/gpu_check.sh, into .kit/ (ignored by git;
# the device tool carries it: carry [".kit"]). That image has Python 3.12, CUDA torch, transformers,
# accelerate and peft, but no trl, datasets, omegaconf, bm25s or this project, and no network.
#   bash benchmarks/gpu_kit.sh            # prints the kit's size (it must stay under 64 MiB)
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=.kit
rm -rf "$KIT" && mkdir -p "$KIT/wheels"
# the versions this project is tested with here; pure-Python wheels, so Python 3.12 takes them as they are
# (bm25s: zerosim's config schema imports the simulators, which import its stop words; numpy and scipy are there)
pkgs=("trl==1.16.0" "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19" "omegaconf==2.4.0"
      "antlr4-python3-runtime==4.13.2" "bm25s==0.3.16")
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$KIT/wheels" "${pkgs[@]}"
python -m pip wheel -q --no-deps --no-build-isolation -w "$KIT/wheels" .    # this project
# a tokenizer (the embedded SmolLM2's): the check's models are random, of Qwen2.5-3B's shape, and need no weights
python - <<'PY'
from transformers import AutoConfig
from zerosim.core.models import load_tokenizer, resolve_model
load_tokenizer("smollm2").save_pretrained(".kit/tokenizer")
AutoConfig.from_pretrained(resolve_model("smollm2")).save_pretrained(".kit/tokenizer")  # a folder zerosim loads
PY
ls -1 "$KIT/wheels"
size=$(du -sm "$KIT" | cut -f1)
echo "kit: $KIT, ${size} MiB (limit 64)"
[ "$size" -lt 64 ]
