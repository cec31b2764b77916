"""The built wheel, not the checkout: one top-level package, `runtime`, holding every package."""
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
# repository folder -> the package it installs as
FOLDERS = {"runtime": "runtime", "plugins": "runtime/plugins", "platforms": "runtime/platforms",
           "attention_backends": "runtime/attention_backends",
           "quantization": "runtime/quantization"}
GENERIC = ("plugins", "platforms", "attention_backends", "quantization")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Build the wheel from a copy of the sources (building in place would leave build/ behind)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "--no-index", "-q", "-w", str(root / "dist"),
                           str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return next((root / "dist").glob("runtime-*.whl"))


def test_only_runtime_is_at_the_top_of_the_wheel(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"runtime"}


def test_every_package_of_the_checkout_is_in_the_wheel(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = []
    for folder, package in FOLDERS.items():
        for source in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in source.parts:
                continue
            relative = source.relative_to(ROOT / folder).as_posix()
            if f"{package}/{relative}" not in names:
                missing.append(f"{folder}/{relative}")
    assert not missing, ("files of the checkout missing from the wheel (a package left out of "
                         f"[tool.setuptools] packages in pyproject.toml?): {missing[:10]}")


def test_the_installed_namespace_imports_and_nothing_generic_does(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = textwrap.dedent(f"""
        import importlib.util, sys
        sys.path.insert(0, {str(site)!r})
        import runtime.plugins, runtime.platforms.cpu, runtime.attention_backends.torch_paged
        import runtime.quantization.registry
        from runtime.plugins import hookimpl
        for module in (runtime, runtime.plugins, runtime.platforms.cpu,
                       runtime.quantization.registry):
            assert module.__file__.startswith({str(site)!r}), module.__file__
        for name in {GENERIC!r}:
            assert importlib.util.find_spec(name) is None, (name, importlib.util.find_spec(name))
        print("ok")
    """)
    # -I: neither the checkout (cwd) nor PYTHONPATH is on sys.path, only the unpacked wheel
    proc = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path,
                          capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
