"""What travels to the GPU machine (scripts/gpu_wheels.py, gpu_env.sh, gpu_mirror_env.py):
the resolver's decisions without network (markers for the target, what the image
provides, the refusals, the manifest, Mooncake's slimming), the CPU stand-in of the GPU
image, and, where PyPI answers, the whole set resolved for this interpreter, installed
on that stand-in by gpu_env.sh and imported there."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.network import pypi_reachable

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gw = load("gpu_wheels")
Requirement = gw.Requirement
SpecifierSet = gw.SpecifierSet
ENV_312 = gw.target_environment("3.12")


def make_wheel(folder: Path, name: str, version: str, requires: list[str] = (), files: dict[str, bytes] = None) -> Path:
    """A minimal wheel: METADATA with Requires-Dist, the given files, a RECORD naming all."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                    *(f"Requires-Dist: {r}\n" for r in requires)])
    entries = {**(files or {}), f"{dist}.dist-info/METADATA": meta.encode()}
    record = "".join(f"{n},,\n" for n in entries) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for n, data in {**entries, f"{dist}.dist-info/RECORD": record.encode()}.items():
            zf.writestr(n, data)
    return path


# --- markers and the image ------------------------------------------------------------

@pytest.mark.fast
@pytest.mark.parametrize("text, version, extras, expected", [
    ('typing-extensions>=4.10.0; python_version < "3.13"', "3.12", (), True),
    ('typing-extensions>=4.10.0; python_version < "3.13"', "3.13", (), False),
    ('triton; platform_system == "Linux" and platform_machine == "x86_64"', "3.12", (), True),
    ('cffi; implementation_name == "pypy"', "3.12", (), False),
    ('pywin32; sys_platform == "win32"', "3.12", (), False),
    ('opentelemetry-sdk>=1.44.0; extra == "standard"', "3.12", (), False),
    ('opentelemetry-sdk>=1.44.0; extra == "standard"', "3.12", ("standard",), True),
    ("tzdata; (platform_system == 'Windows') and extra == 'timezone'", "3.12", ("timezone",), False),
    ('exceptiongroup; python_full_version < "3.12.2"', "3.12", (), False),  # the image's 3.12.3
    ("numpy", "3.11", (), True),
])
def test_markers_are_evaluated_for_the_target(text, version, extras, expected):
    assert gw.applies(Requirement(text), gw.target_environment(version), extras) is expected


@pytest.mark.fast
def test_target_python_versions():
    assert ENV_312["python_full_version"] == "3.12.3" and ENV_312["python_version"] == "3.12"
    assert gw.target_environment("3.11")["python_full_version"] == "3.11.0"
    assert gw.target_environment("3.13.1")["python_version"] == "3.13"
    with pytest.raises(gw.ResolveError, match="MAJOR.MINOR"):
        gw.target_environment("3")


@pytest.mark.fast
def test_image_list_parses_with_versions_where_known():
    image = gw.read_image_list()
    assert str(image["torch"]).startswith("2.11.0") and str(image["numpy"]) == "2.5.2"
    assert image["huggingface-hub"] is not None and image["typing-extensions"] is None
    for absent in ("fastapi", "uvicorn", "pyzmq", "xgrammar", "pydantic", "starlette", "opentelemetry-api"):
        assert absent not in image


@pytest.mark.fast
@pytest.mark.parametrize("name, spec, provided, why", [
    ("fastapi", ">=0.110", False, "not in the image"),
    ("torch", ">=2.5", True, "the image has 2.11.0+cu130"),  # a local label satisfies >=
    ("numpy", "<2.4", False, "the image has 2.5.2, which is not <2.4"),
    ("Huggingface_Hub", ">=1.0", True, "the image has 1.33.0"),  # names normalised
    ("anyio", ">=4.1.0", True, "version unknown"),
    ("typing_extensions", ">=4.8", False, "pydantic needs a recent one"),  # carried regardless
])
def test_what_the_image_provides(name, spec, provided, why):
    got, reason = gw.image_provides(name, SpecifierSet(spec), gw.read_image_list())
    assert got is provided and why in reason


@pytest.mark.fast
def test_pins_are_checked_against_the_requirement():
    assert gw.pinned_spec(Requirement("fastapi>=0.110")) == "fastapi==0.165.0"
    assert gw.pinned_spec(Requirement("Some_Lib>=1")) == "some-lib>=1"
    with pytest.raises(gw.ResolveError, match=r"fastapi: the pin 0.165.0 .* fastapi<0.100"):
        gw.pinned_spec(Requirement("fastapi<0.100"))


