#!/usr/bin/env bash
# The one prepared device check, for a lent GPU machine (see shared/PLATFORM.md): run from the repo root with
# the wheels from `make gpu-wheels` carried in .gpu_wheels/. Installs them beside the machine's CUDA torch,
# runs the `#| gpu` cells and the short benchmarks, and leaves every recorded row under $OUT/results.
# Untested on a GPU so far: no session has been lent one yet.
set -uo pipefail
OUT=${OUT:-out/gpu}; mkdir -p "$OUT/results"
export DIFFQ_LAB_RESULTS="$OUT/results" DIFFQ_LAB_CACHE="$OUT/cache" HF_HUB_OFFLINE=1 PYTHONPATH="$PWD/.gpu_deps:$PWD"
pip install -q --no-deps --target .gpu_deps .gpu_wheels/*.whl > "$OUT/install.log" 2>&1 || { echo "wheel install failed"; tail "$OUT/install.log"; }
python -c "import torch, torchao, diffusers; print(torch.__version__, torchao.__version__, diffusers.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
LAB=(python -c "import sys; from diffq_lab.cli import main; sys.exit(main(sys.argv[1:]))")
"${LAB[@]}" probe --device cuda --record | tee "$OUT/probe.md"
timeout 420 python -c "from nbdev.test import nbdev_test; nbdev_test(flags='gpu', n_workers=1)" > "$OUT/nbdev_test_gpu.log" 2>&1; echo "nbdev_test --flags gpu: rc=$?" | tee -a "$OUT/versions.txt"
timeout 120 "${LAB[@]}" study --device cuda --out "$OUT/study" > "$OUT/study.log" 2>&1; echo "study: rc=$?" | tee -a "$OUT/versions.txt"
ls -la "$OUT/results"
