"""Structured outputs over llguidance: the constraint a request gives (params.py,
StructuredOutputsParams, validated on construction) and the matchers of constrained
sequences with their token bitmasks (manager.py, StructuredOutputManager, the one owner of
every matcher).
"""

from jpaged.structured_output.params import KINDS, StructuredOutputsParams

__all__ = ["KINDS", "StructuredOutputsParams"]
