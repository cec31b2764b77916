"""`python -m runtime.testing.conformance --device NAME [pytest options]` runs the suite."""
import sys

import pytest

sys.exit(pytest.main(["-p", "runtime.testing.conformance.plugin", "--pyargs",
                      "runtime.testing.conformance", *sys.argv[1:]]))
