"""The transitions' rules, read from the statements they make (no database): what each
writes, what guards it, and in which order MySQL sees the assignments. Their behaviour
on every database is tests/test_lifecycle.py."""

from __future__ import annotations

import re

import pytest
from sqlalchemy.dialects import mysql

from django_dbworker.status import ExecutionStatus
from django_dbworker.store import transitions
from django_dbworker.store.retry import RetryDecision
from django_dbworker.store.session import Ran
from django_dbworker.store.transitions import Ended
from django_dbworker.vendors import MySQL

BOOM = {"error_type": "E", "error_message": "m"}
RETRY = RetryDecision(ExecutionStatus.UNFINISHED, 30.0)
FAIL = RetryDecision(ExecutionStatus.FAILED, None)


class Recorder:
    """A session that keeps the statements, compiled as MySQL would run them."""

    def __init__(self) -> None:
        self.vendor = MySQL(connection=None)  # type: ignore[arg-type]
        self.sql: list[str] = []
        self.statements: list[tuple] = []  # (statement, params, shape)

    def run(self, statement, params=None, shape=None) -> Ran:
        self.statements.append((statement, params, shape))
        self.sql.append(str(statement.compile(dialect=mysql.dialect(),
                                              compile_kwargs={"render_postcompile": True})))
        return Ran(1)


def set_clause(sql: str) -> list[str]:
    """The assigned columns, in order (an assignment is ``name=``; comparisons inside
    the values are spelled ``a = b``)."""
    assignments = sql.split(" SET ", 1)[1].split(" WHERE ", 1)[0]
    return re.findall(r"(?:^|, )(\w+)=", assignments)


@pytest.fixture
def s() -> Recorder:
    return Recorder()


def test_every_end_of_an_attempt_is_guarded_by_the_claims_token_and_working(s):
    a = Ended(7, "tok", -1, 0)
    transitions.finish(s, [a])
    transitions.continue_later(s, [a])
    transitions.fail_or_retry(s, transitions.held([a]), FAIL, BOOM, crashes="reset")
    transitions.release(s, a, "pending")
    transitions.renew(s, [a], 30)
    for sql in s.sql:
        where = sql.split(" WHERE ", 1)[1]
        assert "claim_token" in where and "status" in where, sql


def test_mysql_reads_the_rerun_flag_before_it_is_cleared(s):
    # MySQL assigns left to right: the flag is cleared last, after every CASE that reads it.
    transitions.finish(s, [Ended(1, "t", -1, 0)], rerun_on=True, rerun_every=60)
    transitions.fail_or_retry(s, transitions.held([Ended(1, "t", 0, 0)]), RETRY, BOOM,
                              crashes="reset", rerun_on=True)
    for sql in s.sql:
        assert set_clause(sql)[-1] == "rerun_requested", sql
        assert "CASE WHEN" in sql


def test_promote_reads_the_old_status_and_due_time_before_changing_them(s):
    s.run = lambda statement: (s.sql.append(str(statement.compile(
        dialect=mysql.dialect(), compile_kwargs={"render_postcompile": True}))) or
        Ran(1, [type("Row", (), {"id": 5})()]))
    transitions.promote(s, "w")
    names = set_clause(s.sql[-1])
    assert names.index("rerun_reason") < names.index("status")
    assert names.index("ready_at") < names.index("next_attempt_at")


def test_a_handlers_answer_resets_the_crash_count_and_the_coordinator_counts_a_crash(s):
    where = transitions.held([Ended(1, "t", 0, 0)])
    transitions.fail_or_retry(s, where, RETRY, BOOM, crashes="reset")
    transitions.fail_or_retry(s, where, RETRY, BOOM, crashes="count")
    transitions.fail_or_retry(s, where, RETRY, BOOM, crashes="keep")
    reset, count, keep = s.sql
    assert "crashes=%s" in reset
    assert "crashes=(django_dbworker_execution.crashes + %s)" in count
    assert "crashes" not in set_clause(keep)


def test_a_retry_waits_and_a_final_failure_ends(s):
    where = transitions.held([Ended(1, "t", 0, 0)])
    transitions.fail_or_retry(s, where, RETRY, BOOM, crashes="reset")
    transitions.fail_or_retry(s, where, FAIL, BOOM, crashes="reset")
    retried, failed = s.sql
    assert "INTERVAL 30000000 MICROSECOND" in retried and "finished_at" not in set_clause(retried)
    assert "finished_at" in set_clause(failed)


def test_release_forgets_the_claimer_and_ends_of_attempts_keep_it(s):
    a = Ended(1, "t", 0, 0)
    transitions.release(s, a, "pending")
    transitions.finish(s, [a])
    transitions.fail_or_retry(s, transitions.held([a]), FAIL, BOOM, crashes="count")
    released, finished, failed = s.sql
    assert "claimed_by" in set_clause(released)
    assert "claimed_by" not in set_clause(finished) and "claimed_by" not in set_clause(failed)


def test_times_are_the_databases_never_a_bound_value(s):
    a = Ended(1, "t", -2, -1)
    transitions.finish(s, [a], rerun_every=5)
    transitions.fail_or_retry(s, transitions.held([a]), RETRY, BOOM, crashes="reset", started=-3)
    transitions.reset(s, [1])
    for sql in s.sql:
        assert "UTC_TIMESTAMP(6)" in sql
        assert "datetime" not in sql.lower()


def test_a_groups_outcome_is_one_statement_per_shape_with_every_value_a_parameter(s):
    """The child ends every group with finish or continue_later: the statement is built
    once per shape (and a session may keep it compiled), the rows' ids, tokens and times
    are parameters."""
    transitions.finish(s, [Ended(1, "a", -2.5, -1.0), Ended(2, "a", -1.0, 0.0)])
    transitions.finish(s, [Ended(8, "b", -9.0, -3.0), Ended(9, "c", -4.0, -2.0)])
    transitions.finish(s, [Ended(8, "b", -9.0, -3.0)])
    (first, p1, shape1), (second, p2, shape2), (alone, _, shape3) = s.statements
    assert first is second and shape1 == shape2 and s.sql[0] == s.sql[1]
    assert alone is not first and shape3 != shape1
    assert p1 == {"dbw_id0": 1, "dbw_tok0": "a", "dbw_started0": -2_500_000, "dbw_finished0": -1_000_000,
                  "dbw_id1": 2, "dbw_tok1": "a", "dbw_started1": -1_000_000, "dbw_finished1": 0}
    assert p2["dbw_id1"] == 9 and p2["dbw_tok1"] == "c" and p2["dbw_started0"] == -9_000_000
    for value in ("-2500000", "'a'", "'b'"):
        assert value not in s.sql[0]
