"""Structured-output constraints, shared by the router (validation) and the engine (masks).

No torch in here: the router checks a constraint before any worker sees it, the engine
builds its matchers from the same grammar text (``services.engine.grammar``).
"""

from services.grammar.constraint import Constraint, constraint_from_proto, constraint_to_proto
from services.grammar.llg import ConstraintError, check_constraint, grammar_text

__all__ = [
    "Constraint",
    "ConstraintError",
    "check_constraint",
    "constraint_from_proto",
    "constraint_to_proto",
    "grammar_text",
]
