from __future__ import annotations

from django import forms
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from django_dbworker import annotate_execution_status

from .models import Upload


class UploadForm(forms.ModelForm):
    class Meta:
        model = Upload
        fields = ["name", "content"]
        widgets = {"content": forms.Textarea(attrs={"rows": 2})}
        help_texts = {"name": 'A name containing "broken" makes the analyze worker fail.'}


def upload_list(request: HttpRequest) -> HttpResponse:
    """Every upload with its status per worker. Saving the form is the whole "enqueue":
    the insert itself makes the row pending for both workers."""
    form = UploadForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        form.save()
        return redirect("upload_list")
    # One query for the page: each object gets analyze_execution_status and
    # summarize_execution_status, which {% dbworker_status %} reads instead of querying.
    uploads = annotate_execution_status(Upload.objects.all(), "analyze", "summarize")
    return render(request, "uploads/upload_list.html", {"uploads": uploads, "form": form})
