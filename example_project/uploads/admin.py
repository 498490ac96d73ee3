from django.contrib import admin

from django_dbworker.admin.mixins import DBWorkerStatusMixin

from .models import Upload


@admin.register(Upload)
class UploadAdmin(DBWorkerStatusMixin, admin.ModelAdmin):
    # The mixin adds an "analyze status" and a "summarize status" column and filter (one
    # query for the page) and a "Reset failed ... work" action for each worker.
    dbworker_workers = ["analyze", "summarize"]
    list_display = ["name", "steps_done", "word_count", "language", "uploaded_at"]
    search_fields = ["name"]
    readonly_fields = ["steps_done", "checksum", "word_count", "language", "summary"]
