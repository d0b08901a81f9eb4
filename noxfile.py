"""The single entry point for hyperrec: lint, tests, packaging, training and benchmarks.

    nox                      what CI runs: lint, every package's tests, integration, the
                             lowest declared sibling versions, the wheelhouse install check
    nox -s "tests(bbs)"      one package, in its own venv
    nox -s dev               every package in one venv, the whole suite in one pytest process
    nox -s wheels            every distribution built into dist/ (the wheelhouse)
    nox -s train             the main job: train the GEM-style model's tiny preset
    nox -s simulate          the Base Batch Shuffling load-balance simulation
    nox -s "bench(bbs)"      a package's benchmarks (GPU packages need CUDA)

Environments. The third-party stack (torch, triton, numpy, pytest, pytest-xdist, hypothesis,
matplotlib, hatchling, ruff, mypy; pinned in ``constraints/cpu.txt``, the CPU torch) is
installed once, into ``.nox/_base``, which holds no hyperrec distribution. Every session's
venv sees it read-only through a ``.pth`` file and installs only hyperrec packages of its
own: a package's tests run in a venv holding that package, the hyperrec siblings it
declares and its test extra, so an import of an undeclared sibling fails there
(``_check_isolation`` proves it in every test session).

Adding a package: create ``packages/<name>/`` (pyproject, ``src/hyperrec/<name>/`` with
``py.typed``, ``_validate.py``, ``tests/`` with unique file names). Everything here picks it
up: tests, lint (ruff, mypy --strict, the dialect checks), wheels, the install check, and
the floor check if it declares hyperrec siblings. Nothing to edit in this file, unless it
needs a temporary exception in ``MYPY_EXCLUDED``.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections import Counter
from pathlib import Path

import nox

nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "tests", "integration", "lowest", "install"]

ROOT = Path(__file__).resolve().parent
CONSTRAINTS = str(ROOT / "constraints" / "cpu.txt")
PYTHON = "3.11"
#: Session venvs get no pip of their own: ensurepip (and then removing its setuptools,
#: see ``_link_base``) cost seconds per venv, and the base's pip, visible through the
#: ``.pth`` line that every session writes before it installs anything, installs into
#: the session's venv. (``wheels`` keeps its own pip: it builds before linking the base.)
NO_PIP = ["--without-pip"]
_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(?:>=\s*([0-9][0-9.]*))?")

#: Packages mypy does not check yet, with the reason; removing a line is the whole fix.
MYPY_EXCLUDED: dict[str, str] = {}

#: The shared, read-only third-party environment (see the module docstring).
BASE = ROOT / ".nox" / "_base"
BASE_PACKAGES = (
    "torch",
    "triton",
    "numpy",
    "pytest",
    "pytest-xdist",
    "hypothesis",
    "matplotlib",
    "hatchling",
    "editables",
    "ruff",
    "mypy",
    # mxfp8's independent oracle in tests (test extra); pure Python on the CPU
    "torchao",
)


# -- the repository -----------------------------------------------------------------------


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _project(path: Path) -> dict:
    return tomllib.loads((path / "pyproject.toml").read_text())["project"]


def _distributions() -> dict[str, Path]:
    """Every local distribution name (``hyperrec-bbs``) -> its directory."""
    dirs = sorted(p.parent for p in ROOT.glob("packages/*/pyproject.toml"))
    if (ROOT / "integration" / "pyproject.toml").exists():
        dirs.append(ROOT / "integration")
    return {_normalise(_project(d)["name"]): d for d in dirs}


def _import_name(path: Path) -> str:
    """``hyperrec.<name>`` of a distribution directory (its one package under src/)."""
    (pkg,) = [p for p in (path / "src" / "hyperrec").iterdir() if (p / "__init__.py").exists()]
    return f"hyperrec.{pkg.name}"


def _requirements(project: dict, extras: tuple[str, ...] = ()) -> dict[str, str | None]:
    """hyperrec requirements of a ``[project]`` table: name -> floor (``None``: no floor)."""
    reqs = list(project.get("dependencies", []))
    for extra in extras:
        reqs += project.get("optional-dependencies", {}).get(extra, [])
    out: dict[str, str | None] = {}
    for r in reqs:
        m = _REQ.match(r)
        if m and _normalise(m.group(1)).startswith("hyperrec-"):
            out[_normalise(m.group(1))] = m.group(2)
    return out


def _closure(path: Path, extras: tuple[str, ...] = ("test",)) -> set[str]:
    """The hyperrec distributions ``path`` needs (transitively), itself excluded."""
    dists = _distributions()
    needed: set[str] = set()
    todo = list(_requirements(_project(path), extras))
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        if name not in dists:
            raise ValueError(f"{path.name} depends on {name}, which is not in this repository")
        needed.add(name)
        todo += _requirements(_project(dists[name]))
    return needed


PACKAGES = sorted(p.parent.name for p in ROOT.glob("packages/*/pyproject.toml"))
#: Packages (and integration) that declare hyperrec runtime siblings: their floors are tested.
DEPENDENT = [
    name
    for name, d in sorted(_distributions().items())
    if _requirements(_project(d)) and name != "hyperrec-testing"
]


# -- environments ---------------------------------------------------------------------------


def _site_packages(python: str) -> str:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return subprocess.run(
        [python, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()


def _base(session: nox.Session) -> str:
    """Create (once per constraints/package list) the shared third-party venv; its site dir."""
    want = hashlib.sha256(
        (Path(CONSTRAINTS).read_text() + "\n".join(BASE_PACKAGES)).encode()
    ).hexdigest()
    stamp = BASE / "hyperrec-base.stamp"
    python = str(BASE / "bin" / "python")
    if not stamp.exists() or stamp.read_text() != want:
        shutil.rmtree(BASE, ignore_errors=True)
        session.run("python", "-m", "venv", str(BASE), silent=True)
        session.run(
            python, "-m", "pip", "install", "-q", "-c", CONSTRAINTS, *BASE_PACKAGES, external=True
        )
        stamp.write_text(want)
    return _site_packages(python)


def _link_base(session: nox.Session, python: str | None = None) -> None:
    """Let a venv read the base environment (a ``.pth`` line; nothing is copied)."""
    base_site = _base(session)
    python = python or str(Path(session.bin) / "python")
    site = _site_packages(python)
    if Path(site, "setuptools").exists():
        # The venv's bundled setuptools would shadow the base's pinned one (torch needs
        # the newer): drop it so every third-party package comes from the base.
        session.run(python, "-m", "pip", "uninstall", "-q", "-y", "setuptools", external=True)
    Path(site, "_hyperrec_base.pth").write_text(base_site + "\n")


def _install_local(session: nox.Session, path: Path, extras: tuple[str, ...] = ("test",)) -> None:
    """Install ``path`` editable with its hyperrec siblings (transitively) from the tree."""
    _link_base(session)
    dists = _distributions()
    try:
        needed = _closure(path, extras)
    except ValueError as e:
        session.error(str(e))
    args = ["-c", CONSTRAINTS, "--no-build-isolation"]
    for name in sorted(needed):
        args += ["-e", str(dists[name])]
    suffix = f"[{','.join(extras)}]" if extras else ""
    session.install(*args, "-e", f"{path}{suffix}")


_ISOLATION_CHECK = """
import importlib.metadata as md, importlib.util, json, sys
allowed, others = json.loads(sys.argv[1])
got = sorted({d.metadata["Name"].lower().replace("_", "-") for d in md.distributions()
              if d.metadata["Name"].lower().startswith("hyperrec")})
