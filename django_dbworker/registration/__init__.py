"""Registering workers: the @worker decorator, its options, and finding workers.py modules."""
