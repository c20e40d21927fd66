"""The integration tests here also use the shared helpers of ``tests/`` (``models.py``)."""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent.parent)
if _TESTS not in sys.path:
    sys.path.append(_TESTS)
