"""The one format of lightning_galv's input errors: the value, the rule it breaks, and what to do instead.

Every check on user input (plans, profiles, search spaces, Galvatron files) raises through
:func:`bad_value`, so a message always reads ``'pp=3': must divide world_size 8. HINT: pick pp from ...``
and tests (and users grepping logs) can rely on the ``HINT:`` part being there. This module imports
nothing, so the torch-free modules (``plan``, ``planner``, ``compat``) can all use it.
"""

from __future__ import annotations


def bad_value(value: object, rule: str, hint: str) -> ValueError:
    """A ``ValueError`` reading ``{value!r}: {rule}. HINT: {hint}``, to be raised by the caller.

    Returned rather than raised so that ``raise bad_value(...)`` shows the failing check as the
    raising line in tracebacks, and type checkers see that the branch ends there.
    """
    return ValueError(f"{value!r}: {rule}. HINT: {hint}")