if got != sorted(allowed):
    sys.exit(f"hyperrec distributions here: {got}, expected exactly {sorted(allowed)}")
visible = [m for m in others if importlib.util.find_spec(m) is not None]
if visible:
    sys.exit(f"undeclared hyperrec packages importable: {visible}")
import torch
print(f"isolated: {len(allowed)} hyperrec distribution(s); {len(others)} undeclared sibling(s) "
      f"not importable; torch {torch.__version__} from the shared base")
"""


def _check_isolation(session: nox.Session, path: Path, extras: tuple[str, ...]) -> None:
    """Prove the venv holds exactly the declared hyperrec closure and nothing else."""
    dists = _distributions()
    allowed = sorted(_closure(path, extras) | {_normalise(_project(path)["name"])})
    others = [_import_name(d) for n, d in dists.items() if n not in allowed]
    session.run("python", "-c", _ISOLATION_CHECK, json.dumps([allowed, others]), env=_CLEAN)


#: Keep a developer's PYTHONPATH (e.g. every src/ dir) from leaking into the venvs.
_CLEAN = {"PYTHONPATH": ""}


#: Test suites that are minutes long and mostly single-threaded (Triton's interpreter,
#: one- and two-rank gloo jobs): they use both of CI's cores, one pytest-xdist worker per
#: core, a test file per worker at a time (module fixtures are built once). Suites of
#: four- to eight-rank process groups (parallel5d) stay serial: their ranks already fill
#: the cores. (autoac's compiled-peak test that once failed on two workers was a library
#: bug, fixed in autoac 0.1.24: a block of an earlier profiling window freed inside a
#: later one lowered its peak, at a moment another order of test files moved.) Their
#: ``lowest`` sessions follow the same rule.
PARALLEL_TESTS = {"autoac", "jagged_attn", "integration"}
_XDIST = ("-n", "2", "--dist", "loadfile")


def _xdist(name: str) -> tuple[str, ...]:
    """pytest-xdist's arguments for the suite of ``name`` (a directory name), if any."""
    return _XDIST if name in PARALLEL_TESTS else ()


