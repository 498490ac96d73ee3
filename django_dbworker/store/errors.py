"""How a failure is written down: one spelling of an error's type, whoever records it.

``error_type`` is the exception class as ``module.QualifiedName`` (a model's
``DoesNotExist`` reads ``shop.models.Order.DoesNotExist``), except built-in exceptions,
which are just their name (``ValueError``). Failures the coordinator records itself have
names of their own: ``TimeoutError`` (past the worker's timeout), ``ChildDied`` and
``LeaseExpired``.
"""

from __future__ import annotations

import traceback

# Django's message when a handler calls transaction.commit() (or set_autocommit) inside
# the atomic block its child runs it in.
_FORBIDDEN_IN_ATOMIC = "This is forbidden when an 'atomic' block is active."
COMMIT_HINT = ("The handler tried to commit (transaction.commit(), set_autocommit() or "
               "similar). Don't commit in a handler: its writes commit together with its "
               "outcome when it returns.")


def exception_path(cls: type[BaseException]) -> str:
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def failure_fields(exc: BaseException) -> dict[str, str]:
    """error_type, error_message and error_traceback of an Execution, for ``exc``."""
    message = str(exc)
    if type(exc).__name__ == "TransactionManagementError" and _FORBIDDEN_IN_ATOMIC in message:
        message = f"{COMMIT_HINT} ({message})"
    return {
        "error_type": exception_path(type(exc))[:255],
        "error_message": message,
        "error_traceback": "".join(traceback.format_exception(exc)),
    }


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
