# Sourced by the GPU check scripts (bash, `set -uo pipefail` or not): runs them from the
# repository root with what travels in the git-ignored carried folder on the paths, and
# names the device. The folder (scripts/gpu_wheels.sh fills it; the device call names it
# in `carry`) holds wheels, installed here with --no-deps --no-index into a scratch
# target, and Debian packages (Mooncake's libibverbs, libcurl, ...), unpacked with only
# the libraries the system lacks put on LD_LIBRARY_PATH. Then it says, one line a module,
# whether what the servers import imports, and checks the image's own packages against
# what the carried wheels require (IMAGE_REQUIRES.txt).
#
# Environment (all optional):
#   PDSERVE_WHEELS  the carried folder, relative to the repository root or absolute (.whl)
#   PDSERVE_PYTHON  the interpreter to install for and check with (python3)
#   PDSERVE_SITE    the scratch install target, put on PYTHONPATH (/tmp/pdserve-wheels)
#   PDSERVE_DEBS    where the .debs are unpacked (/tmp/pdserve-debs); the libraries put
#                   on LD_LIBRARY_PATH are linked from $PDSERVE_DEBS/gaps
# Exports PYTHONPATH (repository root, then $PDSERVE_SITE when wheels were installed) and
# LD_LIBRARY_PATH. Returns 0; 1 when installing the wheels or unpacking a .deb failed;
# 2 when wheels were carried but a module below does not import or the image misses a
# requirement (without wheels the import lines are information only). A caller that must
# not go on then: `source scripts/gpu_env.sh || exit`.
cd "$(dirname "${BASH_SOURCE[0]}")/.." || return 1

# The modules pdserve's servers import beyond the image's own packages.
PDSERVE_ENV_MODULES=(fastapi uvicorn zmq xgrammar mooncake.engine)

_pdserve_env_install() {
  local wheels=$1 py=$2 site=$3
  echo "pdserve env: installing $(compgen -G "$wheels/*.whl" | wc -l) wheels from $wheels into $site"
  if ! "$py" -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --upgrade \
        --target "$site" "$wheels"/*.whl; then
    echo "pdserve env: FAILED: '$py -m pip install --no-deps --no-index --target $site $wheels/*.whl' failed" \
         "(see pip's message above); the servers' dependencies are missing" >&2
    return 1
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
}

# Unpack the carried .debs and put on LD_LIBRARY_PATH only the libraries the system's
# loader cache lacks: Debian 12's builds fill gaps in the image (Ubuntu 24.04) but never
# replace its own libraries (its libssl, libgnutls, ... stay the ones its Python uses).
_pdserve_env_debs() {
  local wheels=$1 debs=$2 deb lib name cache
  if ! command -v dpkg >/dev/null; then
    echo "pdserve env: FAILED: no dpkg to unpack $wheels/*.deb" >&2
    return 1
  fi
  mkdir -p "$debs" || return 1
  for deb in "$wheels"/*.deb; do
    if ! dpkg -x "$deb" "$debs"; then
      echo "pdserve env: FAILED: dpkg -x $deb $debs" >&2
      return 1
    fi
  done
  # A here-string, not a pipe: `ldconfig -p | grep -q` fails under pipefail when grep
  # stops reading early.
  cache=$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true)
  rm -rf "$debs/gaps" && mkdir -p "$debs/gaps" || return 1
  local linked=() libs=("$debs"/usr/lib/x86_64-linux-gnu/*.so.* "$debs"/lib/x86_64-linux-gnu/*.so.*)
  # The loader looks libraries up by soname (libcurl.so.4), which Debian ships as a link
  # to the versioned file (libcurl.so.4.8.0): those files need no entry of their own.
  local -A versioned=()
  for lib in "${libs[@]}"; do
    [[ -L $lib ]] && versioned[$(readlink "$lib")]=1
  done
  for lib in "${libs[@]}"; do
    name=${lib##*/}
    [[ -e $lib && -z ${versioned[$name]:-} ]] || continue
    if [[ -n $cache ]] && grep -q "^[[:space:]]*${name//./\\.} (libc6,x86-64" <<<"$cache"; then
      continue
    fi
    ln -sf "$lib" "$debs/gaps/$name"
    linked+=("$name")
  done
  echo "pdserve env: from the carried .debs (the system lacks them): ${linked[*]:-none}"
  export LD_LIBRARY_PATH="$debs/gaps${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# One line a module; for Mooncake's engine, the libraries its engine.so cannot find.
# Then the image's packages against IMAGE_REQUIRES.txt (when the folder has one).
_pdserve_env_check() {
  local py=$1 requires=$2
  shift 2
  "$py" - "$requires" "$@" <<'PY'
import importlib, importlib.metadata, importlib.util, os, subprocess, sys

requires, modules = sys.argv[1], sys.argv[2:]
bad = 0
for mod in modules:
    try:
        importlib.import_module(mod)
        print(f"pdserve env: import {mod}: ok", flush=True)
    except BaseException as e:  # an extension's SystemError or ImportError alike
        bad += 1
        print(f"pdserve env: import {mod}: FAILED: {type(e).__name__}: {e}", flush=True)
        spec = importlib.util.find_spec(mod.split(".")[0]) if mod == "mooncake.engine" else None
        for where in (spec.submodule_search_locations or []) if spec else []:
            so = os.path.join(where, "engine.so")
            if os.path.exists(so):
                ldd = subprocess.run(["ldd", so], capture_output=True, text=True).stdout
                missing = [line.strip() for line in ldd.splitlines() if "not found" in line]
                print(f"pdserve env:   ldd {so}: " + ("; ".join(missing) or "no library missing"), flush=True)
if os.path.exists(requires):
    try:
        from packaging.requirements import Requirement
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
    count = 0
    for line in open(requires):
        text, _, who = line.partition("#")
        if not text.strip():
            continue
        count += 1
        req = Requirement(text.strip())
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            bad += 1
            print(f"pdserve env: image: {req} (for {who.strip()}) FAILED: "
                  + (f"has {have}" if have else "not installed"), flush=True)
    print(f"pdserve env: image: {count} requirements of the carried wheels checked", flush=True)
sys.exit(1 if bad else 0)
PY
}

_pdserve_env() {
  local wheels=${PDSERVE_WHEELS:-.whl} py=${PDSERVE_PYTHON:-python3}
  local site=${PDSERVE_SITE:-/tmp/pdserve-wheels} debs=${PDSERVE_DEBS:-/tmp/pdserve-debs}
  local carried=0
  if compgen -G "$wheels/*.whl" >/dev/null; then
    carried=1
    _pdserve_env_install "$wheels" "$py" "$site" || return 1
  fi
  if compgen -G "$wheels/*.deb" >/dev/null; then
    _pdserve_env_debs "$wheels" "$debs" || return 1
  fi
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  if ! _pdserve_env_check "$py" "$wheels/IMAGE_REQUIRES.txt" "${PDSERVE_ENV_MODULES[@]}"; then
    if ((carried)); then
      echo "pdserve env: FAILED: the carried set is incomplete for this machine (lines above)" >&2
      return 2
    fi
    echo "pdserve env: no wheels in $wheels (scripts/gpu_wheels.sh fills it): the servers cannot run here"
  fi
  return 0
}

_pdserve_env
_pdserve_env_rc=$?
unset -f _pdserve_env _pdserve_env_install _pdserve_env_debs _pdserve_env_check
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
return "$_pdserve_env_rc"
