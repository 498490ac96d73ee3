from django.contrib import admin

from django_dbworker.admin.mixins import DBWorkerStatusMixin

from .models import Document


@admin.register(Document)
class DocumentAdmin(DBWorkerStatusMixin, admin.ModelAdmin):
    list_display = ["id", "title", "behaviour"]
    dbworker_workers = ["docs", "summaries"]
