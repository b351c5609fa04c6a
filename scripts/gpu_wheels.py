#!/usr/bin/env python3
"""Gather everything the GPU machine lacks to run pdserve's servers into one folder.

The GPU machine has no network; its image (scripts/gpu_image_packages.txt) holds torch,
transformers and a long list of other packages, but not fastapi, uvicorn, pyzmq,
xgrammar, pydantic or Mooncake. Starting from pdserve's runtime dependencies
(pyproject.toml) plus Mooncake's non-CUDA transfer engine, this downloads, for the
target interpreter (CPython 3.12 on manylinux x86_64 by default: the image's), every
wheel the image does not provide, following each wheel's Requires-Dist; slims
Mooncake's wheel; downloads the Debian packages Mooncake's engine.so links that the
image may lack; and writes MANIFEST.txt (what travels and why) and IMAGE_REQUIRES.txt
(what the carried wheels expect of the image, checked there by scripts/gpu_env.sh).

It refuses (non-zero exit, naming the package and requirement) whatever would leave
the set incomplete or too big to travel: a requirement neither provided nor
downloadable, two versions of one package, or more than the device call carries.

    python3 scripts/gpu_wheels.py [--dest .whl] [--python-version 3.12] [--no-debs]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import email.parser
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Iterable, Mapping

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # an interpreter without packaging still has pip's copy
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename  # type: ignore[no-redef]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parent.parent
IMAGE_LIST = REPO / "scripts" / "gpu_image_packages.txt"
# The image's interpreter: markers on python_full_version are evaluated against it.
IMAGE_PYTHON = "3.12.3"
MOONCAKE = "mooncake-transfer-engine-non-cuda"
# The device call carries the working tree (tracked and untracked, not ignored) plus
# the carried folder: 64 MiB in all.
TRAVEL_LIMIT_BYTES = 64 * 1024 * 1024

# The versions carried, in one table: a package the resolution needs takes its pin (a
# pin that does not satisfy a requirement on it is refused); one without a pin takes
# the newest release its requirements allow. Pinned so that a rerun carries what the
# GPU proof was checked with.
PINS: dict[str, str] = {
    "mooncake-transfer-engine-non-cuda": "0.3.13.post1",
    "xgrammar": "0.2.9",
    "fastapi": "0.165.0",
    "starlette": "1.10.0",
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5",
    "uvicorn": "0.55.0",
    "pyzmq": "27.3.0",
    # fastapi >= 0.16x imports opentelemetry at import time (fastapi.telemetry).
    "opentelemetry-api": "1.45.3",
    # xgrammar's runtime (its compiled grammar engine is built on TVM's FFI).
    "apache-tvm-ffi": "0.1.15.post2",
    "typing-extensions": "4.16.0",
}

# Carried although the image has them: pydantic 2.14 and pydantic-core need
# typing-extensions >= 4.16 (typing-inspection >= 4.15), and the image's version is
# unknown; an older one breaks `import pydantic` (hence fastapi) there.
ALWAYS_CARRY: dict[str, str] = {
    "typing-extensions": "the image's version is unknown and pydantic needs a recent one",
}

# manylinux tags pip may take (it matches each exactly). Capped at glibc 2.28 so the
# set also loads on this machine (Debian 12, glibc 2.36) for rehearsals; the image is
# Ubuntu 24.04 (glibc 2.39).
PLATFORMS: tuple[str, ...] = (
    "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
    "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64",
)

# Mooncake's wheel carries a 42 MB benchmark and its store / master binaries: the
# transfer engine (mooncake.engine) needs none of them, and the device call carries
# 64 MiB at most. The bundled libraries only those needed go too (see slim_mooncake).
MOONCAKE_UNUSED = frozenset({
    "mooncake/transfer_engine_bench", "mooncake/mooncake_client", "mooncake/mooncake_master", "mooncake/store.so",
})

# The Debian packages of the system libraries Mooncake's engine.so links (readelf -d):
# the image may lack them (a CUDA image is built minimal). What they link in turn comes
# along (apt-cache depends, pruned to what `ldd engine.so` really loads) except DEB_IMAGE_HAS.
DEB_ROOTS: dict[str, str] = {
    "libibverbs1": "engine.so and libasio.so link libibverbs.so.1 (even for TCP)",
    "libnuma1": "engine.so links libnuma.so.1",
    "libcurl4": "engine.so links libcurl.so.4",
}
# Libraries every Ubuntu 24.04 image running the image's Python has: glibc and the GCC
# runtime (Python, torch), OpenSSL, zlib and libffi (Python's ssl, zlib and ctypes
# modules; httpx and requests import ssl there), zstd (dpkg pre-depends on it).
DEB_IMAGE_HAS = frozenset({"libc6", "libgcc-s1", "libstdc++6", "libssl3", "zlib1g", "libffi8", "libzstd1"})


_START = time.monotonic()


def log(msg: str) -> None:
    print(f"gpu_wheels [{time.monotonic() - _START:5.1f}s]: {msg}", file=sys.stderr, flush=True)


class ResolveError(RuntimeError):
    """The carried set would be incomplete, inconsistent or too big: stop, say why."""


# --- the target and the image ---------------------------------------------------------

def target_environment(python_version: str) -> dict[str, str]:
    """PEP 508 marker variables of the target: CPython on x86_64 Linux, no extras."""
    parts = python_version.split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts):
        raise ResolveError(f"--python-version {python_version!r}: expected MAJOR.MINOR[.MICRO]")
    short = ".".join(parts[:2])
    if len(parts) >= 3:
        full = ".".join(parts[:3])
    elif IMAGE_PYTHON.startswith(short + "."):
        full = IMAGE_PYTHON
    else:
        full = short + ".0"
    return {
        "implementation_name": "cpython", "implementation_version": full, "os_name": "posix",
        "platform_machine": "x86_64", "platform_python_implementation": "CPython", "platform_release": "",
        "platform_system": "Linux", "platform_version": "", "python_full_version": full,
        "python_version": short, "sys_platform": "linux", "extra": "",
    }


def marker_holds(req: Requirement, env: Mapping[str, str], extra: str = "") -> bool:
    """Whether a requirement's marker holds on the target with one extra (or none) asked for."""
    return req.marker is None or req.marker.evaluate({**env, "extra": extra})


