#!/usr/bin/env bash
# The GPU proof of the CUDA engine (issue 22), in one command on a bare H100 / H200
# machine whose Python has torch (CUDA), triton, transformers, safetensors and
# tokenizers. Anything else travels as wheels in the git-ignored .whl/ folder
# (installed with --no-deps into a scratch target); the check itself needs none.
# Prints every result and, when $OUT is set, writes gpu_check.json / gpu_check.txt there.
# Extra arguments go to `python3 -m pdserve.bench.gpu_check` (e.g. --skip speed).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
# 8 minutes at most, so a rerun fits in the session's device time.
timeout 480 python3 -m pdserve.bench.gpu_check ${OUT:+--out "$OUT"} "$@"