def _pytest(session: nox.Session, tests: Path, *extra: str) -> None:
    env = {
        **_CLEAN,
        # Triton kernels run on the CPU through the interpreter, so CI exercises the
        # real kernels at small shapes.
        "TRITON_INTERPRET": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",
        # Tests against an independent implementation (torchao) fail instead of
        # skipping when it is missing, so the comparison cannot silently stop running.
        "HYPERREC_REQUIRE_ORACLES": "1",
    }
    session.run(
        "python",
        "-m",
        "pytest",
        str(tests),
        "-c",
        str(ROOT / "pyproject.toml"),
        "--rootdir",
        str(ROOT),
        "-m",
        "not gpu and not multigpu",
        "--durations=8",
        *extra,
        # A fixed Hypothesis seed: CI explores the same examples on every run, so a red
        # run is reproducible and a green one is not luck; explore afresh with
        # `-- --hypothesis-seed=<n>` (or pytest directly).
        *(
            []
            if any(a.startswith("--hypothesis-seed") for a in session.posargs)
            else ["--hypothesis-seed=0"]
        ),
        *session.posargs,
        env=env,
    )


# -- lint -----------------------------------------------------------------------------------


@nox.session(python=PYTHON, venv_params=NO_PIP)
def lint(session: nox.Session) -> None:
    """ruff, mypy --strict on every package's sources, and the repository invariants."""
    _link_base(session)
    # Tools of the base are modules here (their scripts live in the base's bin/).
    session.run("python", "-m", "ruff", "check", ".", env=_CLEAN)
    session.run("python", "-m", "ruff", "format", "--check", ".", env=_CLEAN)
    problems = _repository_problems()
    if problems:
        session.error("\n".join(problems))
    names = [_import_name(d).removeprefix("hyperrec.") for d in _distributions().values()]
    checked = [n for n in names if n not in MYPY_EXCLUDED]
    srcs = [str(p) for p in sorted(ROOT.glob("packages/*/src"))] + [str(ROOT / "integration/src")]
    targets = [a for pkg in checked for a in ("-p", f"hyperrec.{pkg}")]
    session.log(f"mypy: {', '.join(checked)}; excluded: {MYPY_EXCLUDED}")
    session.run(
        "python",
        "-m",
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        *targets,
        env={"MYPYPATH": os.pathsep.join(srcs), **_CLEAN},
    )


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


def _repository_problems() -> list[str]:
    """Invariants a linter cannot see: namespace, docs vs CI, dialect, tests, typing."""
    problems = []
    bad = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("**/src/hyperrec/__init__.py"))
    if bad:
        problems.append(f"these files break the PEP 420 namespace: {bad}")
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    test_cmd = re.search(r"<!-- test-command -->\s*```(?:bash|sh)?\n(.+?)\n```", readme, re.S)
    if not test_cmd or test_cmd.group(1).strip() not in ci:
        problems.append("README.md's test command and .ci/run disagree")
    problems += _dialect_problems()
    problems += _test_name_problems()
    for d in _distributions().values():
        typed = d / "src" / _import_name(d).replace(".", "/") / "py.typed"
        if not typed.exists():
            problems.append(f"{typed.relative_to(ROOT)} is missing (PEP 561: ship type hints)")
    return problems


