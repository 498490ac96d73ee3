"""The names this app's SQL uses on every database: its tables, its NOTIFY channel and
payloads, and the statuses a source change re-runs."""

EXECUTION_TABLE = "django_dbworker_execution"
PAUSE_TABLE = "django_dbworker_workerpause"
NOTIFY_CHANNEL = "dbworker"
PAUSE_NOTICE = ".pause"  # the payload that says a pause changed (no worker has this name)
ANY_WORKER_NOTICE = ".any"  # (from a change wait: new rows, for whichever worker)
TEXT_KEY_TYPES = {"CharField", "TextField", "SlugField", "EmailField", "URLField"}
# Statuses a source change re-runs (rerun_on) and the one it flags instead.
RERUN_STATUSES = ("finished", "failed")
