"""Children started from a ``__main__`` without ``if __name__ == "__main__":`` (main_guard.py).

Real processes: a ``manage.py`` and scripts in a temporary folder, run with this Python.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from multiprocessing import spawn
from pathlib import Path

import pytest

from django_dbworker.processes import main_guard
from tests.helpers import STARTED, effects, subprocess_env
from tests.testapp.models import Document

MULTIPROCESSING_CHANGED = (
    "multiprocessing.spawn.get_preparation_data() changed: django_dbworker/processes/main_guard.py "
    "relies on it naming no main module for a child to import when sys.modules['__main__'] "
    "has neither __spec__ nor __file__ (and naming one by path when it has a __file__). "
    "Children of an unguarded manage.py would run the command again: find another way.")


def test_spawn_imports_no_main_module_for_the_stand_in(tmp_path: Path) -> None:
    """The private behaviour of multiprocessing that main_guard.without_main() relies on."""
    script = types.ModuleType("__main__")
    script.__file__ = str(tmp_path / "manage.py")
    real = sys.modules["__main__"]
    sys.modules["__main__"] = script  # as `python manage.py` has it
    try:
        by_path = spawn.get_preparation_data("dbworker-test")
    finally:
        sys.modules["__main__"] = real
    assert by_path.get("init_main_from_path") == script.__file__, MULTIPROCESSING_CHANGED
    with main_guard.without_main():
        hidden = spawn.get_preparation_data("dbworker-test")
    assert sys.modules["__main__"] is real
    assert [k for k in hidden if k.startswith("init_main")] == [], MULTIPROCESSING_CHANGED


@pytest.mark.parametrize("source,unguarded", [
    ("found = check()", True),
    ('if __name__ == "__main__":\n    found = check()', False),
    ("if '__main__' == __name__ and True:\n    found = check()", False),
    ('try:\n    found = check()\nfinally:\n    pass', True),
    ('def main():\n    return check()\n\nif __name__ == "__main__":\n    found = main()', False),
    ("def main():\n    return check()\n\nfound = main()", True),
])
def test_unguarded_main_names_the_line_outside_the_guard(tmp_path: Path, source: str,
                                                         unguarded: bool) -> None:
    path = tmp_path / "script.py"
    path.write_text(source + "\n")
    script = types.ModuleType("__main__")
    script.__file__ = str(path)
    script.check = main_guard.unguarded_main  # type: ignore[attr-defined]
    real = sys.modules["__main__"]
    sys.modules["__main__"] = script
    try:
        exec(compile(path.read_text(), str(path), "exec"), vars(script))
    finally:
        sys.modules["__main__"] = real
    line = source.splitlines().index(next(x for x in source.splitlines() if "found" in x)) + 1
    assert vars(script)["found"] == (f"{path}, line {line}" if unguarded else None)


# -- real processes ----------------------------------------------------------------------------
def run(tmp_path: Path, name: str, body: str, *args: str, settings_module: bool = True
        ) -> subprocess.CompletedProcess:
    """``python NAME ARGS`` in ``tmp_path``, the file ``body``, on the test database."""
    (tmp_path / name).write_text(textwrap.dedent(body))
    env = subprocess_env()
    if not settings_module:
        del env["DJANGO_SETTINGS_MODULE"]
    proc = subprocess.Popen([sys.executable, name, *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    STARTED.append(proc)  # killed with its children if the test fails (conftest)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


CONFIGURE = textwrap.dedent("""
    import django
    from django.conf import settings

    import tests.settings

    settings.configure(**{k: getattr(tests.settings, k) for k in dir(tests.settings) if k.isupper()})
    django.setup()
    from django_dbworker import Coordinator
""")


@pytest.mark.django_db(transaction=True)
def test_a_manage_py_without_the_guard_drains(tmp_path: Path) -> None:
    docs = Document.objects.bulk_create([Document() for _ in range(3)])
    done = run(tmp_path, "manage.py", """
        import os
        import sys

        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
        from django.core.management import execute_from_command_line

        execute_from_command_line(sys.argv)
    """, "runworkers", "--drain", "--worker", "docs")
    assert done.returncode == 0, done.stderr
    assert "Drained: claimed 3, finished 3" in done.stdout
    assert effects("docs") == {str(d.pk): 1 for d in docs}


@pytest.mark.django_db(transaction=True)
def test_a_script_that_drains_when_it_runs(tmp_path: Path) -> None:
    docs = Document.objects.bulk_create([Document() for _ in range(3)])
    done = run(tmp_path, "drain.py", """
        import django

        django.setup()
        from django_dbworker import Coordinator

        print("finished", Coordinator(["docs"]).drain()["finished"])
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "finished 3\n"
    assert effects("docs") == {str(d.pk): 1 for d in docs}


@pytest.mark.django_db(transaction=True)
def test_settings_from_configure_in_an_unguarded_script_fail_in_one_line(tmp_path: Path) -> None:
    """Children have no settings module to read: they could get the settings only by
    running the script again, which would start workers again."""
    doc = Document.objects.create()
    done = run(tmp_path, "drain.py", CONFIGURE + 'print(Coordinator(["docs"]).drain())\n',
               settings_module=False)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        f"django.core.exceptions.ImproperlyConfigured: {tmp_path / 'drain.py'}, line 10 starts "
        'worker children outside `if __name__ == "__main__":`, and Django\'s settings come '
        "from settings.configure(), which children get only by running that file again: put "
        'the code that starts the workers under `if __name__ == "__main__":`.'), done.stderr
    assert "bootstrapping phase" not in done.stderr  # no child tried to run the script
    assert effects("docs") == {} and Document.objects.filter(pk=doc.pk).exists()


@pytest.mark.django_db(transaction=True)
def test_a_guarded_script_is_still_run_by_children_before_they_start(tmp_path: Path) -> None:
    """Its code outside the guard (here settings.configure()) may be what children need:
    spawn runs it in them, as it always did."""
    docs = Document.objects.bulk_create([Document() for _ in range(2)])
    done = run(tmp_path, "drain.py", CONFIGURE + textwrap.dedent("""
        if __name__ == "__main__":
            print("finished", Coordinator(["docs"]).drain()["finished"])
    """), settings_module=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "finished 2\n"
    assert effects("docs") == {str(d.pk): 1 for d in docs}
