# Sourced by the GPU check scripts: run from the repository root with the wheels that
# travel in the git-ignored .whl/ folder (installed with --no-deps into a scratch
# target) on the path, and name the device.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  python -m pip install -q --no-deps --target /tmp/pdserve-wheels .whl/*.whl
  export PYTHONPATH="/tmp/pdserve-wheels:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