@pytest.mark.fast
def test_roots_are_pdserves_dependencies_and_mooncake():
    names = {gw.canonicalize_name(r.name) for r in gw.root_requirements()}
    assert {"torch", "fastapi", "uvicorn", "pyzmq", "xgrammar", gw.MOONCAKE} <= names


# --- the resolution, with a fake index ------------------------------------------------

@pytest.fixture
def fake_index(tmp_path, monkeypatch):
    """pip_download served from a dict {name: [(version, requires)]}: the newest allowed."""
    index: dict[str, list[tuple[str, list[str]]]] = {}
    built = tmp_path / "built"
    built.mkdir()

    def download(spec, why, dest, python_version, platforms, python=None):
        req = Requirement(spec)
        name = gw.canonicalize_name(req.name)
        versions = [(v, r) for v, r in index.get(name, []) if req.specifier.contains(v)]
        if not versions:
            raise gw.ResolveError(f"{spec} (required as: {why}) is neither provided by the image nor downloadable")
        version, requires = max(versions, key=lambda vr: gw.Version(vr[0]))
        out = Path(dest) / f"dl-{name}"
        out.mkdir()
        return make_wheel(out, name, version, requires)

    monkeypatch.setattr(gw, "pip_download", download)
    return index


def resolve(roots: list[str], tmp_path: Path, image: dict | None = None):
    staging = tmp_path / "staging"
    staging.mkdir(exist_ok=True)
    image = gw.read_image_list() if image is None else image
    return gw.resolve_wheels([Requirement(r) for r in roots], image, ENV_312, staging, "3.12", gw.PLATFORMS)


@pytest.mark.fast
def test_resolution_follows_requires_dist_for_the_target(fake_index, tmp_path, monkeypatch):
    monkeypatch.setattr(gw, "PINS", {"web": "1.0"})
    fake_index.update({
        "web": [("1.0", ["anyio>=4", "models>=2", 'winonly; sys_platform == "win32"', 'sdk; extra == "otel"',
                         'typing-extensions>=4.10; python_version < "3.13"']),
                ("2.0", [])],
        "models": [("2.1", ["typing-extensions>=4.12"]), ("3.0", [])],
        "typing-extensions": [("4.16.0", [])],
    })
    res = resolve(["web", "models<3", "torch>=2.5"], tmp_path)
    assert {n: c.version for n, c in res.carried.items()} == {"web": "1.0", "models": "2.1", "typing-extensions": "4.16.0"}
    assert res.carried["models"].reasons == ["pdserve requires models<3", "web 1.0 requires models>=2"]
    assert "image's version is unknown" in res.carried["typing-extensions"].note
    assert [str(r) for r, _ in res.from_image] == ["torch>=2.5", "anyio>=4"]
    assert "anyio>=4  # web 1.0" in gw.image_requires_text(res)


@pytest.mark.fast
def test_extras_pull_their_requirements(fake_index, tmp_path):
    fake_index.update({"web": [("1.0", ['sdk>=1; extra == "otel"'])], "sdk": [("1.5", [])]})
    res = resolve(["web[otel]"], tmp_path)
    assert set(res.carried) == {"web", "sdk"}


@pytest.mark.fast
def test_a_requirement_nobody_provides_is_refused(fake_index, tmp_path):
    fake_index.update({"web": [("1.0", ["ghost>=1"])]})
    with pytest.raises(gw.ResolveError, match=r"ghost>=1 \(required as: web 1.0 requires ghost>=1\)"):
        resolve(["web"], tmp_path)


@pytest.mark.fast
def test_two_versions_of_one_package_are_refused(fake_index, tmp_path):
    fake_index.update({"a": [("1.0", ["c>=2"])], "b": [("1.0", ["deep"])], "deep": [("1.0", ["c<2"])],
                       "c": [("1.0", []), ("2.0", [])]})
    with pytest.raises(gw.ResolveError, match=r"two versions of c needed: 2.0 is carried .* deep 1.0 requires c<2"):
        resolve(["a", "b"], tmp_path)


@pytest.mark.fast
def test_an_image_version_too_old_is_carried(fake_index, tmp_path):
    fake_index.update({"numpy": [("2.3.0", [])]})
    res = resolve(["numpy<2.4"], tmp_path)
    assert res.carried["numpy"].note == "the image has 2.5.2, which is not ==2.3.0"


# --- refusals on the folder -----------------------------------------------------------

