"""The coordinator: its loop (``loop.Coordinator``) and the helpers it runs each turn:
waking, due rows, recovery, releases, outages."""
