#!/usr/bin/env bash
# Fill the git-ignored .whl/ folder with what the GPU machine lacks to run the servers
# (its image has torch, triton, transformers, safetensors, tokenizers, httpx,
# prometheus-client; no network): the server's other Python dependencies and the
# non-CUDA Mooncake transfer engine as CPython 3.12 wheels, and Debian's libibverbs
# (Mooncake links it even for TCP) as .deb files that gpu_env.sh unpacks there.
# Run here, where pip and apt reach their registries; then carry .whl to the device.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || grep -qx '/.whl/' .gitignore || echo /.whl/ >> .git/info/exclude
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl \
  mooncake-transfer-engine-non-cuda==0.3.13.post1 xgrammar==0.2.9 fastapi==0.165.0 starlette==1.10.0 \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5 uvicorn==0.55.0 \
  pyzmq==27.3.0
# Mooncake's wheel carries a 42 MB benchmark, its store and master binaries: the
# transfer engine needs none of them, and the device call carries 64 MiB at most.
python3 - <<'PY'
import glob, zipfile
from pathlib import Path
unused = {"mooncake/transfer_engine_bench", "mooncake/mooncake_client", "mooncake/mooncake_master",
          "mooncake/store.so"}
for wheel in glob.glob(".whl/mooncake_transfer_engine*.whl"):
    slim = Path(wheel + ".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for item in src.infolist():
            if item.filename in unused:
                continue
            data = src.read(item.filename)
            if item.filename.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if line.split(",")[0] not in unused]
                data = ("\n".join(kept) + "\n").encode()
            dst.writestr(item, data)
    slim.replace(wheel)
PY
# libibverbs (and what it links); libnuma, which the engine links too.
(cd .whl && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200 libnuma1)
du -sh .whl
