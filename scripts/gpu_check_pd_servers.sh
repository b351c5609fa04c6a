#!/usr/bin/env bash
# The two-server GPU proof of disaggregation (issue 23): `pdserve up` deployments on
# one GPU (colocated, 1P1D, 1P1D with EAGLE on decode, and on prefill too), the router
# in front, KV moving through Mooncake. Runs on a bare H100 / H200 machine whose Python
# has torch (CUDA), triton, transformers, safetensors and tokenizers; what else the
# servers need travels in the git-ignored .whl/ folder (scripts/gpu_wheels.sh fills it
# here: the Mooncake non-CUDA wheel, the server's Python dependencies and Debian's
# libibverbs, ~30 MB; the device call names .whl in `carry`). Prints every result and,
# when $OUT is set, writes gpu_pd_servers.json / .txt there. Extra arguments go to
# `python3 -m pdserve.bench.gpu_pd_servers` (e.g. --only "1P1D decode-EAGLE").
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
# Mooncake's engine must load before any server starts (it links libibverbs, libnuma,
# libcurl from the system or the carried .debs): say what is missing at once.
python3 -c "import mooncake.engine" || {
  ldd "$(python3 -c 'import importlib.util as u; print(u.find_spec("mooncake").submodule_search_locations[0])')/engine.so" \
    | grep "not found"; exit 1; }
# 7 minutes at most, so a rerun fits in the session's device time.
PYTHONUNBUFFERED=1 timeout 420 python3 -m pdserve.bench.gpu_pd_servers ${OUT:+--out "$OUT"} "$@"
