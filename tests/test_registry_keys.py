"""A source whose key may not fit Execution.source_id is refused at registration, the
same on every database: a trigger must never fail the user's own INSERT."""

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import models
from django.test.utils import isolate_apps

from django_dbworker import Finished, worker
from django_dbworker.registration.registry import SOURCE_KEY_LENGTH, Registry


def handler(obj):
    return Finished()


@isolate_apps("tests.testapp")
@pytest.mark.parametrize("field", [
    lambda: models.CharField(primary_key=True, max_length=300),
    lambda: models.TextField(primary_key=True),
    lambda: models.SlugField(primary_key=True, max_length=256),
], ids=["char-300", "text", "slug-256"])
def test_a_text_key_longer_than_an_execution_holds_is_refused(field):
    attrs = {"key": field(), "__module__": "tests.testapp.models",
             "Meta": type("Meta", (), {"app_label": "testapp"})}
    model = type("LongKey", (models.Model,), attrs)
    with pytest.raises(ImproperlyConfigured) as info:
        worker(name="long_keys", source=model, registry=Registry())(handler)
    message = str(info.value)
    assert f"max_length <= {SOURCE_KEY_LENGTH}" in message and "integer or UUID key" in message


@isolate_apps("tests.testapp")
def test_a_text_key_that_fits_is_accepted():
    class FitKey(models.Model):
        key = models.CharField(primary_key=True, max_length=SOURCE_KEY_LENGTH)

        class Meta:
            app_label = "testapp"

    reg = Registry()
    worker(name="fits", source=FitKey, registry=reg)(handler)
    assert "fits" in reg
