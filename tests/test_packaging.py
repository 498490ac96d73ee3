"""The release artefacts work: `python -m build` gives an sdist and a wheel; the wheel
installs into a fresh virtual environment and runs the example project's drain.

Slow (a build, a venv, Django and SQLAlchemy installed from the package index: about a
minute). Deselect with ``-m "not slow"``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.test_example import assert_demo_output, copy_example, demo_env, run_demo

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "django_dbworker"

pytestmark = pytest.mark.slow


def run(*args: str | Path, cwd: Path, timeout: float = 300) -> str:
    result = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                            timeout=timeout, env=demo_env())
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def data_files() -> set[str]:
    """Templates and static files of the package, as paths inside the wheel."""
    return {
        str(p.relative_to(REPO))
        for folder in ("templates", "static")
        for p in (PACKAGE / folder).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_build_install_and_run_example(tmp_path: Path) -> None:
    import build  # noqa: F401  (in the test extra; a missing one is a failure)
    # Build from a copy: other processes may be working in the checkout meanwhile.
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache",
        "*.sqlite3*", "test-artifacts", "results"))
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "build", "--outdir", dist, source, cwd=source)
    wheels = list(dist.glob("django_dbworker-*.whl"))
    sdists = list(dist.glob("django_dbworker-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(dist.iterdir())

    with zipfile.ZipFile(wheels[0]) as wheel:
        names = set(wheel.namelist())
    assert "django_dbworker/py.typed" in names
    assert "django_dbworker/management/commands/runworkers.py" in names
    assert any(n.startswith("django_dbworker/migrations/0001") for n in names)
    assert data_files() <= names, data_files() - names
    assert not any(n.startswith(("tests/", "example_project/")) for n in names)

    with tarfile.open(sdists[0]) as sdist:
        members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name}
    assert {"README.md", "CHANGELOG.md", "LICENSE", "pyproject.toml"} <= members
    assert data_files() <= members, data_files() - members
    assert not any(m.startswith(("tests/", "example_project/")) for m in members)

    # A fresh venv with the wheel and its dependencies from the package index.
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    run(python, "-m", "pip", "install", "--quiet", wheels[0], cwd=tmp_path, timeout=600)
    where = run(python, "-c", "import django_dbworker; print(django_dbworker.__file__)",
                cwd=tmp_path)
    assert Path(where.strip()).is_relative_to(venv), where

    # The example project from a directory outside the repository, on the installed wheel.
    project = copy_example(tmp_path / "site")
    env = demo_env()
    env.pop("PYTHONPATH", None)
    output = run_demo(python, project, env)
    assert_demo_output(output)
    # For `pytest -s`: what was built and where it ran from.
    print(f"\nbuilt {wheels[0].name} ({len(names)} files), {sdists[0].name} "
          f"({len(members)} files)\ninstalled at {where.strip()}\n{output}")
    assert str(REPO) not in output.split("database:", 1)[1].splitlines()[0]
    assert os.path.exists(project / "db.sqlite3")
