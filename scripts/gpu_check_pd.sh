#!/usr/bin/env bash
# The GPU proof of disaggregation and EAGLE on the device, in-process part (issue 23),
# in one command on a bare H100 / H200 machine whose Python has torch (CUDA), triton,
# transformers, safetensors and tokenizers (no Mooncake needed: the prefill and decode
# schedulers run in one process over LocalTransfer). Prints every result and, when
# $OUT is set, writes gpu_check_pd.json / gpu_check_pd.txt there.
# Extra arguments go to `python3 -m pdserve.bench.gpu_check_pd` (e.g. --skip transfer).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
# 6 minutes at most, so a rerun fits in the session's device time.
timeout 360 python3 -m pdserve.bench.gpu_check_pd ${OUT:+--out "$OUT"} "$@"
