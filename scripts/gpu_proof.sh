#!/usr/bin/env bash
# The GPU proof (issue 33) in one command, on a bare H100 / H200 machine of the device
# tool (no network; its image has torch, triton, transformers): ~9 minutes at most,
# wheel install included, so a rerun fits the session's 15 minutes of device time.
#   device run:  bash scripts/gpu_proof.sh            (carry: [".whl"]; fill .whl here
#                                                      first with scripts/gpu_wheels.sh)
#   CPU rehearsal: bash scripts/gpu_proof.sh --rehearse
# The rehearsal runs every step at smoke sizes (Triton under its interpreter) in a
# stand-in for the device's Python: a venv holding only the image's packages
# (scripts/gpu_mirror_env.py, linked from this environment) plus the carried wheels,
# resolved the same way for this interpreter's version (.whl-rehearse/).
# Other arguments go to `python -m pdserve.bench.gpu_proof` (e.g. --steps probe,kernels).
# Results: $OUT/gpu_proof.json (a line per step) and $OUT/<step>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
rehearse=0
args=()
for a in "$@"; do
  if [ "$a" = "--rehearse" ]; then rehearse=1; else args+=("$a"); fi
done
if [ "$rehearse" = 1 ]; then
  host_python="${PDSERVE_HOST_PYTHON:-python3}"
  version="$("$host_python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  wheels="${PDSERVE_REHEARSE_WHEELS:-.whl-rehearse}"
  if [ ! -s "$wheels/MANIFEST.txt" ] || ! grep -q "python $version" "$wheels/MANIFEST.txt"; then
    "$host_python" scripts/gpu_wheels.py --python-version "$version" --dest "$wheels" --no-debs || {
      echo "gpu_proof --rehearse: could not resolve the carried wheels for Python $version" >&2; exit 2; }
  fi
  mirror="${PDSERVE_MIRROR:-/tmp/pdserve-gpu-mirror}"
  python_bin="$("$host_python" scripts/gpu_mirror_env.py "$mirror" | tail -n 1)" || {
    echo "gpu_proof --rehearse: could not build the image's stand-in environment" >&2; exit 2; }
  export PDSERVE_PYTHON="$python_bin" PDSERVE_WHEELS="$wheels" TRITON_INTERPRET=1
  export OUT="${OUT:-/tmp/pdserve-gpu-proof}"
  args=(--smoke --budget "${PDSERVE_PROOF_BUDGET:-3600}" "${args[@]}")
fi
# Installs the carried wheels (failing loudly), puts the repository on the path. Status 2:
# they installed but a server module does not import: the probe step reports it, the
# steps that need it are skipped, the others still give their numbers.
source scripts/gpu_env.sh
env_status=$?
if [ "$env_status" = 1 ]; then echo "gpu_proof: the carried wheels did not install" >&2; exit 2; fi
[ "$env_status" = 0 ] || echo "gpu_proof: going on without the modules that failed to import (see above)" >&2
python_bin="${PDSERVE_PYTHON:-python3}"
if [ "$rehearse" = 1 ]; then
  budget=()
else  # 9 minutes from this script's start, the wheel install included
  budget=(--budget "$((540 - SECONDS))")
fi
PYTHONUNBUFFERED=1 "$python_bin" -m pdserve.bench.gpu_proof ${OUT:+--out "$OUT"} "${budget[@]}" "${args[@]}"
