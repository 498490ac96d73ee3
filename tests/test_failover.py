"""The database fails over to a promoted streaming replica while rows are being processed
(tests/replica.py makes the pair: a primary on 127.0.0.1:5441, its replica on :5442).

DATABASES names both hosts with target_session_attrs=read-write: libpq connects to
whichever takes writes. One `runworkers` runs the `stress` worker; mid-run the primary is
stopped as in a crash (immediate) and the replica promoted. runworkers must not exit (one
outage, logged, then work goes on against the new primary), and:

- Asynchronous replication, with the replica cut off the WAL stream shortly before the
  failover (a replication lag, made on purpose so that something surely is lost): what the
  primary committed in that window is gone, the handler's business effect together with
  its FINISHED status (one transaction), and those rows run again. At the end every row is
  FINISHED with exactly one effect: none lost, none twice.
- Synchronous replication: additionally, every effect committed on the primary (read just
  before stopping it) is still there after the failover.

- Synchronous replication with a stalled standby (it stops receiving WAL while both
  children run a 3 s handler): the coordinator's ``SET synchronous_commit = off`` at work.
  Its lease renewals commit on the primary without waiting for the standby (a handler's
  commit would wait), so the failover loses them: the new primary holds older leases than
  the old one had (asserted: "renewals lost" > 0), and still nothing is lost or run twice.

All of them count the coordinator's own writes lost in the failover (claims, renewals: not
waited for). A lost claim or renewal leaves the row as the replica last saw it (pending, or
WORKING under an older token or lease), so it is claimed again or recovered when that lease
runs out; a handler's commit is synchronous and WAL is one sequence, so no outcome reaches
the replica without the claim it was guarded by. None lost, none twice is what shows it.

Each also checks that both children take rows again after the failover (the pids of the
effects committed since). A last test fails over while both children run a long handler
whose queued rows were given back ("one handler has run for ...s"): the child's give-back
flag used to stay set on the database-gone path, so the pool sent that child no more rows
and, with both children so, runworkers stayed up but claimed nothing again.

PostgreSQL runs only (DBWORKER_TEST_DB=postgres); needs root and the PostgreSQL server
tools (skipped with the reason otherwise, failed with CI=true).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import Counter

import pytest

from tests import replica
from tests.helpers import ROOT, run_lab, runworkers, settings_module, subprocess_env, wait_for
from tests.processes import Output

DB = os.environ.get("DBWORKER_TEST_DB", "sqlite")
pytestmark = [pytest.mark.skipif(
    DB != "postgres", reason="failover to a promoted streaming replica is PostgreSQL's "
    "(PostgreSQL runs only: DBWORKER_TEST_DB=postgres)"), pytest.mark.solo]

DATABASE = "dbworker_failover"
ROWS = 300
DELAY = 0.04  # seconds per handler, inside its transaction
STALL_ROWS, STALL_DELAY = 12, 3.0  # the stalled-standby scenario: long handlers only
LONG = 5.0  # two long handlers among short ones (the give-back bug)
EXECUTIONS = "django_dbworker_execution"


@pytest.fixture
def pair():
    replica.require()
    with replica.ReplicaPair() as made:
        yield made


def settings_body(pair: replica.ReplicaPair) -> str:
    return (f"DATABASES = {{'default': {{'ENGINE': 'django.db.backends.postgresql', "
            f"'NAME': {DATABASE!r}, **{pair.host_settings()!r}}}}}\n")


def migrate(env: dict[str, str]) -> None:
    result = subprocess.run([sys.executable, "-m", "django", "migrate", "-v", "0"], cwd=ROOT,
                            env=subprocess_env(**env), capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr


class State:
    """What one cluster holds: effects of the `stress` worker, and executions."""

    def __init__(self, cluster: replica.Cluster) -> None:
        self.effects = {(i, s) for i, s in cluster.query(
            "SELECT id, source_id FROM testapp_effect WHERE worker = 'stress'", database=DATABASE)}
        rows = cluster.query(f"SELECT source_id, status, claim_token, lease_expires_at "
                             f"FROM {EXECUTIONS} WHERE worker = 'stress'", database=DATABASE)
        self.status = {s: status for s, status, _, _ in rows}
        self.claims = {s: (token, lease) for s, status, token, lease in rows
                       if status == "working"}

    def coordinator_writes_lost(self, after: State) -> tuple[int, int]:
        """(claims, renewals) this state had that ``after`` lacks, for rows not finished
        there: the coordinator's own writes (synchronous_commit = off) lost in between."""
        claims = renewals = 0
        for s, (token, lease) in self.claims.items():
            if after.status.get(s) == "finished":
                continue
            held = after.claims.get(s)
            if held is None or held[0] != token:
                claims += 1
            elif held[1] < lease:
                renewals += 1
        return claims, renewals


