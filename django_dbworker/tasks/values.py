"""What a task's arguments and return value may be, checked where each comes in (at
``enqueue()``, and when a task returns) so that nothing is stored that a process cannot
read back: standard JSON (no NaN or Infinity, which ``json.dumps`` writes and PostgreSQL,
JavaScript and most JSON readers refuse), lists and dicts nested at most ``MAX_DEPTH``
deep (``json.loads`` in a child recurses once per level), and arguments of at most the
backend's ``MAX_ARGUMENT_BYTES`` as stored. Each refusal is one line that names the fix.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .compat import normalize_json

MAX_DEPTH = 100
DEFAULT_MAX_ARGUMENT_BYTES = 1024 * 1024  # OPTIONS["MAX_ARGUMENT_BYTES"]; None: no limit


def arguments(task_path: str, args: Any, kwargs: Any,
              max_bytes: int | None) -> tuple[list[Any], dict[str, Any]]:
    """``args`` and ``kwargs`` as the JSON they are stored as, or the error that says why
    they cannot be."""
    args, kwargs = list(args), dict(kwargs)
    what = f"Arguments of task {task_path}"
    if any(_too_deep(value) for value in (*args, *kwargs.values())):
        raise ValueError(f"{what} nest lists or dicts more than {MAX_DEPTH} deep: pass a "
                         "flatter value (or store it and pass its key).")
    try:
        args, kwargs = normalize_json(args), normalize_json(kwargs)
        size = _stored_size(args) + _stored_size(kwargs)
    except _NotStandard as exc:
        raise ValueError(f"{what} must be standard JSON: NaN and Infinity are not ({exc}); "
                         "pass None or a string instead.") from None
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} must round-trip through JSON (numbers, strings, booleans, "
                        f"None, lists, dicts): {exc}") from None
    if max_bytes is not None and size > max_bytes:
        raise ValueError(f"{what} are {size} bytes as JSON, over the backend's "
                         f"MAX_ARGUMENT_BYTES ({max_bytes}): store large data elsewhere and "
                         "pass its key, or raise OPTIONS['MAX_ARGUMENT_BYTES'].")
    return args, kwargs


def return_value(task_path: str, value: Any) -> Any:
    """The return value as the JSON it is stored as (else the attempt fails, saying why)."""
    if _too_deep(value):
        raise ValueError(f"Task {task_path} returned lists or dicts nested more than "
                         f"{MAX_DEPTH} deep: return a flatter value.")
    try:
        value = normalize_json(value)
        _stored_size(value)
    except _NotStandard:
        raise ValueError(f"Task {task_path} returned NaN or Infinity, which standard JSON "
                         "does not have: return None or a string instead.") from None
    except (TypeError, ValueError) as exc:
        raise TypeError(f"Task {task_path} returned {type(value).__name__}, which is not "
                        f"JSON: return only what json.dumps accepts ({exc}).") from None
    return value


def max_argument_bytes(options: Any) -> int | None:
    """The backend's limit, or ValueError saying what a good value is."""
    if not isinstance(options, dict):
        return DEFAULT_MAX_ARGUMENT_BYTES  # (OPTIONS that are no dict: a check error of theirs)
    value = options.get("MAX_ARGUMENT_BYTES", DEFAULT_MAX_ARGUMENT_BYTES)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise ValueError(f"MAX_ARGUMENT_BYTES must be a whole number of bytes (1 or more) "
                         f"or None for no limit, not {value!r}.")
    return value


class _NotStandard(ValueError):
    pass


def _stored_size(value: Any) -> int:
    """Characters (bytes: it is ASCII) of the JSON text the Task row stores."""
    try:
        return len(json.dumps(value, allow_nan=False))
    except ValueError as exc:  # (its other ValueError, a cycle, was refused as too deep)
        raise _NotStandard(str(exc)) from None


def _too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether lists and dicts nest more than ``limit`` deep in ``value`` (walked without
    recursion: the point is to refuse what recursion cannot handle, cycles included)."""
    stack = [(value, 0)]
    while stack:
        item, above = stack.pop()  # above: the containers it is inside
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, Sequence) and not isinstance(item, str | bytes | bytearray):
            children = item
        else:
            continue
        if above >= limit:
            return True
        stack.extend((child, above + 1) for child in children)
    return False


MAX_KEY = 255  # TaskUniqueKey.key, Task.flow_key


def key_text(value: Any, what: str, fix: str) -> str | None:
    """A key a declaration's function returned, as stored: its text (None stays None: no
    key), or the error that it is longer than a key column holds. ``what`` names the key
    ("The unique key of task app.tasks.f"), ``fix`` says what to change."""
    if value is None:
        return None
    text = str(value)
    if len(text) > MAX_KEY:
        raise ValueError(f"{what} is {len(text)} characters, over {MAX_KEY}: {fix}.")
    return text
