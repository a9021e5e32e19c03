"""A griffe extension for the API reference (mkdocs.yml): msrl's docstrings name other objects
with Sphinx roles (``:class:`~msrl.api.Learner```), which Markdown does not know; each becomes
the code span of the name it shows (``Learner`` for ``~msrl.api.Learner``, the whole path
otherwise), so the reference reads as the source does."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const|ref|term):`(~?)([^`<]+?)(?:\s*<([^>]+)>)?`")


def _plain(match: re.Match) -> str:
    tilde, target, explicit = match.group(1), match.group(2).strip(), match.group(3)
    shown = target if explicit is None else target
    if tilde:
        shown = target.rsplit(".", 1)[-1]
    return f"`{shown}`"


class SphinxRoles(griffe.Extension):
    """Rewrites Sphinx roles in every docstring griffe loads into Markdown code spans."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:  # noqa: D102 - griffe's hook
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_plain, obj.docstring.value)
