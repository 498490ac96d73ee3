"""The admin mixin's documented path: it lives in ``django_dbworker.admin.mixins``."""

from .admin.mixins import DBWorkerStatusMixin, transition_action

__all__ = ["DBWorkerStatusMixin", "transition_action"]