def finished(cluster: replica.Cluster) -> int:
    try:
        [(n,)] = cluster.query(f"SELECT count(*) FROM {EXECUTIONS} WHERE worker = 'stress' "
                               "AND status = 'finished'", database=DATABASE)
        return n
    except Exception:  # noqa: BLE001 - not answering (yet): try again
        return -1


def effect_count(cluster: replica.Cluster) -> int:
    [(n,)] = cluster.query("SELECT count(*) FROM testapp_effect WHERE worker = 'stress'",
                           database=DATABASE)
    return n


def claims_replicated(pair: replica.ReplicaPair) -> bool:
    """The primary's WORKING claims are on the standby too, with the same tokens."""
    held = State(pair.primary).claims
    there = State(pair.replica).claims
    return bool(held) and all(there.get(s, ("",))[0] == token for s, (token, _) in held.items())


def both_children_in_a_handler(cluster: replica.Cluster) -> bool:
    """Two sessions inside a handler for 0.3 s or more (its effect inserted, not committed:
    a handler, not only a row claimed and queued in a child)."""
    return len(cluster.query(
        "SELECT 1 FROM pg_stat_activity WHERE datname = %s AND state = 'idle in transaction' "
        "AND query LIKE 'INSERT INTO \"testapp_effect\"%%' "
        "AND state_change < clock_timestamp() - interval '0.3 seconds'", (DATABASE,))) == 2


