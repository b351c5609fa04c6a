# Sourced by the GPU check scripts: run from the repository root with the wheels that
# travel in the git-ignored .whl/ folder (installed with --no-deps into a scratch
# target) on the path, and name the device.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-deps --target /tmp/pdserve-wheels .whl/*.whl
  export PYTHONPATH="/tmp/pdserve-wheels:${PYTHONPATH:-}"
fi
# Debian packages carried along (libibverbs for Mooncake): unpacked, their libraries on the path.
if compgen -G ".whl/*.deb" >/dev/null; then
  for deb in .whl/*.deb; do dpkg -x "$deb" /tmp/pdserve-debs; done
  export LD_LIBRARY_PATH="/tmp/pdserve-debs/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
