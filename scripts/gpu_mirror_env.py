#!/usr/bin/env python3
"""A CPU stand-in of the GPU image's Python environment, for rehearsing what travels.

    python scripts/gpu_mirror_env.py DEST

makes DEST a fresh virtual environment of the interpreter running this script
(`python -m venv --without-pip`), then links into its site-packages every distribution
installed in the running environment whose name is in scripts/gpu_image_packages.txt (its
top-level packages and modules, from its RECORD, and its .dist-info folder). This
environment's versions may be newer than the image's and need what the image's do not
(huggingface-hub 2.x imports httpx2), so what those distributions require here is linked
too (printed), except the packages the image is known to lack (ABSENT: pdserve carries
them); --only-listed links the list alone. So DEST/bin/python imports torch,
transformers, numpy, httpx, ... (if the running environment has them) but not fastapi,
zmq, xgrammar, mooncake or pydantic, as on the GPU machine; scripts/gpu_env.sh
(PDSERVE_PYTHON=DEST/bin/python) then installs the carried wheels on top. Links, not
copies: it takes seconds, and a rerun recreates DEST. The last line printed is DEST's
python.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
import venv
from collections import defaultdict
from pathlib import Path, PurePosixPath

IMAGE_LIST = Path(__file__).resolve().parent / "gpu_image_packages.txt"
# Not in the GPU image (KINDS.md; pdserve carries them, scripts/gpu_wheels.py): never
# linked, even where a listed distribution requires one here (typer >= 0.2x: pydantic).
ABSENT = frozenset({
    "fastapi", "starlette", "uvicorn", "pyzmq", "xgrammar", "apache-tvm-ffi", "pydantic", "pydantic-core",
    "annotated-types", "typing-inspection", "opentelemetry-api", "mooncake-transfer-engine",
    "mooncake-transfer-engine-non-cuda",
})


def normalise(name: str) -> str:
    """PEP 503."""
    return re.sub(r"[-_.]+", "-", name).lower()


def image_names(path: Path = IMAGE_LIST) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(normalise(line.split("==", 1)[0]))
    return names


def installed() -> dict[str, importlib.metadata.Distribution]:
    """The running environment's distributions, the one imports would find per name."""
    found: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(normalise(name), dist)
    return found


def required_here(dists: dict[str, importlib.metadata.Distribution], names: set[str]) -> dict[str, str]:
    """{installed distribution not in names: which one needs it}: what the listed
    distributions require in this environment (no extras), transitively, short of ABSENT."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # an environment without packaging still has pip's copy
        from pip._vendor.packaging.requirements import Requirement

    extra: dict[str, str] = {}
    todo = sorted(names & set(dists))
    while todo:
        name = todo.pop()
        for text in dists[name].requires or []:
            req = Requirement(text)
            dep = normalise(req.name)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if dep in names or dep in extra or dep in ABSENT or dep not in dists:
                continue
            extra[dep] = name
            todo.append(dep)
    return extra


def dist_files(dist: importlib.metadata.Distribution) -> tuple[Path, list[PurePosixPath]]:
    """(the folder the distribution is installed in, its files relative to it), leaving
    out scripts installed elsewhere (../../bin) and byte-code caches."""
    base = Path(dist.locate_file("")).resolve()
    rels = []
    for f in dist.files or []:
        rel = PurePosixPath(f.as_posix())
        if rel.is_absolute() or ".." in rel.parts or "__pycache__" in rel.parts:
            continue
        rels.append(rel)
    return base, rels


def plan_links(dists: dict[str, importlib.metadata.Distribution], wanted: set[str]) -> dict[PurePosixPath, Path]:
    """{path in DEST's site-packages: what it links to}: for each file of a wanted
    distribution, its shallowest folder (or the file) that only wanted distributions own,
    so a namespace folder shared with an unwanted one (nvidia/, google/) is rebuilt one
    level deeper rather than linked whole."""
    files = {name: dist_files(dist) for name, dist in dists.items()}
    owners: dict[tuple[Path, PurePosixPath], set[str]] = defaultdict(set)
    for name, (base, rels) in files.items():
        for rel in rels:
            for depth in range(1, len(rel.parts) + 1):
                owners[base, PurePosixPath(*rel.parts[:depth])].add(name)
    links: dict[PurePosixPath, Path] = {}
    for name in sorted(wanted & set(files)):
        base, rels = files[name]
        for rel in rels:
            for depth in range(1, len(rel.parts) + 1):
                prefix = PurePosixPath(*rel.parts[:depth])
                if owners[base, prefix] <= wanted:
                    links.setdefault(prefix, base / prefix)
                    break
    # A link below another link would be written into the running environment itself.
    return {p: t for p, t in links.items() if not any(parent in links for parent in p.parents)}


def site_packages(dest: Path) -> Path:
    return dest / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def build(dest: Path, names: set[str], only_listed: bool = False) -> Path:
    """Recreate DEST and link the image's distributions into it: DEST's python."""
    if dest.exists() and any(dest.iterdir()) and not (dest / "pyvenv.cfg").exists():
        raise SystemExit(f"{dest} exists and is no virtual environment: not replacing it")
    venv.EnvBuilder(clear=True, symlinks=True, with_pip=False).create(dest)
    site = site_packages(dest)
    dists = installed()
    print(f"{len(names & set(dists))} of the image's {len(names)} distributions are installed here")
    if not only_listed:
        extra = required_here(dists, names)
        if extra:
            print("linked too (required here): " + ", ".join(f"{d} ({by})" for d, by in sorted(extra.items())))
        names = names | set(extra)
    without_record = sorted(n for n in names & set(dists) if dists[n].files is None)
    if without_record:
        print(f"not linked (no RECORD): {', '.join(without_record)}", file=sys.stderr)
    links = plan_links(dists, names)
    for rel, target in sorted(links.items()):
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() and target.exists():
            path.symlink_to(target)
    print(f"{len(links)} links into {site}")
    return dest / "bin" / "python"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dest", type=Path, help="the environment to (re)create")
    ap.add_argument("--image-list", type=Path, default=IMAGE_LIST)
    ap.add_argument("--only-listed", action="store_true", help="link the listed distributions alone")
    args = ap.parse_args(argv)
    python = build(args.dest.absolute(), image_names(args.image_list), args.only_listed)
    print(python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
