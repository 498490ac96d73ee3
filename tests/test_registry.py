import re

import pytest
from django.core.exceptions import ImproperlyConfigured

from django_dbworker import Finished, registry, worker
from django_dbworker.registration.registry import Registry
from tests.testapp.models import Document, Tag


def module_level(doc):
    return Finished()


def other_module_level(doc):
    return Finished()


def test_decorator_returns_the_function_unchanged_and_registers_it():
    reg = Registry()
    fn = worker(name="example", source=Document, registry=reg)(module_level)
    assert fn is module_level
    assert reg["example"].handler is module_level
    assert reg["example"].concurrency == 1


@pytest.mark.parametrize("name", ["Bad", "1abc", "has-dash", "", "x" * 41, None, "white space"])
def test_bad_names_are_rejected_with_the_rule(name):
    with pytest.raises(ImproperlyConfigured, match="lowercase letters"):
        worker(name=name, source=Document, registry=Registry())(module_level)


def test_duplicate_names_are_rejected_naming_both_handlers():
    reg = Registry()
    worker(name="dup", source=Document, registry=reg)(module_level)
    with pytest.raises(ImproperlyConfigured, match="other_module_level"):
        worker(name="dup", source=Document, registry=reg)(other_module_level)


def test_registering_the_same_function_again_is_not_a_clash():
    reg = Registry()
    worker(name="again", source=Document, registry=reg)(module_level)
    worker(name="again", source=Document, registry=reg)(module_level)
    assert list(reg) == ["again"]


@pytest.mark.parametrize("concurrency", [0, -1, 1.5, "2", True])
def test_bad_concurrency_is_rejected(concurrency):
    with pytest.raises(ImproperlyConfigured, match="concurrency must be an int >= 1"):
        worker(name="c", source=Document, concurrency=concurrency, registry=Registry())


def test_nested_handlers_are_rejected_at_registration():
    def nested(doc):
        return Finished()

    with pytest.raises(ImproperlyConfigured, match="module level"):
        worker(name="nested", source=Document, registry=Registry())(nested)
    with pytest.raises(ImproperlyConfigured, match="module level"):
        worker(name="lam", source=Document, registry=Registry())(lambda doc: Finished())


def test_source_must_be_a_model():
    with pytest.raises(ImproperlyConfigured, match="Django model class"):
        worker(name="s", source=object, registry=Registry())


def test_unknown_options_are_named():
    with pytest.raises(ImproperlyConfigured, match="unknown option 'retries'"):
        worker(name="o", source=Document, retries=3, registry=Registry())
    with pytest.raises(ImproperlyConfigured, match="max_attempts must be an int >= 1"):
        worker(name="o", source=Document, max_attempts=0, registry=Registry())


def test_eligible_must_be_callable():
    with pytest.raises(ImproperlyConfigured, match="callable returning a QuerySet"):
        worker(name="e", source=Document, eligible=Document.objects.all(), registry=Registry())


def test_eligible_of_another_model_is_rejected_naming_the_fix():
    reg = Registry()
    worker(name="wrong", source=Document, eligible=lambda: Tag.objects.all(), registry=reg)(module_level)
    with pytest.raises(ImproperlyConfigured, match="QuerySet of Tag.*source is Document"):
        reg["wrong"].eligible_queryset()


def test_unknown_worker_lookup_names_the_registered_ones():
    with pytest.raises(LookupError) as info:
        registry["nope"]
    assert "nope" in str(info.value) and "docs" in str(info.value)
    assert isinstance(info.value, KeyError)


def test_workers_py_is_autodiscovered():
    """In a fresh interpreter that imports nothing but Django's set-up: here, test modules
    import tests.testapp.workers themselves, which would hide a broken discovery."""
    import json
    import subprocess
    import sys

    from tests.helpers import ROOT, subprocess_env

    script = (
        "import json, sys, django\n"
        "assert 'tests.testapp.workers' not in sys.modules\n"
        "django.setup()\n"
        "from django_dbworker import registry\n"
        "print(json.dumps({'modules': 'tests.testapp.workers' in sys.modules,\n"
        "                  'workers': {n: registry[n].concurrency for n in registry}}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["modules"] is True  # imported by discovery, at set-up
    assert {"docs", "summaries", "uuids", "tags"} <= set(found["workers"])
    assert found["workers"]["docs"] == 2


@pytest.mark.parametrize("options,message", [
    ({"per_key": 1}, "per_key=1 needs key=, the field whose value the limit counts by"),
    ({"key": "author"}, "key='author' is given without per_key=, rate_per_key= or fair=; give per_key=N"),
    ({"key": "nope", "per_key": 1}, "key names 'nope', which Document does not have"),
    ({"key": "id", "per_key": 1}, "key field 'id' must be a concrete column of Document other than"),
    ({"key": "author", "per_key": 0}, "per_key must be an int >= 1"),
    ({"total": 2.5}, "total must be an int >= 1"),
    ({"key": 3, "per_key": 1}, "key must be a field name of the source model"),
])
def test_bad_flow_limits_are_refused_naming_the_fix(options, message):
    with pytest.raises(ImproperlyConfigured, match=re.escape(message)):
        worker(name="limited", source=Document, registry=Registry(), **options)(module_level)


def test_a_key_too_long_for_its_column_is_refused():
    with pytest.raises(ImproperlyConfigured, match="can hold values longer than the 255"):
        worker(name="limited", source=Document, registry=Registry(), key="text",
               per_key=1)(module_level)


def test_a_foreign_key_is_a_key_by_its_column():
    reg = Registry()
    worker(name="limited", source=Document, registry=reg, key="author", per_key=2,
           total=5)(module_level)
    w = reg["limited"]
    assert (w.key_column, w.per_key, w.total, w.limited) == ("author_id", 2, 5, True)
    worker(name="free", source=Document, registry=reg)(module_level)
    assert not reg["free"].limited
