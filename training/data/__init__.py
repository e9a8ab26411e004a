"""Real prompt/response data for the length predictor.

Every loader returns a list of :class:`~training.data.example.Example`: one prompt (as chat turns, so
truncation can keep the latest turn), the response text or its known token count, and a conversation
id used to split without leakage.
"""

from training.data.example import DataError, Example, Turn
from training.data.loaders import FORMATS, load_examples

__all__ = ["FORMATS", "DataError", "Example", "Turn", "load_examples"]
