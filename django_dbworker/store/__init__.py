"""The store of row states: the one owner of an ``Execution`` row's state machine.

Every change of a row's state is one named function in ``transitions`` (claim, renew,
finish, continue, fail or retry, release, recover, promote, reset, run again), written
once in SQLAlchemy Core, and run by whoever makes it: the coordinator on its engine, the
child inside the transaction that holds the handler's writes, the admin and the API in
theirs (``session``). Every time a transition writes or compares is the database's own.

::

    PENDING / UNFINISHED --claim--> WORKING --finish--> FINISHED
          ^      ^                   |  |  \\--continue--> UNFINISHED (claimable again)
          |      |                   |  \\--fail_or_retry--> UNFINISHED + due time (retry)
          |      +------release------+                      or FAILED (for good)
          |      (never started)     +--recover (lease expired) --> as fail_or_retry
          +--promote-- waiting for a due time (a retry, run_after, rerun_every)
    FAILED --reset--> UNFINISHED          FINISHED --run_again--> UNFINISHED
"""