def _dialect_problems() -> list[str]:
    """The shared ``_validate.py`` helpers are identical; no runtime import of testing."""
    problems = []
    copies: dict[str, dict[str, str]] = {}
    for path in sorted(ROOT.glob("packages/*/src/hyperrec/*/_validate.py")):
        text = path.read_text()
        funcs = {
            node.name: ast.get_source_segment(text, node) or ""
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
    runtime = [p for p in ROOT.glob("packages/*/src/hyperrec/*") if p.name != "testing"]
    runtime += list(ROOT.glob("integration/src/hyperrec/*"))
    for pkg in runtime:
        for path in pkg.rglob("*.py"):
            if re.search(r"^\s*(from|import) hyperrec\.testing", path.read_text(), re.M):
                problems.append(f"{path.relative_to(ROOT)} imports hyperrec.testing (dev-only)")
    return problems


def _test_name_problems() -> list[str]:
    """Every test module and test helper has a unique file name across the repository, so
    ``pytest packages/ integration/`` imports each once (pytest's default import mode
    keys modules by file name); conftest.py files may repeat (pytest scopes them)."""
    files = [
        p
        for p in sorted(ROOT.glob("packages/*/tests/**/*.py"))
        + sorted(ROOT.glob("integration/tests/**/*.py"))
        if p.name != "conftest.py" and p.name != "__init__.py"
    ]
    counts = Counter(p.name for p in files)
    return [
        f"test file name {name} is used {n} times "
        f"({', '.join(str(p.relative_to(ROOT)) for p in files if p.name == name)}): "
        "prefix it with its package"
        for name, n in sorted(counts.items())
        if n > 1
    ]


# -- tests ----------------------------------------------------------------------------------


@nox.session(python=PYTHON, venv_params=NO_PIP)
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """One package's CPU tests in its own venv (Triton under the interpreter)."""
    path = ROOT / "packages" / package
    _install_local(session, path)
    _check_isolation(session, path, ("test",))
    _pytest(session, path / "tests", *_xdist(package))


@nox.session(python=PYTHON, venv_params=NO_PIP)
def integration(session: nox.Session) -> None:
    """The GEM-style model's tests (tiny presets, gloo on CPU)."""
    path = ROOT / "integration"
    if not (path / "pyproject.toml").exists():
        session.skip("integration/ does not exist yet")
    _install_local(session, path)
    _check_isolation(session, path, ("test",))
    _pytest(session, path / "tests", *_xdist(path.name))


@nox.session(python=PYTHON, venv_params=NO_PIP, default=False)
def dev(session: nox.Session) -> None:
    """Every package editable in one venv; the whole suite in one pytest process.

    The development loop (CI keeps one venv per package). Extra arguments go to pytest,
    e.g. ``nox -s dev -- -x -k geometry``.
    """
    _link_base(session)
    dists = _distributions()
    args = [a for name in sorted(dists) for a in ("-e", str(dists[name]))]
    session.install("-c", CONSTRAINTS, "--no-build-isolation", *args)
    tests = [ROOT / "packages", ROOT / "integration"]
    _pytest(session, tests[0], str(tests[1]))


# -- packaging --------------------------------------------------------------------------------


def _build_wheels(session: nox.Session, dirs: list[Path], out: Path, *, isolated: bool) -> None:
    """``isolated``: pip fetches the build backend (hatchling) into a throwaway build
    environment, as for a user; otherwise the base's pinned hatchling builds."""
    out.mkdir(parents=True, exist_ok=True)
    flags = [] if isolated else ["--no-build-isolation"]
    # One pip process builds them all (a pip start per distribution was seconds each).
    session.run(
        "python", "-m", "pip", "wheel", "-q", "--no-deps", *flags, "-w", str(out),
        *(str(d) for d in dirs), env=_CLEAN,
    )  # fmt: skip


@nox.session(python=PYTHON, default=False)
def wheels(session: nox.Session) -> None:
    """Build every distribution into dist/ (install with pip's --find-links dist)."""
    _wheelhouse(session, isolated=True)


def _wheelhouse(session: nox.Session, *, isolated: bool) -> None:
    dist = ROOT / "dist"
    for old in dist.glob("hyperrec_*.whl"):
        old.unlink()
    _build_wheels(session, list(_distributions().values()), dist, isolated=isolated)
    session.log(f"wheelhouse: {sorted(p.name for p in dist.glob('hyperrec_*.whl'))}")


_IMPORT_CHECK = """
import importlib, importlib.resources, sys
mod = importlib.import_module(sys.argv[1])
missing = [n for n in mod.__all__ if not hasattr(mod, n)]
if missing:
    sys.exit(f"{sys.argv[1]}.__all__ names missing attributes: {missing}")
if not importlib.resources.files(sys.argv[1]).joinpath("py.typed").is_file():
    sys.exit(f"{sys.argv[1]} was installed without py.typed")
print(f"{sys.argv[1]} {mod.__version__}: {len(mod.__all__)} names in __all__ resolve")
"""


@nox.session(python=PYTHON, venv_params=NO_PIP)
def install(session: nox.Session) -> None:
    """Users' install path: each distribution alone from the wheelhouse into a fresh venv.

    Builds dist/ (as ``nox -s wheels``), then per distribution: a new venv (reading the
    shared third-party base, so torch is not reinstalled), ``pip install --no-index
    --find-links dist <name>`` (so every hyperrec sibling must come from the wheelhouse
    and be declared), and an import of the package with every ``__all__`` name. Last, the
    install command marked ``<!-- install-command -->`` in each README runs as written.
    """
    _link_base(session)
    _wheelhouse(session, isolated=False)
    work = Path(tempfile.mkdtemp(prefix="hyperrec-install-"))
    try:
        for name, path in sorted(_distributions().items()):
            python = _fresh_venv(session, work / name)
            session.run(
                python, "-m", "pip", "install", "-q", "--no-index", "--find-links",
                str(ROOT / "dist"), "-c", CONSTRAINTS, name, external=True, env=_CLEAN,
            )  # fmt: skip
            session.run(python, "-c", _IMPORT_CHECK, _import_name(path), external=True, env=_CLEAN)
        for readme in sorted(ROOT.glob("**/README.md")):
            if ".nox" in readme.parts:
                continue
            for cmd in re.findall(
                r"<!-- install-command -->\s*```(?:bash|sh)?\n(.+?)\n```", readme.read_text(), re.S
            ):
                python = _fresh_venv(session, work / f"readme-{len(list(work.iterdir()))}")
                line = cmd.strip().split("#")[0].split()
                if line[:2] != ["pip", "install"]:
                    session.error(f"{readme}: the marked install command must be a pip install")
                session.log(f"{readme.relative_to(ROOT)}: {' '.join(line)}")
                session.run(python, "-m", *line, external=True, env=_CLEAN, success_codes=[0])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _fresh_venv(session: nox.Session, where: Path) -> str:
    # No pip of its own (ensurepip took seconds per venv): the base's pip, visible through
    # the .pth line, installs into this venv (pip installs for the interpreter running it).
    session.run("python", "-m", "venv", "--without-pip", str(where), silent=True)
    python = str(where / "bin" / "python")
    _link_base(session, python)
    return python


# -- sibling version floors -------------------------------------------------------------------


def _releases(path: Path) -> list[tuple[str, str]]:
    """``[(version, commit)]`` of a distribution, oldest first: each version with its
    release commit, the first commit in which ``_version.py`` sets it AND the CHANGELOG
    has its heading (``## <version>``). A version number set during development, before
    its CHANGELOG heading replaced ``## Unreleased``, is not a release yet; later commits
    under the same number are unreleased work."""
    version_file = next((path / "src" / "hyperrec").glob("*/_version.py"))
    rel = str(version_file.relative_to(ROOT))
    changelog = str((path / "CHANGELOG.md").relative_to(ROOT))
    log = subprocess.run(
        ["git", "log", "--reverse", "--format=%H", "--", rel, changelog],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip

    def show(commit: str, file: str) -> str:
        return subprocess.run(
            ["git", "show", f"{commit}:{file}"], cwd=ROOT, capture_output=True, text=True
        ).stdout

    out: list[tuple[str, str]] = []
    for commit in log:
        m = re.search(r'__version__\s*=\s*"([^"]+)"', show(commit, rel))
        if not m or m.group(1) in {v for v, _ in out}:
            continue
        heading = re.compile(rf"^## {re.escape(m.group(1))}\b", re.M)
        if heading.search(show(commit, changelog)):
            out.append((m.group(1), commit))
    return out


def _vkey(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def _lowest_versions(path: Path) -> dict[str, tuple[str, str]]:
    """The lowest version of every hyperrec sibling that ``path``'s declared floors (and
    those of the chosen sibling releases themselves) allow: name -> (version, commit). A
    requirement without a floor gets the sibling's first release."""
    dists = _distributions()
    floors: dict[str, str | None] = dict(_requirements(_project(path)))
    chosen: dict[str, tuple[str, str]] = {}
    changed = True
    while changed:
        changed = False
        for name, floor in list(floors.items()):
            releases = _releases(dists[name])
            ok = [r for r in releases if floor is None or _vkey(r[0]) >= _vkey(floor)]
            if not ok:
                raise ValueError(f"no release of {name} satisfies >= {floor}")
            if chosen.get(name) != ok[0]:
                chosen[name] = ok[0]
                changed = True
                # The release's own sibling floors, as it declared them then.
                rel = dists[name].relative_to(ROOT) / "pyproject.toml"
                text = subprocess.run(
                    ["git", "show", f"{ok[0][1]}:{rel}"], cwd=ROOT, check=True,
                    capture_output=True, text=True,
                ).stdout  # fmt: skip
                for dep, f in _requirements(tomllib.loads(text)["project"]).items():
                    old = floors.get(dep)
                    if dep not in floors or (f and (old is None or _vkey(f) > _vkey(old))):
                        floors[dep] = f
    return chosen


@nox.session(python=PYTHON, venv_params=NO_PIP)
@nox.parametrize("package", DEPENDENT, ids=[d.removeprefix("hyperrec-") for d in DEPENDENT])
def lowest(session: nox.Session, package: str) -> None:
    """A package's tests against the lowest hyperrec sibling versions it declares.

    Each sibling is built from the commit that released its chosen version (git history;
    a shallow clone is not enough), the package itself and hyperrec-testing come from the
    tree. Tests marked ``slow`` are left to the package's normal session.
    """
    path = _distributions()[package]
    try:
        chosen = _lowest_versions(path)
    except (subprocess.CalledProcessError, StopIteration, ValueError) as e:
        session.error(f"cannot resolve the release commits of {package}'s siblings: {e}")
    session.log(
        "lowest siblings: " + ", ".join(f"{n}=={v} ({c[:10]})" for n, (v, c) in chosen.items())
    )
    _link_base(session)
    work = Path(tempfile.mkdtemp(prefix="hyperrec-lowest-"))
    try:
        dists = _distributions()
        dirs = []
        for name, (_, commit) in chosen.items():
            rel = dists[name].relative_to(ROOT)
            archive = subprocess.run(
                ["git", "archive", commit, str(rel)], cwd=ROOT, check=True, capture_output=True
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(work)], input=archive, check=True)
            dirs.append(work / rel)
        _build_wheels(session, dirs, work / "wheels", isolated=False)
        pins = [f"{n}=={v}" for n, (v, _) in chosen.items()]
        session.install("--no-index", "--find-links", str(work / "wheels"), *pins)
        session.install(
            "-c", CONSTRAINTS, "--no-build-isolation", "--no-deps",
            "-e", str(ROOT / "packages" / "testing"), "-e", str(path),
        )  # fmt: skip
        session.run("python", "-m", "pip", "check", env=_CLEAN)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _pytest(session, path / "tests", "-m", "not gpu and not multigpu and not slow",
            *_xdist(path.name))  # fmt: skip


# -- jobs -------------------------------------------------------------------------------------


@nox.session(python=PYTHON, venv_params=NO_PIP, default=False)
def train(session: nox.Session) -> None:
    """The main job: train the GEM-style model's tiny preset on the CPU (about a minute).

    Prints where the metrics JSON and the loss/AUC/throughput plot were written. Extra
    arguments go to ``hyperrec-train``, e.g. ``nox -s train -- --preset small --steps 50``.
    """
    _install_local(session, ROOT / "integration", extras=())
    session.run("hyperrec-train", "--preset", "tiny", *session.posargs, env=_CLEAN)


@nox.session(python=PYTHON, venv_params=NO_PIP, default=False)
def simulate(session: nox.Session) -> None:
    """The Base Batch Shuffling load-balance simulation (``python -m hyperrec.bbs.simulate``).

    Extra arguments go to the command, e.g. ``nox -s simulate -- --world-sizes 8 64``.
    """
    _install_local(session, ROOT / "packages" / "bbs", extras=())
    session.run("python", "-m", "hyperrec.bbs.simulate", *session.posargs, env=_CLEAN)


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
