"""``{% load dbworker %}``: show a row's execution status in any template.

``{% dbworker_status obj "ocr" %}`` renders a badge; ``{% dbworker_status obj "ocr" as s %}``
assigns the status (an ``ExecutionStatus``, or ``None`` when the row has no record; a
stored value that is no status, written by hand or by a newer version, is assigned as the
string it is and shown as "Unknown (value)", escaped).
On list pages annotate the queryset with ``annotate_execution_status(qs, "ocr")``: the tag
then reads ``obj.ocr_execution_status`` and runs no query of its own.
"""

from __future__ import annotations

from typing import Any

from django import template
from django.templatetags.static import static
from django.utils.html import format_html
from django.utils.safestring import SafeString

from ..status import ExecutionStatus

register = template.Library()

_MISSING = object()
STYLESHEET = "django_dbworker/dbworker.css"


def status_label(status: ExecutionStatus | None) -> str:
    return "No record" if status is None else status.name.title()


def status_badge(status: ExecutionStatus | str | None) -> SafeString:
    """The badge HTML: one stable class per status, so sites can restyle it. A value that
    is no status (a row written by hand, a newer version's status) renders as "Unknown",
    never as a server error."""
    try:
        known = None if status is None else ExecutionStatus(status)
    except ValueError:
        return format_html('<span class="dbworker-status dbworker-status--unknown" '
                           'title="{}">Unknown ({})</span>', status, status)
    modifier = "none" if known is None else known.value
    return format_html('<span class="dbworker-status dbworker-status--{}">{}</span>',
                       modifier, status_label(known))


def status_of(obj: Any, worker: str) -> ExecutionStatus | str | None:
    """The annotated status when present (no query), else the one query of
    ``execution_status()``. A stored value that is no status comes back as it is (for the
    badge's "Unknown (value)"), where ``execution_status()`` would raise."""
    value: Any = getattr(obj, f"{worker}_execution_status", _MISSING)
    if value is _MISSING:
        from ..api import _executions  # models are ready by the time a tag renders

        value = _executions(worker, obj).values_list("status", flat=True).first()
    if value is None:
        return None
    try:
        return ExecutionStatus(value)
    except ValueError:
        return value  # not a status we know: the badge says "Unknown (value)"


class StatusNode(template.Node):
    def __init__(self, obj: Any, worker: Any, target: str | None) -> None:
        self.obj, self.worker, self.target = obj, worker, target

    def render(self, context: template.Context) -> str:
        status = status_of(self.obj.resolve(context), str(self.worker.resolve(context)))
        if self.target is not None:
            context[self.target] = status
            return ""
        return status_badge(status)


@register.tag
def dbworker_status(parser: template.base.Parser, token: template.base.Token) -> StatusNode:
    bits = token.split_contents()
    target = None
    if len(bits) == 5 and bits[3] == "as":
        target = bits[4]
        bits = bits[:3]
    if len(bits) != 3:
        raise template.TemplateSyntaxError(
            f"{bits[0]} takes an object and a worker name: "
            f'{{% {bits[0]} obj "ocr" %}} or {{% {bits[0]} obj "ocr" as status %}}'
        )
    return StatusNode(parser.compile_filter(bits[1]), parser.compile_filter(bits[2]), target)


@register.simple_tag
def dbworker_stylesheet() -> SafeString:
    """``<link>`` to the badge CSS, for pages outside the admin."""
    return format_html('<link rel="stylesheet" href="{}">', static(STYLESHEET))
