"""The benchmark's scenarios, one module each, and their shared helpers (run by ../run.py)."""
