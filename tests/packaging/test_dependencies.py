"""What `runtime generate` and `LLM` import is declared by the base requirements and the `cpu`
extra: the README's first run installs only those (`pip install -e ".[cpu]"`), while this suite
runs with the test extras, which would hide a missing one (msgspec was).

A generate run in a subprocess records every module it loaded; each third-party module that our
own code imports (at the top of a file or inside a function that ran) must come from a
distribution reachable from `runtime`'s base + `cpu` requirements.
"""
from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import subprocess
import sys

from packaging.requirements import Requirement

PROBE = """
import json, sys
from runtime.cli.main import main
code = main(["--log-level", "WARNING", "generate", "--model", sys.argv[1], "--max-tokens", "2",
             "--kv-cache-memory", "64MiB", "Hello"])
mods = {name: getattr(m, "__file__", None) for name, m in list(sys.modules.items())}
print(json.dumps({"code": code, "modules": mods}))
"""


def _requirement_closure(extras: set[str]) -> set[str]:
    """Normalized names of every distribution `runtime` (with `extras`) pulls in."""
    def norm(name: str) -> str:
        return name.lower().replace("_", "-").replace(".", "-")

    seen: set[str] = set()
    todo = [("runtime", extras)]
    while todo:
        name, wanted = todo.pop()
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional dependency that this environment lacks pulls in nothing here
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not any(
                    req.marker.evaluate({"extra": extra}) for extra in wanted | {""}):
                continue
            key = norm(req.name)
            if key == "runtime":
                todo.append(("runtime", set(req.extras)))
            elif key not in seen:
                seen.add(key)
                todo.append((req.name, set(req.extras)))
    return seen


def _imported_names(path: str) -> set[str]:
    """Top-level module names that a source file imports anywhere (absolute imports)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_generate_needs_only_the_base_and_cpu_requirements(tiny_llama):
    done = subprocess.run([sys.executable, "-c", PROBE, tiny_llama], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["code"] == 0
    loaded = probe["modules"]
    ours = [f for name, f in loaded.items()
            if (name == "runtime" or name.startswith("runtime.")) and f and f.endswith(".py")]
    imported = set().union(*map(_imported_names, ours)) & set(loaded)
    third_party = {n for n in imported if n not in sys.stdlib_module_names and n != "runtime"}

    providers = importlib.metadata.packages_distributions()
    allowed = _requirement_closure({"cpu"})
    missing = {}
    for module in sorted(third_party):
        dists = {d.lower().replace("_", "-").replace(".", "-") for d in providers.get(module, [])}
        if not dists & allowed:
            missing[module] = sorted(dists) or ["(no distribution)"]
    assert not missing, (f"`runtime generate` imports modules that neither the base requirements "
                         f"nor the cpu extra install: {missing}")
