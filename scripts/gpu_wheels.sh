#!/usr/bin/env bash
# Fill the git-ignored .whl/ folder with everything the GPU machine lacks to run the
# servers (no network there; its image's packages are in scripts/gpu_image_packages.txt):
# pdserve's runtime dependencies the image does not provide and what they need, as
# CPython 3.12 manylinux wheels, Mooncake's non-CUDA transfer engine (slimmed), and the
# Debian packages its engine.so links that the image may lack (libibverbs, libnuma,
# libcurl and theirs), which gpu_env.sh unpacks there. Writes .whl/MANIFEST.txt (what
# travels, its size and why) and .whl/IMAGE_REQUIRES.txt (checked there by gpu_env.sh).
# Run here, where pip and apt reach their registries; then carry .whl to the device.
# Fails, naming the package, if the set would be incomplete or too big to travel.
# Arguments go to scripts/gpu_wheels.py (--dest DIR, --python-version X.Y, --no-debs, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PDSERVE_BUILD_PYTHON:-python3}" scripts/gpu_wheels.py "$@"
