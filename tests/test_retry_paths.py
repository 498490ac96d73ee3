"""One retry policy, whoever asks: a child that dies, a lease that expires, a deleted source.

Before the policy was one object, lease recovery re-implemented it in SQL without the
back-off, so an interrupted attempt came back at once whatever ``retry_backoff`` said.
"""

import os
from datetime import timedelta

import pytest
from django.utils import timezone

from django_dbworker import Coordinator
from django_dbworker.registration.registry import registry
from django_dbworker.store.bridge import Bridge
from tests.helpers import claim, effects, execution
from tests.testapp.models import Document, FaultJob, Tag

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_child_killed_mid_handler_waits_out_the_back_off_then_fails_at_max_attempts():
    job = FaultJob.objects.create(behaviour="crash_retry")
    Coordinator(["crash_retry"]).drain()  # the child dies running it: attempt 1 of 2
    e = execution("crash_retry", job)
    assert e.status == "unfinished" and e.attempts == 1
    # retry_backoff=3600 with jitter in [0.5, 1]: not before half an hour.
    assert e.next_attempt_at > timezone.now() + timedelta(minutes=25)
    assert e.claim_token is None and e.claimed_by.endswith(f":{os.getpid()}")  # who ran it
    stats = Coordinator(["crash_retry"]).drain()  # waiting: nothing claimable yet
    assert stats["claimed"] == 0 and execution("crash_retry", job).attempts == 1

    type(e).objects.filter(pk=e.pk).update(next_attempt_at=timezone.now())  # back-off over
    Coordinator(["crash_retry"]).drain()  # dies again: attempt 2 of 2 is the last
    e = execution("crash_retry", job)
    assert e.status == "failed" and e.attempts == 2 and e.next_attempt_at is None
    assert e.error_type == "ChildDied"


def test_an_expired_lease_follows_the_workers_retry_policy():
    tag = Tag.objects.create(slug="later-1")  # worker retry_later: max_attempts=2, backoff 3600
    [held] = claim("retry_later", claimer="gone-host:4242")  # a holder that vanished
    type(execution("retry_later", tag)).objects.filter(pk=held.execution_id).update(
        lease_expires_at=timezone.now() - timedelta(seconds=5))
    bridge = Bridge()
    try:
        assert bridge.recover_expired(registry["retry_later"]) == 1
    finally:
        bridge.close()
    e = execution("retry_later", tag)
    assert e.status == "unfinished" and e.error_type == "LeaseExpired"
    assert e.next_attempt_at > timezone.now() + timedelta(minutes=25)  # the back-off holds
    assert e.claim_token is None and e.lease_expires_at is None
    assert e.claimed_by == "gone-host:4242"  # the claim that ran out stays named
    assert effects("retry_later") == {}


def test_a_deleted_source_is_spelled_the_same_by_the_child_and_by_recovery():
    from tests.testapp import models

    expected = f"{models.__name__}.Document.DoesNotExist"
    # Recovery: the row was deleted while a vanished holder had it.
    recovered = Document.objects.create()
    [held] = claim("docs", claimer="gone-host:4242")
    assert held.source_id == str(recovered.pk)
    Document.objects.filter(pk=recovered.pk).delete()  # its Execution stays: it is held
    type(execution("docs", recovered.pk)).objects.filter(pk=held.execution_id).update(
        lease_expires_at=timezone.now() - timedelta(seconds=5))
    bridge = Bridge()
    try:
        bridge.recover_expired(registry["docs"])
    finally:
        bridge.close()
    assert execution("docs", recovered.pk).error_type == expected

    # The child: the row vanished between the claim and the child's load.
    from collections import deque
    from multiprocessing.sharedctypes import RawArray, RawValue

    from django_dbworker.processes.groups import run_group
    from django_dbworker.processes.protocol import SLOT_SIZE

    loaded = Document.objects.create()
    [held] = claim("docs")
    Document.objects.filter(pk=loaded.pk).delete()
    run_group(registry["docs"], "default", deque([held.delivery(held.execution_id)]),
              RawArray("d", SLOT_SIZE), RawValue("b", 0))
    e = execution("docs", loaded.pk)
    assert e.status == "failed" and e.error_type == expected
