"""Receivers of the django.tasks and django_dbworker signals: each one leaves a SignalSeen
row saying which process received which signal for what."""

import os

try:
    from django.tasks.signals import task_enqueued, task_finished, task_started
except ImportError:  # Django 5.2: the backport
    from django_tasks.signals import task_enqueued, task_finished, task_started

from .models import SignalSeen


def _record(kind):
    def receiver(sender, task_result, **kwargs):
        SignalSeen.objects.create(kind=kind, key=f"{task_result.id}:{task_result.status}",
                                  pid=os.getpid())
    return receiver


for _signal, _kind in ((task_enqueued, "enqueued"), (task_started, "started"),
                       (task_finished, "finished")):
    _signal.connect(_record(_kind), weak=False, dispatch_uid=f"testapp-{_kind}")


def _execution(kind):
    def receiver(sender, worker, execution_id, source_id, attempt, **kwargs):
        # What the receiver finds: the execution's status as the database has it, and
        # whether it is still inside a transaction (it must not be: sent after the commit).
        from django.db import connection

        from django_dbworker.models import Execution

        status = Execution.objects.get(pk=execution_id).status
        where = "in a transaction" if connection.in_atomic_block else "after the commit"
        SignalSeen.objects.create(kind=f"execution_{kind}",
                                  key=f"{worker}:{source_id}:{attempt}:{status}:{where}",
                                  pid=os.getpid())
    return receiver


from django_dbworker import signals as dbworker_signals  # noqa: E402

for _kind in ("finished", "failed", "retried"):
    getattr(dbworker_signals, f"execution_{_kind}").connect(
        _execution(_kind), weak=False, dispatch_uid=f"testapp-execution-{_kind}")
