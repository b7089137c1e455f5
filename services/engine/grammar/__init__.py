"""Grammar matchers for structured outputs: one per constrained request, from a cache of
compiled constraints (``compiler.py``), and the token masks they give (``matcher.py``)."""

from services.engine.grammar.compiler import GrammarCompiler
from services.engine.grammar.matcher import RequestGrammar

__all__ = ["GrammarCompiler", "RequestGrammar"]
