import pytest
from django.core.checks import run_checks
from django.test import override_settings


def ids(**kwargs):
    with override_settings(**kwargs):
        return sorted({e.id for e in run_checks() if e.id.startswith("django_dbworker")})


def test_defaults_pass():
    assert ids() == []


@pytest.mark.parametrize("value,expected", [
    ("nope", ["django_dbworker.E001"]),
    ({"LEASE": 3}, ["django_dbworker.E002"]),
    ({"DATABASE": "other"}, ["django_dbworker.E003"]),
    ({"LEASE_SECONDS": 0}, ["django_dbworker.E004"]),
    ({"POLL_SECONDS": -1}, ["django_dbworker.E004"]),
    ({"MAX_POLL_SECONDS": "10"}, ["django_dbworker.E004"]),
    ({"POLL_SECONDS": 5, "MAX_POLL_SECONDS": 1}, ["django_dbworker.E005"]),
    ({"WORKER_MODULES": "app.workers"}, ["django_dbworker.E006"]),
    ({"ENGINE_OPTIONS": []}, ["django_dbworker.E007"]),
    # Too small a pool: the coordinator would wait on it (for 30 s) and fail.
    ({"ENGINE_OPTIONS": {"pool_size": 1, "max_overflow": 0}}, ["django_dbworker.E014"]),
    ({"ENGINE_OPTIONS": {"pool_size": 2, "max_overflow": 0}}, ["django_dbworker.E014"]),
    ({"ENGINE_OPTIONS": {"max_overflow": 0}}, ["django_dbworker.E014"]),  # (pool_size 2)
    ({"PROBE_SECONDS": 0}, ["django_dbworker.E004"]),
    # A failpoint without its marker would make every child die after each commit.
    ({"FAILPOINT": "child.after_commit"}, ["django_dbworker.E011"]),
    ({"FAILPOINT": "no.such_point:/tmp/m"}, ["django_dbworker.E011"]),
    ({"IDENTITY": ""}, ["django_dbworker.E012"]),
    ({"IDENTITY": 42}, ["django_dbworker.E012"]),
    ({"LISTEN_DATABASE": "direct"}, ["django_dbworker.E013"]),
    ({"SCHEDULES": ["nightly"]}, ["django_dbworker.E030"]),
    ({"SCHEDULES": {"n": {"task": "tests.testapp.tasks.add", "cron": "61 * * * *"}}},
     ["django_dbworker.E031"]),
])
def test_invalid_settings_have_ids_and_hints(value, expected):
    assert ids(DBWORKER=value) == expected


@pytest.mark.parametrize("options", [
    {"pool_size": 3, "max_overflow": 0}, {"pool_size": 1, "max_overflow": 2},
    {"pool_size": 1, "max_overflow": -1}, {"pool_size": 3}, {"pool_size": 1},
    {"poolclass": "sqlalchemy.pool.NullPool"},
])
def test_a_pool_with_room_for_the_coordinator_passes(options):
    assert ids(DBWORKER={"ENGINE_OPTIONS": options}) == []


def test_a_well_formed_failpoint_identity_and_listen_alias_pass():
    assert ids(DBWORKER={"FAILPOINT": "child.before_commit:/tmp/marker",
                         "IDENTITY": "pod-7", "LISTEN_DATABASE": "default"}) == []


def test_small_poll_values_are_allowed():
    assert ids(DBWORKER={"POLL_SECONDS": 0.01, "MAX_POLL_SECONDS": 1}) == []


def test_in_memory_sqlite_and_unsupported_backends():
    mem = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
    oracle = {"default": {"ENGINE": "django.db.backends.oracle", "NAME": "x"}}
    assert ids(DATABASES=mem) == ["django_dbworker.E009"]
    assert ids(DATABASES=oracle) == ["django_dbworker.E008"]


def test_use_tz_is_required():
    assert ids(USE_TZ=False) == ["django_dbworker.E010"]


def test_hints_name_the_fix():
    with override_settings(DBWORKER={"LEASE_SECONDS": 0}):
        [error] = [e for e in run_checks() if e.id == "django_dbworker.E004"]
    assert "LEASE_SECONDS" in error.msg and error.hint
