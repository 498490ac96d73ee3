"""Starting children from a ``__main__`` without ``if __name__ == "__main__":``.

A ``spawn`` child first runs the parent's ``__main__`` again (by path, or by module name,
as ``__mp_main__``) so that what it defines can be unpickled. A ``manage.py`` without the
guard, or a script that builds a Coordinator when it runs, then runs the whole command again
in each child, which dies trying to start children of its own.

Children need nothing from an unguarded ``__main__``: they set Django up from the settings
module named in the environment they inherit, and import handlers by module. So while the
code that starts a child runs outside the guard, the child is started with a stand-in
``__main__`` that spawn does not import. A guarded ``__main__`` is imported as before: its
top-level code (``pymysql.install_as_MySQLdb()``, say) may be what children need. Two things
only an unguarded ``__main__`` can give children, so they fail in one line naming the fix:
settings from ``settings.configure()``, and a handler defined in ``__main__``. Where the
code runs is read from the main thread's stack (the line of ``__main__`` running now) and the
file's source (whether that line is inside the guard).

This relies on spawn's preparation (``multiprocessing.spawn.get_preparation_data``, run by
``Process.start()``) reading ``sys.modules["__main__"]`` and naming no main module to import
when that module has neither a ``__spec__`` nor a ``__file__`` (as the interactive
interpreter's): tests/test_main_guard.py checks it on every Python the tests run on.
"""

from __future__ import annotations

import ast
import linecache
import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from types import FrameType

from django.core.exceptions import ImproperlyConfigured

GUARD = 'if __name__ == "__main__":'
# sys.modules["__main__"] is swapped while a child starts: one start at a time, so that
# two never restore each other's stand-in.
_swapping = threading.Lock()


def start(process: BaseProcess, handler_path: str) -> None:
    """``process.start()``, without the child running an unguarded ``__main__`` again."""
    where = unguarded_main()
    if where is None:
        process.start()
        return
    needs = _needs_main(handler_path)
    if needs:
        raise ImproperlyConfigured(
            f"{where} starts worker children outside `{GUARD}`, and {needs}, which children "
            f"get only by running that file again: put the code that starts the workers "
            f"under `{GUARD}`.")
    with without_main():
        process.start()


@contextmanager
def without_main() -> Iterator[None]:
    """Spawn's preparation, inside, finds a ``__main__`` it does not import in a child.
    Other threads of this process see the stand-in meanwhile: the few milliseconds of a
    ``Process.start()``, in which none of this app's threads reads ``__main__``."""
    with _swapping:
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")  # __spec__ None, no __file__
        try:
            yield
        finally:
            sys.modules["__main__"] = main


def unguarded_main() -> str | None:
    """Where ``__main__`` runs code now that spawn would run again in a child ("manage.py,
    line 4"): a line outside ``if __name__ == "__main__":``. None when spawn does not import
    ``__main__`` in children, or it runs no code now, or its source cannot be read (then
    children import it as spawn always does)."""
    main = sys.modules["__main__"]
    name = getattr(main.__spec__, "name", None)
    if name == "__main__" or (name or "").endswith(".__main__") or (
            name is None and getattr(main, "__file__", None) is None):
        return None  # python -m package, python -c, the interactive interpreter
    frame = _main_thread_frame()
    while frame is not None and not (frame.f_code.co_name == "<module>"
                                     and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None or frame.f_lineno is None:
        return None
    filename, line = frame.f_code.co_filename, frame.f_lineno
    try:
        tree = ast.parse("".join(linecache.getlines(filename, frame.f_globals)) or "(")
    except (SyntaxError, ValueError):  # no source (or not the running one)
        return None
    guarded = any(isinstance(node, ast.If) and _is_guard(node.test) and node.body
                  and node.body[0].lineno <= line <= (node.body[-1].end_lineno or line)
                  for node in ast.walk(tree))
    return None if guarded else f"{filename}, line {line}"


def _main_thread_frame() -> FrameType | None:
    # __main__'s own code runs in the main thread, whichever thread starts the child.
    if threading.current_thread() is threading.main_thread():
        return sys._getframe(1)
    return sys._current_frames().get(threading.main_thread().ident or 0)


def _is_guard(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round), alone or among ``and``s."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_is_guard(value) for value in test.values)
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


def _needs_main(handler_path: str) -> str:
    """Why children need the parent's ``__main__``, in words; "" when they do not."""
    if handler_path.startswith("__main__:"):
        return f"the handler {handler_path} is defined there"
    from django.conf import settings

    if settings.configured and settings.SETTINGS_MODULE is None:
        return "Django's settings come from settings.configure()"
    return ""
