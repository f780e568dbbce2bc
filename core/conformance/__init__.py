"""The conformance suite: every op of a backend against the reference, on fresh random inputs.

``run_conformance(backend)`` returns a ``Report``; ``deepinfer conformance --backend NAME`` prints it and writes
JSON; ``pytest --deepinfer-backend NAME --pyargs deepinfer.conformance`` runs the same cases as pytest tests.
Cases for each op family live in the file of the same name as the family in ``deepinfer.ops``; tolerances are
data in ``tolerances.py``.
"""

from .runner import CaseResult, Report, run_conformance

__all__ = ["CaseResult", "Report", "run_conformance"]