@pytest.mark.fast
def test_one_version_per_package_in_the_folder(tmp_path):
    ok = [tmp_path / "pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.whl",
          tmp_path / "pydantic-2.14.4-py3-none-any.whl", tmp_path / "libcurl4_7.88.1_amd64.deb", tmp_path / "MANIFEST.txt"]
    gw.check_one_version(ok)
    with pytest.raises(gw.ResolveError, match="two versions of pydantic-core"):
        gw.check_one_version([*ok, tmp_path / "pydantic_core-2.41.0-cp312-cp312-manylinux_2_17_x86_64.whl"])
    with pytest.raises(gw.ResolveError, match="two versions of libcurl4"):
        gw.check_one_version([*ok, tmp_path / "libcurl4_8.5.0_amd64.deb"])


@pytest.mark.fast
def test_the_travel_size_is_capped():
    mib = 1024 * 1024
    gw.check_travel_size(40 * mib, 24 * mib)
    with pytest.raises(gw.ResolveError, match=r"\(40.0 MiB\) plus the git tree \(25.0 MiB\) is 65.0 MiB, over .* 64 MiB"):
        gw.check_travel_size(40 * mib, 25 * mib)


@pytest.mark.skipif(not (REPO / ".git").exists() or shutil.which("git") is None, reason="needs the git checkout")
def test_tree_bytes_counts_what_git_sends():
    assert 1 * 1024 * 1024 < gw.tree_bytes() < gw.TRAVEL_LIMIT_BYTES


@pytest.mark.fast
def test_manifest_lists_each_file_its_size_and_why(tmp_path):
    whl = make_wheel(tmp_path, "fastapi", "0.165.0")
    deb = tmp_path / "libcurl4_7.88.1_amd64.deb"
    deb.write_bytes(b"x" * 1000)
    res = gw.Resolution()
    res.carried["fastapi"] = gw.Carried("fastapi", "0.165.0", whl, reasons=["pdserve requires fastapi>=0.110"])
    res.debs["libcurl4"] = gw.Carried("libcurl4", "7.88.1", deb, reasons=["engine.so links libcurl.so.4"])
    res.from_image.append((Requirement("anyio>=4.1.0"), "fastapi 0.165.0"))
    res.assumed_libs["libssl.so.3"] = "libssl3"
    text = gw.manifest_text(res, "3.12", 5 * 1024 * 1024, "2026-12-06")
    lines = text.splitlines()
    assert f"{whl.name}\t{whl.stat().st_size}\tpdserve requires fastapi>=0.110" in lines
    assert f"{deb.name}\t1000\tengine.so links libcurl.so.4" in lines
    assert "for python 3.12 " in lines[0]
    assert "1 wheels, 1 .debs" in lines[1] and "+ 5.0 MiB git tree" in lines[1]
    assert "#   anyio>=4.1.0  <- fastapi 0.165.0" in lines and "#   libssl.so.3 (libssl3)" in lines


# --- Mooncake's wheel -----------------------------------------------------------------

@pytest.mark.fast
def test_slim_mooncake_drops_the_unused_binaries_and_libraries(tmp_path):
    libs = "mooncake_transfer_engine_non_cuda.libs"
    wheel = make_wheel(tmp_path, gw.MOONCAKE, "0.3.13.post1", files={
        "mooncake/__init__.py": b"",
        "mooncake/engine.so": b"\x7fELF...libglog-1.so...",
        f"{libs}/libglog-1.so": b"\x7fELF...libgflags-2.so...",  # kept through glog
        f"{libs}/libgflags-2.so": b"\x7fELF",
        "mooncake/store.so": b"\x7fELF...libzstd-3.so...",  # dropped, and with it zstd
        f"{libs}/libzstd-3.so": b"\x7fELF",
        "mooncake/transfer_engine_bench": b"\x7fELF" + b"0" * 1000,
    })
    gw.slim_mooncake(wheel)
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        record = zf.read(next(n for n in names if n.endswith("RECORD"))).decode()
    assert {"mooncake/engine.so", f"{libs}/libglog-1.so", f"{libs}/libgflags-2.so"} <= names
    for gone in ("mooncake/store.so", f"{libs}/libzstd-3.so", "mooncake/transfer_engine_bench"):
        assert gone not in names and gone not in record
    assert "mooncake/engine.so,," in record


# --- the CPU stand-in of the image, and gpu_env.sh ------------------------------------