def run_failover(pair: replica.ReplicaPair, tmp_path, scenario: str, synchronous: bool,
                 lag: bool = False, stall: bool = False, long_among_short: bool = False) -> None:
    """``lag``: asynchronous replication, the replica cut off the WAL stream until the
    primary has committed 15 more effects. ``stall``: synchronous, the replica cut off
    while both children run a STALL_DELAY handler (the coordinator renews their leases
    meanwhile; a handler's commit would wait, holding its execution row's lock, so no
    quick handlers there). ``long_among_short``: two LONG handlers among quick ones, the
    failover while both run."""
    started = time.monotonic()
    rows, delay = (STALL_ROWS, STALL_DELAY) if stall else (ROWS, DELAY)
    long_ids = [rows // 5, rows // 5 + 1] if long_among_short else []
    if synchronous:
        pair.synchronous()
    pair.primary.query(f"CREATE DATABASE {DATABASE}")
    env = settings_module(tmp_path, settings_body(pair))
    migrate(env)  # the tables and the worker's triggers, into the primary (and so the replica)
    pair.primary.query("INSERT INTO testapp_stressjob (delay) SELECT CASE WHEN g = ANY(%s) "
                       "THEN %s ELSE %s END FROM generate_series(1, %s) g",
                       (long_ids, LONG, delay, rows), database=DATABASE)
    ids = {str(i) for (i,) in pair.primary.query("SELECT id FROM testapp_stressjob",
                                                  database=DATABASE)}
    assert len(pair.primary.query(f"SELECT 1 FROM {EXECUTIONS} WHERE worker = 'stress'",
                                  database=DATABASE)) == rows

    proc = runworkers("--worker", "stress", env=env)
    output = Output(proc)
    try:
        if stall or long_among_short:
            wait_for(lambda: both_children_in_a_handler(pair.primary) or proc.poll() is not None,
                     timeout=60, interval=0.1)
        else:
            wait_for(lambda: finished(pair.primary) >= rows // 5 or proc.poll() is not None,
                     timeout=60, interval=0.2)
        assert proc.poll() is None, f"runworkers exited before the failover:\n{output.err}"
        if lag:
            # The replica stops receiving WAL; the primary goes on committing (asynchronous
            # replication does not wait): those commits exist on the primary only.
            pair.cut_replication()
            cut_at = effect_count(pair.primary)
            wait_for(lambda: effect_count(pair.primary) >= cut_at + 15, timeout=30,
                     interval=0.05)
        elif stall:
            # The claims first reach the standby (committed with synchronous_commit off,
            # they may trail the handlers by a moment: CI of 3303eb8 cut the stream before
            # they arrived, and the claims, not renewals, were what the standby lacked).
            wait_for(lambda: claims_replicated(pair) or proc.poll() is not None,
                     timeout=30, interval=0.05)
            # The coordinator renews the two handlers' leases every LEASE_SECONDS / 3: from
            # now on on the primary only, without waiting for the standby.
            pair.cut_replication()
            time.sleep(1.5)
        before = State(pair.primary)  # just before the crash: what the primary committed
        pair.stop_primary()
        # What the new primary starts from: read on the replica (still read-only, so no
        # coordinator has written to it yet) once it has replayed all it received.
        pair.wait_replayed()
        after = State(pair.replica)
        pair.promote()
        [(promoted_at,)] = pair.replica.query("SELECT clock_timestamp()")
        check(pair, scenario, proc, output, rows, ids, before, after, promoted_at,
              synchronous=synchronous, lag=lag, stall=stall, started=started)
    except BaseException:
        status = Counter(st for _, st in pair.current.query(
            f"SELECT source_id, status FROM {EXECUTIONS}", database=DATABASE)) \
            if replica._listening(pair.current.port) else "(not answering)"
        print(f"\n--- {scenario}: failed; statuses {dict(status)}; runworkers stderr:\n"
              f"{output.err}")
        raise


def check(pair, scenario, proc, output, rows, ids, before, after, promoted_at, *,
          synchronous, lag, stall, started) -> None:
    done_at_failover = sum(1 for s in after.status.values() if s == "finished")
    assert done_at_failover < rows, "the run ended before the failover: nothing was tested"

    # Every row ends FINISHED, on the new primary, with runworkers never restarted.
    wait_for(lambda: finished(pair.replica) == rows or proc.poll() is not None,
             timeout=60 if stall else 30, interval=0.2)
    assert proc.poll() is None, f"runworkers exited after the failover:\n{output.err}"
    [(recovered,)] = pair.replica.query(
        f"SELECT EXTRACT(EPOCH FROM min(finished_at) - %s) FROM {EXECUTIONS} "
        "WHERE worker = 'stress' AND finished_at > %s", (promoted_at, promoted_at),
        database=DATABASE)
    unreplicated = before.effects - after.effects
    rerun_done = None
    if unreplicated:
        [(rerun_done,)] = pair.replica.query(
            f"SELECT EXTRACT(EPOCH FROM max(finished_at) - %s) FROM {EXECUTIONS} "
            "WHERE worker = 'stress' AND source_id = ANY(%s)",
            (promoted_at, sorted(s for _, s in unreplicated)), database=DATABASE)
    # Both children took rows again after the failover (the handlers' pids, in the effects
    # committed since): the coordinator carries on at its full concurrency.
    [(children_after,)] = pair.replica.query(
        "SELECT count(DISTINCT pid) FROM testapp_effect WHERE worker = 'stress' AND id > %s",
        (max((i for i, _ in after.effects), default=0),), database=DATABASE)
    proc.terminate()
    assert output.wait(timeout=60) == 0, output.err
    err = output.err
    assert re.search(r"Database unavailable \(", err), err  # the outage was seen and logged
    assert re.search(r"Database available again after [\d.]+s", err), err

    end = State(pair.replica)
    assert Counter(end.status.values()) == {"finished": rows}
    per_row = Counter(s for _, s in end.effects)
    twice = sorted(s for s, n in per_row.items() if n > 1)
    without = sorted(ids - set(per_row))  # FINISHED (all are) yet no effect: lost
    assert set(per_row) <= ids
    assert not twice, f"rows with two business effects: {twice}"
    assert not without, f"rows FINISHED without their business effect: {without}"

    # Committed on the old primary, missing on the new one (never replicated): each such
    # effect's row lost its FINISHED status with it, and ran again (one new effect).
    rerun = {s for _, s in unreplicated}
    assert all(before.status[s] == "finished" and after.status[s] != "finished" for s in rerun)
    assert all(per_row[s] == 1 for s in rerun)
    # Nor the reverse, right at the promote: a status FINISHED without its effect.
    assert {s for s, st in after.status.items() if st == "finished"} <= {
        s for _, s in after.effects}
    if synchronous:
        assert not unreplicated, f"synchronous replication lost commits: {sorted(unreplicated)}"
    if lag:
        assert unreplicated, "nothing was lost in the lag: the scenario tested nothing"
    # Claims and renewals (synchronous_commit = off) the old primary had and the new one
    # lacks: lost, and harmless (above: none lost, none twice).
    claims_lost, renewals_lost = before.coordinator_writes_lost(after)
    if stall:
        assert renewals_lost > 0, (
            "no renewal committed on the primary without the stalled standby: is "
            f"synchronous_commit off on the coordinator's connections? before: {before.claims}, "
            f"after: {after.claims}")
    assert children_after == 2, (
        f"{children_after} of the 2 children ran rows after the failover: the others were "
        "never given rows again")
    outages = len(re.findall(r"Database unavailable \(", err))
    print(f"\nfailover | {scenario:<28} | rows {rows:>3} | failovers 1 | lost {len(without)} | "
          f"twice {len(twice)} | time to recover {float(recovered):.2f}s")
    print(f"  {done_at_failover} finished on the new primary at the promote; "
          f"{len(unreplicated)} committed effects not replicated, run again"
          + (f" (the last {float(rerun_done):.2f}s after the promote)" if unreplicated else "")
          + f"; coordinator writes lost: {claims_lost} claims, {renewals_lost} renewals; "
          f"{outages} outage(s) logged; {time.monotonic() - started:.1f}s in all")


def test_async_failover_loses_effect_and_status_together_and_reruns_them(pair, tmp_path):
    run_failover(pair, tmp_path, "asynchronous, lagging", synchronous=False, lag=True)


def test_sync_failover_loses_nothing_committed(pair, tmp_path):
    run_failover(pair, tmp_path, "synchronous", synchronous=True)


def test_sync_failover_with_a_stalled_standby_loses_only_the_coordinators_writes(pair, tmp_path):
    run_failover(pair, tmp_path, "synchronous, standby stalled", synchronous=True, stall=True)


def test_failover_during_long_handlers_whose_queued_rows_were_given_back(pair, tmp_path):
    run_failover(pair, tmp_path, "async, long handlers", synchronous=False,
                 long_among_short=True)


def test_the_lab_fails_over_when_told(tmp_path):
    """scripts/lab.py failover, as a person would drive it (here from --commands): the
    replica lags, the primary stops, the replica is promoted; every row counted after."""
    replica.require((5443, 5444), prefix="dbwlab")
    result = run_lab("failover", "--rows", "300", "--commands",
                     "sleep 3; lag; sleep 1; failover; wait 120", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "replica promoted" in result.stdout, result.stdout
    assert "rows 300, finished 300, with an effect 300, twice 0" in result.stdout, result.stdout
