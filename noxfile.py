"""The single entry point for hyperrec: lint, tests, training and benchmarks.

    nox                      lint + every package's tests + integration (what CI runs)
    nox -s "tests(bbs)"      one package, in its own venv
    nox -s train             the main job: train the GEM-style model's tiny preset
    nox -s simulate          the Base Batch Shuffling load-balance simulation
    nox -s "bench(bbs)"      a package's benchmarks (GPU packages need CUDA)

Every venv installs torch through ``constraints/cpu.txt`` (the CPU build) so no
session ever resolves a multi-GB CUDA wheel. Each package's tests run in a venv
holding only that package, the hyperrec siblings it declares and its test extra,
so an import the package did not declare fails there.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import tomllib
from pathlib import Path

import nox

nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "tests", "integration"]

ROOT = Path(__file__).resolve().parent
CONSTRAINTS = str(ROOT / "constraints" / "cpu.txt")
PYTHON = "3.11"
_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _distributions() -> dict[str, Path]:
    """Map every local distribution name (``hyperrec-bbs``) to its directory."""
    dirs = sorted(p.parent for p in ROOT.glob("packages/*/pyproject.toml"))
    if (ROOT / "integration" / "pyproject.toml").exists():
        dirs.append(ROOT / "integration")
    out = {}
    for d in dirs:
        name = tomllib.loads((d / "pyproject.toml").read_text())["project"]["name"]
        out[_normalise(name)] = d
    return out


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _local_requirements(path: Path, extras: tuple[str, ...] = ()) -> set[str]:
    project = tomllib.loads((path / "pyproject.toml").read_text())["project"]
    reqs = list(project.get("dependencies", []))
    for extra in extras:
        reqs += project.get("optional-dependencies", {}).get(extra, [])
    names = {_normalise(m.group(1)) for r in reqs if (m := _REQ_NAME.match(r))}
    return {n for n in names if n.startswith("hyperrec-")}


def _install_local(session: nox.Session, path: Path, extras: tuple[str, ...] = ("test",)) -> None:
    """Install ``path`` editable with its hyperrec siblings (transitively) from local paths."""
    dists = _distributions()
    needed: set[str] = set()
    todo = list(_local_requirements(path, extras))
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        if name not in dists:
            session.error(f"{path.name} depends on {name}, which is not in this repository")
        needed.add(name)
        todo += _local_requirements(dists[name])
    args = ["-c", CONSTRAINTS]
    for name in sorted(needed):
        args += ["-e", str(dists[name])]
    suffix = f"[{','.join(extras)}]" if extras else ""
    args += ["-e", f"{path}{suffix}"]
    session.install(*args)


def _pytest(session: nox.Session, tests: Path) -> None:
    env = {
        # Triton kernels run on the CPU through the interpreter, so CI exercises the
        # real kernels at small shapes.
        "TRITON_INTERPRET": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",
    }
    session.run(
        "pytest",
        str(tests),
        "-c",
        str(ROOT / "pyproject.toml"),
        "--rootdir",
        str(ROOT),
        "-m",
        "not gpu and not multigpu",
        "--durations=8",
        *session.posargs,
        env=env,
    )


PACKAGES = sorted(p.parent.name for p in ROOT.glob("packages/*/pyproject.toml"))


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check, plus repository invariants."""
    session.install("-c", CONSTRAINTS, "ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    bad = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("**/src/hyperrec/__init__.py"))
    if bad:
        session.error(f"these files break the PEP 420 namespace: {bad}")
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    test_cmd = re.search(r"<!-- test-command -->\s*```(?:bash|sh)?\n(.+?)\n```", readme, re.S)
    if not test_cmd or test_cmd.group(1).strip() not in ci:
        session.error("README.md's test command and .ci/run disagree")
    for problem in _dialect_problems():
        session.error(problem)


#: The validation helpers every package's private ``_validate.py`` carries, identical
#: (see ARCHITECTURE.md, "The dialect").
SHARED_VALIDATORS = (
    "_what",
    "check_int",
    "check_float",
    "check_bool",
    "check_choice",
    "check_tensor",
)


def _dialect_problems() -> list[str]:
    """Repository-wide invariants of the dialect that a linter cannot see."""
    problems = []
    copies: dict[str, dict[str, str]] = {}
    for path in sorted(ROOT.glob("packages/*/src/hyperrec/*/_validate.py")):
        text = path.read_text()
        funcs = {
            node.name: ast.get_source_segment(text, node)
            for node in ast.parse(text).body
            if isinstance(node, ast.FunctionDef)
        }
        copies[str(path.relative_to(ROOT))] = {n: funcs.get(n, "") for n in SHARED_VALIDATORS}
    for name in SHARED_VALIDATORS:
        versions = [got[name] for got in copies.values() if got[name]]
        if not versions:
            continue
        # The version most packages carry is the reference; the others are reported.
        want = max(set(versions), key=versions.count)
        model = next(w for w, got in copies.items() if got[name] == want)
        for where, got in copies.items():
            if got[name] != want:
                what = "lacks" if not got[name] else "has a different"
                problems.append(f"{where} {what} {name}: copy it from {model}")
    # A runtime package never imports the dev-only hyperrec-testing.
    runtime = [p for p in ROOT.glob("packages/*/src/hyperrec/*") if p.name != "testing"]
    runtime += list(ROOT.glob("integration/src/hyperrec/*"))
    for pkg in runtime:
        for path in pkg.rglob("*.py"):
            if re.search(r"^\s*(from|import) hyperrec\.testing", path.read_text(), re.M):
                problems.append(f"{path.relative_to(ROOT)} imports hyperrec.testing (dev-only)")
    return problems


@nox.session(python=PYTHON)
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """One package's CPU tests in its own venv (Triton under the interpreter)."""
    path = ROOT / "packages" / package
    _install_local(session, path)
    _pytest(session, path / "tests")


@nox.session(python=PYTHON)
def integration(session: nox.Session) -> None:
    """The GEM-style model's tests (tiny presets, gloo on CPU)."""
    path = ROOT / "integration"
    if not (path / "pyproject.toml").exists():
        session.skip("integration/ does not exist yet")
    _install_local(session, path)
    _pytest(session, path / "tests")


@nox.session(python=PYTHON, default=False)
def train(session: nox.Session) -> None:
    """The main job: train the GEM-style model's tiny preset on the CPU (about a minute).

    Prints where the metrics JSON and the loss/AUC/throughput plot were written. Extra
    arguments go to ``hyperrec-train``, e.g. ``nox -s train -- --preset small --steps 50``.
    """
    _install_local(session, ROOT / "integration", extras=())
    session.run("hyperrec-train", "--preset", "tiny", *session.posargs)


@nox.session(python=PYTHON, default=False)
def simulate(session: nox.Session) -> None:
    """The Base Batch Shuffling load-balance simulation (``python -m hyperrec.bbs.simulate``).

    Extra arguments go to the command, e.g. ``nox -s simulate -- --world-sizes 8 64``.
    """
    _install_local(session, ROOT / "packages" / "bbs", extras=())
    session.run("python", "-m", "hyperrec.bbs.simulate", *session.posargs)


@nox.session(python=False, default=False)
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def bench(session: nox.Session, package: str) -> None:
    """A package's benchmarks, in the current interpreter (the GPU machine's torch).

    Nothing is installed: the GPU machine brings its own torch/triton, so the
    packages' ``src`` directories are put on ``PYTHONPATH`` instead. Results are
    written as JSON under ``packages/<package>/bench/results/``.
    """
    scripts = sorted((ROOT / "packages" / package / "bench").glob("bench_*.py"))
    if not scripts:
        session.skip(f"{package} has no benchmarks")
    src = os.pathsep.join(str(p) for p in sorted(ROOT.glob("packages/*/src")))
    env = {"PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for script in scripts:
        session.run(sys.executable, str(script), *session.posargs, env=env)