@pytest.fixture(scope="module")
def mirror(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("mirror") / "env"
    out = subprocess.run([sys.executable, str(SCRIPTS / "gpu_mirror_env.py"), str(dest)],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    python = Path(out.strip().splitlines()[-1])
    assert python == dest / "bin" / "python"
    return python


def test_mirror_has_the_images_packages_and_not_pdserves_extras(mirror):
    pytest.importorskip("torch")
    code = ("import importlib.util as u, torch, numpy\n"
            "print(*[m for m in ('fastapi', 'zmq', 'xgrammar', 'mooncake', 'pydantic', 'pdserve') if u.find_spec(m)])")
    proc = subprocess.run([str(mirror), "-c", code], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""  # none of them importable there


def source_gpu_env(env: dict[str, str], after: str = "") -> subprocess.CompletedProcess:
    """Source gpu_env.sh as the GPU scripts do (set -uo pipefail) and report its status."""
    script = f'set -uo pipefail; source "{SCRIPTS}/gpu_env.sh"; rc=$?; echo "rc=$rc pwd=$PWD"; {after}'
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_LIBRARY_PATH")}
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={**base, **env},
                          cwd="/", timeout=300)


def test_gpu_env_without_wheels_reports_and_goes_on(mirror, tmp_path):
    proc = source_gpu_env({"PDSERVE_WHEELS": str(tmp_path), "PDSERVE_PYTHON": str(mirror)}, 'echo "PP=$PYTHONPATH"')
    assert f"rc=0 pwd={REPO}" in proc.stdout, proc.stdout + proc.stderr
    assert f"PP={REPO}\n" in proc.stdout
    assert "pdserve env: import fastapi: FAILED: ModuleNotFoundError" in proc.stdout


def test_gpu_env_fails_loudly_when_pip_does(mirror, tmp_path):
    (tmp_path / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    proc = source_gpu_env({"PDSERVE_WHEELS": str(tmp_path), "PDSERVE_PYTHON": str(mirror),
                           "PDSERVE_SITE": str(tmp_path / "site")})
    assert "rc=1 " in proc.stdout and "pdserve env: FAILED" in proc.stderr, proc.stdout + proc.stderr


@pytest.mark.skipif(not pypi_reachable(), reason="needs PyPI (https://pypi.org) to download the wheels")
def test_the_resolved_set_installs_and_imports_on_the_mirror(mirror, tmp_path):
    """The whole set for this interpreter (with the .debs where apt works), installed by
    gpu_env.sh on the stand-in of the image: the servers' modules import. An empty loader
    cache (a stub ldconfig) makes gpu_env.sh use every carried library, as on an image
    that lacks them all."""
    wheels = tmp_path / "whl"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    debs = shutil.which("apt-get") is not None and shutil.which("dpkg") is not None
    cmd = [sys.executable, str(SCRIPTS / "gpu_wheels.py"), "--dest", str(wheels), "--python-version", version]
    build = subprocess.run(cmd + ([] if debs else ["--no-debs"]), capture_output=True, text=True, timeout=240)
    assert build.returncode == 0, build.stderr
    manifest = (wheels / "MANIFEST.txt").read_text()
    for carried in ("fastapi-", "uvicorn-", "pyzmq-", "xgrammar-", "pydantic-", "opentelemetry_api-",
                    "apache_tvm_ffi-", "typing_extensions-", "mooncake_transfer_engine_non_cuda-"):
        assert f"\n{carried}" in manifest, carried
    env = {"PDSERVE_WHEELS": str(wheels), "PDSERVE_PYTHON": str(mirror), "PDSERVE_SITE": str(tmp_path / "site"),
           "PDSERVE_DEBS": str(tmp_path / "debs")}
    if debs:
        stub = tmp_path / "stub"
        stub.mkdir()
        (stub / "ldconfig").write_text("#!/bin/sh\nexit 0\n")
        (stub / "ldconfig").chmod(0o755)
        env["PATH"] = f"{stub}:{os.environ['PATH']}"
    check = '"$PDSERVE_PYTHON" -c "import fastapi, uvicorn, zmq, xgrammar, mooncake.engine, pdserve.server.app"'
    proc = source_gpu_env(env, f'{check} && echo IMPORTED; echo "LD=${{LD_LIBRARY_PATH:-}}"')
    out = proc.stdout + proc.stderr
    assert "rc=0 " in proc.stdout and "IMPORTED" in proc.stdout, out
    for module in ("fastapi", "uvicorn", "zmq", "xgrammar", "mooncake.engine"):
        assert f"pdserve env: import {module}: ok" in proc.stdout, out
    assert "requirements of the carried wheels checked" in proc.stdout and "image: " in proc.stdout
    if debs:
        assert "libcurl.so.4" in proc.stdout and "libibverbs.so.1" in proc.stdout, out
        assert f"LD={tmp_path / 'debs' / 'gaps'}" in proc.stdout