def applies(req: Requirement, env: Mapping[str, str], extras: Iterable[str] = ()) -> bool:
    """Whether a requirement holds on the target, with the given extras of its dependant asked for."""
    return any(marker_holds(req, env, extra) for extra in ("", *extras))


def read_image_list(path: Path = IMAGE_LIST) -> dict[str, Version | None]:
    """scripts/gpu_image_packages.txt as {normalised name: version, or None where unknown}."""
    image: dict[str, Version | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        image[canonicalize_name(name)] = Version(version) if version else None
    return image


def image_provides(name: str, specifier: SpecifierSet, image: Mapping[str, Version | None]) -> tuple[bool, str]:
    """(whether the image provides `name` for `specifier`, the reason in words)."""
    name = canonicalize_name(name)
    if name in ALWAYS_CARRY:
        return False, ALWAYS_CARRY[name]
    if name not in image:
        return False, "not in the image"
    version = image[name]
    if version is None:
        # The image is recent (read 2026-11); gpu_env.sh checks the real version there.
        return True, "in the image (version unknown)"
    if specifier.contains(version, prereleases=True):
        return True, f"the image has {version}"
    return False, f"the image has {version}, which is not {specifier}"


def pinned_spec(req: Requirement) -> str:
    """What to download for a requirement: its pin, refused if the requirement excludes it."""
    name = canonicalize_name(req.name)
    pin = PINS.get(name)
    if pin is None:
        return f"{name}{req.specifier}"
    if not req.specifier.contains(Version(pin), prereleases=True):
        raise ResolveError(f"{name}: the pin {pin} (PINS in {Path(__file__).name}) does not satisfy "
                           f"the requirement {req}")
    return f"{name}=={pin}"


def root_requirements(pyproject: Path = REPO / "pyproject.toml") -> list[Requirement]:
    """pdserve's runtime dependencies plus its `pd` extra (Mooncake's transfer engine)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    texts = list(project["dependencies"]) + list(project.get("optional-dependencies", {}).get("pd", []))
    reqs = [Requirement(text) for text in texts]
    if MOONCAKE not in {canonicalize_name(r.name) for r in reqs}:
        reqs.append(Requirement(MOONCAKE))
    return reqs


# --- wheels ---------------------------------------------------------------------------

@dataclasses.dataclass
class Carried:
    """One file that travels, and why."""

    name: str
    version: str
    path: Path
    reasons: list[str] = dataclasses.field(default_factory=list)
    # Why it travels although the image lists the package ("" when the image has none).
    note: str = ""
    requires: list[Requirement] = dataclasses.field(default_factory=list)
    extras_done: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class Resolution:
    carried: dict[str, Carried] = dataclasses.field(default_factory=dict)
    # Requirements the image meets, to be checked there: (requirement, who needs it).
    from_image: list[tuple[Requirement, str]] = dataclasses.field(default_factory=list)
    debs: dict[str, Carried] = dataclasses.field(default_factory=dict)
    # System libraries the carried ones load from the image ({soname: its package here}).
    assumed_libs: dict[str, str] = dataclasses.field(default_factory=dict)


def wheel_metadata(wheel: Path) -> tuple[str, str, list[Requirement]]:
    """(normalised name, version, Requires-Dist) from a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        metas = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(metas) != 1:
            raise ResolveError(f"{wheel.name}: expected one .dist-info/METADATA, found {metas}")
        msg = email.parser.Parser().parsestr(zf.read(metas[0]).decode("utf-8"))
    requires = [Requirement(text) for text in msg.get_all("Requires-Dist") or []]
    return canonicalize_name(msg["Name"]), msg["Version"], requires


def pip_download(spec: str, why: str, dest: Path, python_version: str, platforms: Iterable[str],
                 python: str = sys.executable) -> Path:
    """Download one wheel (no dependencies) for the target into an empty folder under dest."""
    out = Path(tempfile.mkdtemp(prefix="dl-", dir=dest))
    cmd = [python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp",
           *[arg for p in platforms for arg in ("--platform", p)], "-d", str(out), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(out.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        noise = "WARNING: Location"  # this machine's pip config names absent local indexes
        err = "\n".join(line for line in (proc.stderr + proc.stdout).splitlines() if noise not in line)
        raise ResolveError(f"{spec} (required as: {why}) is neither provided by the image nor downloadable "
                           f"as a CPython {python_version} manylinux x86_64 wheel:\n{err.strip()}")
    return wheels[0]


def check_one_version(files: Iterable[Path]) -> None:
    """Refuse a folder holding two versions (or two files) of one package: pip stops the
    whole --no-deps install on it, and which one won would be chance."""
    seen: dict[str, str] = {}
    for path in files:
        if path.suffix == ".whl":
            name = canonicalize_name(str(parse_wheel_filename(path.name)[0]))
        elif path.suffix == ".deb":
            name = "deb:" + path.name.split("_", 1)[0]
        else:
            continue
        if name in seen:
            raise ResolveError(f"two versions of {name.removeprefix('deb:')}: {seen[name]} and {path.name}")
        seen[name] = path.name


def resolve_wheels(roots: list[Requirement], image: Mapping[str, Version | None], env: Mapping[str, str],
                   staging: Path, python_version: str, platforms: Iterable[str], jobs: int = 8) -> Resolution:
    """Breadth first over Requires-Dist: each wave's new packages download in parallel."""
    res = Resolution()
    # (requirement, who needs it)
    pending: list[tuple[Requirement, str]] = [(r, "pdserve") for r in roots if applies(r, env)]
    while pending:
        wave: dict[str, list[tuple[Requirement, str]]] = {}
        for req, who in pending:
            name = canonicalize_name(req.name)
            why = f"{who} requires {req}"
            if name in res.carried:
                note_carried_again(res.carried[name], req, who)
                continue
            provided, _ = image_provides(name, req.specifier, image)
            if provided:
                if req.extras:
                    raise ResolveError(f"{why}: its extras {sorted(req.extras)} would need the dependencies of the "
                                       f"image's {name}, which this script cannot see; carry {name} (ALWAYS_CARRY)")
                res.from_image.append((req, who))
                continue
            wave.setdefault(name, []).append((req, who))
        pending = []
        specs = {name: combined_spec(name, reqs) for name, reqs in wave.items()}
        if specs:
            log("downloading " + " ".join(sorted(specs.values())))
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {name: pool.submit(pip_download, spec, "; ".join(f"{w} requires {r}" for r, w in wave[name]),
                                         staging, python_version, platforms)
                       for name, spec in specs.items()}
        for name, future in futures.items():
            wheel = future.result()
            got, version, requires = wheel_metadata(wheel)
            if got != name:
                raise ResolveError(f"asked pip for {specs[name]}, got {wheel.name}")
            final = staging / wheel.name
            wheel.replace(final)
            wheel.parent.rmdir()
            note = image_provides(name, SpecifierSet(f"=={version}"), image)[1] if name in image else ""
            item = Carried(name, version, final, note=note, requires=requires)
            res.carried[name] = item
            for req, who in wave[name]:
                item.reasons.append(f"{who} requires {req}")
                pending += new_requirements(item, req.extras, env)
    return res


def combined_spec(name: str, reqs: list[tuple[Requirement, str]]) -> str:
    """One download spec for all of a wave's requirements on one package."""
    merged = Requirement(name)
    for req, _ in reqs:
        merged.specifier &= req.specifier
    return pinned_spec(merged)


def new_requirements(item: Carried, extras: Iterable[str], env: Mapping[str, str]) -> list[tuple[Requirement, str]]:
    """The requirements of a carried wheel not followed yet: its own the first time, then
    those of extras asked for later."""
    done = item.extras_done  # the extras ("" for none) whose requirements were followed
    wanted = {""} | {canonicalize_name(e) for e in extras}
    out = [(req, f"{item.name} {item.version}") for req in item.requires
           if any(marker_holds(req, env, e) for e in wanted - done)
           and not any(marker_holds(req, env, e) for e in done)]
    item.extras_done |= wanted
    return out


def note_carried_again(item: Carried, req: Requirement, who: str) -> None:
    """A later requirement on a package already carried: it must accept the carried version."""
    if not req.specifier.contains(Version(item.version), prereleases=True):
        raise ResolveError(f"two versions of {item.name} needed: {item.version} is carried "
                           f"({'; '.join(item.reasons)}), but {who} requires {req}; pin one both accept in PINS")
    item.reasons.append(f"{who} requires {req}")


# --- Mooncake's wheel -----------------------------------------------------------------

def slim_mooncake(wheel: Path) -> None:
    """Drop MOONCAKE_UNUSED and the bundled libraries (.libs/) that no kept file links,
    and rewrite RECORD to match, so pip still installs the wheel."""
    with zipfile.ZipFile(wheel) as src:
        items = {info.filename: info for info in src.infolist()}
        kept = [name for name in items if name not in MOONCAKE_UNUSED and ".libs/" not in name]
        bundled = [name for name in items if ".libs/" in name]
        # A bundled library stays if a kept file names it (ELF NEEDED entries are strings
        # in the file): followed to a fixed point, since libraries link each other.
        frontier = [data for data in map(src.read, kept) if data.startswith(b"\x7fELF")]
        while frontier:
            data = frontier.pop()
            for lib in list(bundled):
                if Path(lib).name.encode() in data:
                    bundled.remove(lib)
                    kept.append(lib)
                    frontier.append(src.read(lib))
        dropped = set(items) - set(kept)
        slim = wheel.with_name(wheel.name + ".slim")
        with zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
            for name in kept:
                data = src.read(name)
                if re.fullmatch(r"[^/]+\.dist-info/RECORD", name):
                    lines = [line for line in data.decode().splitlines() if line.split(",")[0] not in dropped]
                    data = ("\n".join(lines) + "\n").encode()
                dst.writestr(items[name], data)
    slim.replace(wheel)


def wheel_elf_files(wheel: Path, into: Path) -> list[Path]:
    """Unpack a wheel's shared objects (for ldd): the paths of those unpacked."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".so") or ".so." in n]
        zf.extractall(into, names)
    return [into / n for n in names]


# --- Debian packages ------------------------------------------------------------------

def run(cmd: list[str], **kw: object) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    if proc.returncode != 0:
        raise ResolveError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr.strip()}")
    return proc.stdout


def deb_candidates(roots: Iterable[str]) -> dict[str, str]:
    """The roots and the library packages they depend on (apt-cache depends, recursively),
    short of DEB_IMAGE_HAS: {package: why}."""
    why = {root: DEB_ROOTS.get(root, "asked for") for root in roots}
    level = list(why)
    while level:  # one apt-cache call a level: each call takes a second or more
        out = run(["apt-cache", "depends", *level])
        level = []
        for pkg, body in re.findall(r"^(\S+)\n((?:[ |].*\n?)*)", out, re.M):
            for dep in re.findall(r"^\s*\|?(?:Pre)?Depends: ([^\s<>]+)\s*$", body, re.M):
                dep = dep.split(":")[0]
                # Only shared-library packages (Debian names them lib*): adduser & co.
                # are install-time tooling the libraries do not load.
                if dep.startswith("lib") and dep not in DEB_IMAGE_HAS and dep not in why:
                    why[dep] = f"{pkg} depends on it"
                    level.append(dep)
    return why


def ldd(paths: Iterable[Path], lib_dirs: Iterable[Path]) -> tuple[dict[str, str], list[str]]:
    """({soname: resolved path}, [sonames not found]) for everything the given ELF files load."""
    env = {**os.environ, "LD_LIBRARY_PATH": ":".join(str(d) for d in lib_dirs)}
    found: dict[str, str] = {}
    missing: list[str] = []
    for path in paths:
        for line in run(["ldd", str(path)], env=env).splitlines():
            m = re.match(r"\s*(\S+) => (.*?)(?: \(0x[0-9a-f]+\))?$", line)
            if not m:
                continue
            if m.group(2) == "not found":
                missing.append(m.group(1))
            elif m.group(2):
                found[m.group(1)] = m.group(2)
    return found, sorted(set(missing))


def system_package(path: str) -> str | None:
    """The Debian package a library of this machine comes from (merged /usr aware)."""
    for candidate in dict.fromkeys([path, "/usr" + path, os.path.realpath(path)]):
        proc = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True)
        if proc.returncode == 0:
            return proc.stdout.split(":", 1)[0]
    return None


def resolve_debs(mooncake_wheel: Path, staging: Path) -> tuple[dict[str, Carried], dict[str, str]]:
    """Download DEB_ROOTS and what they link, keep only the packages `ldd` shows the
    engine loading from them: ({package: Carried}, {soname left to the image: its package})."""
    why = deb_candidates(DEB_ROOTS)
    log("apt-get download " + " ".join(sorted(why)))
    work = Path(tempfile.mkdtemp(prefix="debs-", dir=staging))
    run(["apt-get", "download", *sorted(why)], cwd=work)
    log("ldd engine.so")
    debs = {deb.name.split("_", 1)[0]: deb for deb in work.glob("*.deb")}
    if set(debs) != set(why):
        raise ResolveError(f"apt-get download fetched {sorted(debs)}, not {sorted(why)}")
    lib_dirs: dict[Path, str] = {}
    for pkg, deb in debs.items():
        root = work / "x" / pkg
        root.mkdir(parents=True)
        run(["dpkg", "-x", str(deb), str(root)])
        for d in {p.parent for p in root.rglob("*.so*")}:
            lib_dirs[d] = pkg
    elf = wheel_elf_files(mooncake_wheel, work / "wheel")
    engine = [p for p in elf if p.name == "engine.so"]
    if not engine:
        raise ResolveError(f"{mooncake_wheel.name} has no mooncake/engine.so")
    found, missing = ldd(engine, [*lib_dirs, *{p.parent for p in elf}])
    if missing:
        raise ResolveError(f"mooncake/engine.so needs {', '.join(missing)}: neither carried nor on this machine; "
                           f"add its Debian package to DEB_ROOTS")
    needed: dict[str, list[str]] = {}
    assumed: dict[str, str] = {}
    wheel_root = str(work / "wheel")
    for soname, path in found.items():
        owner = next((pkg for d, pkg in lib_dirs.items() if Path(path).parent == d), None)
        if owner:
            needed.setdefault(owner, []).append(soname)
        elif not path.startswith(wheel_root):
            # Loaded from this machine: fine only for what the image surely has.
            pkg = system_package(path)
            if pkg not in DEB_IMAGE_HAS:
                raise ResolveError(f"mooncake/engine.so loads {soname} from {path} ({pkg or 'no Debian package'}), "
                                   f"which is neither carried nor in DEB_IMAGE_HAS: add its package to DEB_ROOTS")
            assumed[soname] = pkg
    carried: dict[str, Carried] = {}
    for pkg in sorted(needed):
        final = staging / debs[pkg].name
        debs[pkg].replace(final)
        carried[pkg] = Carried(pkg, debs[pkg].name.split("_")[1], final,
                               reasons=[f"{why[pkg]}; ldd engine.so loads {', '.join(sorted(needed[pkg]))}"])
    shutil.rmtree(work)
    return carried, assumed


# --- size, manifest, output -----------------------------------------------------------

def tree_bytes(repo: Path = REPO, exclude: Path | None = None) -> int:
    """What the device call sends besides the carried folder: tracked and untracked,
    not ignored files (git ls-files)."""
    out = run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"])
    total = 0
    for rel in set(filter(None, out.split("\0"))):
        path = repo / rel
        if exclude is not None and exclude in path.parents:
            continue
        if path.is_file() or path.is_symlink():
            total += path.lstat().st_size
    return total


def check_travel_size(carried_bytes: int, tree: int, limit: int = TRAVEL_LIMIT_BYTES) -> None:
    if carried_bytes + tree > limit:
        mib = 1024 * 1024
        raise ResolveError(f"the carried set ({carried_bytes / mib:.1f} MiB) plus the git tree ({tree / mib:.1f} MiB) "
                           f"is {(carried_bytes + tree) / mib:.1f} MiB, over the device call's {limit / mib:.0f} MiB")


def manifest_text(res: Resolution, python_version: str, tree: int, today: str) -> str:
    items = sorted(res.carried.values(), key=lambda c: c.name) + sorted(res.debs.values(), key=lambda c: c.name)
    total = sum(c.path.stat().st_size for c in items)
    mib = 1024 * 1024
    lines = [
        # "python X.Y" on the first line: scripts/gpu_proof.sh greps it to reuse a folder.
        f"# Carried to the GPU machine for python {python_version} (CPython, manylinux x86_64), written by",
        f"# scripts/gpu_wheels.py on {today}: {len(res.carried)} wheels, {len(res.debs)} .debs, {total / mib:.1f} MiB "
        f"(+ {tree / mib:.1f} MiB git tree; the device call carries {TRAVEL_LIMIT_BYTES // mib} MiB).",
        "# file\tbytes\twhy",
    ]
    lines += [f"{c.path.name}\t{c.path.stat().st_size}\t{'; '.join(c.reasons)}"
              + (f" [in the image too, carried: {c.note}]" if c.note else "") for c in items]
    if res.from_image:
        lines.append("# From the image, not carried (checked there by gpu_env.sh, IMAGE_REQUIRES.txt):")
        lines += [f"#   {req}  <- {who}" for req, who in res.from_image]
    if res.assumed_libs:
        lines.append("# System libraries the carried ones load from the image (not carried; Debian package here):")
        lines += [f"#   {so} ({pkg})" for so, pkg in sorted(res.assumed_libs.items())]
    return "\n".join(lines) + "\n"


def image_requires_text(res: Resolution) -> str:
    """One requirement a line (markers already decided for the target), with who needs it."""
    lines = ["# Requirements of the carried wheels that the GPU image must meet (scripts/gpu_wheels.py)."]
    for req, who in res.from_image:
        lines.append(f"{canonicalize_name(req.name)}{req.specifier}  # {who}")
    return "\n".join(lines) + "\n"


def ensure_ignored(dest: Path) -> None:
    """A carried folder inside the repository must be git-ignored, else it travels twice."""
    try:
        rel = dest.resolve().relative_to(REPO)
    except ValueError:
        return
    if subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", str(rel) + "/"]).returncode == 0:
        return
    exclude = Path(run(["git", "-C", str(REPO), "rev-parse", "--git-path", "info/exclude"]).strip())
    exclude = exclude if exclude.is_absolute() else REPO / exclude
    exclude.parent.mkdir(parents=True, exist_ok=True)
    with exclude.open("a") as f:
        f.write(f"/{rel.as_posix()}/\n")
    print(f"added /{rel.as_posix()}/ to {exclude}")


def publish(staging: Path, dest: Path, manifest: str, requires: str) -> None:
    """Replace dest's wheels, .debs and lists with the staged ones (stale files would be
    a second version)."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in [*dest.glob("*.whl"), *dest.glob("*.deb"), dest / "MANIFEST.txt", dest / "IMAGE_REQUIRES.txt"]:
        old.unlink(missing_ok=True)
    for new in [*staging.glob("*.whl"), *staging.glob("*.deb")]:
        shutil.move(str(new), dest / new.name)
    (dest / "MANIFEST.txt").write_text(manifest)
    (dest / "IMAGE_REQUIRES.txt").write_text(requires)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=REPO / ".whl", help="the carried folder (default: .whl)")
    ap.add_argument("--python-version", default="3.12", help="the target interpreter (default: 3.12, the image's)")
    ap.add_argument("--platform", action="append", dest="platforms",
                    help="a pip --platform tag (repeatable; default: manylinux x86_64 up to glibc 2.28)")
    ap.add_argument("--no-debs", action="store_true", help="carry no Debian packages")
    ap.add_argument("--image-list", type=Path, default=IMAGE_LIST)
    args = ap.parse_args(argv)
    platforms = tuple(args.platforms or PLATFORMS)
    dest = args.dest.resolve()
    try:
        env = target_environment(args.python_version)
        image = read_image_list(args.image_list)
        dest.mkdir(parents=True, exist_ok=True)
        ensure_ignored(dest)
        with tempfile.TemporaryDirectory(prefix=".staging-", dir=dest) as tmp:
            staging = Path(tmp)
            res = resolve_wheels(root_requirements(), image, env, staging, args.python_version, platforms)
            mooncake = res.carried[canonicalize_name(MOONCAKE)].path
            log(f"slimming {mooncake.name}")
            slim_mooncake(mooncake)
            if not args.no_debs:
                res.debs, res.assumed_libs = resolve_debs(mooncake, staging)
            log("checking")
            check_one_version(staging.iterdir())
            tree = tree_bytes(exclude=dest)
            carried = sum(c.path.stat().st_size for c in [*res.carried.values(), *res.debs.values()])
            check_travel_size(carried, tree)
            manifest = manifest_text(res, args.python_version, tree, datetime.date.today().isoformat())
            publish(staging, dest, manifest, image_requires_text(res))
    except ResolveError as e:
        print(f"gpu_wheels: FAILED: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(manifest)
    print(f"{dest}: {carried / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
