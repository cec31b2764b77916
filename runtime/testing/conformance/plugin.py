"""The suite's pytest plugin: the `--device NAME` option (pytest reads options before it loads
a --pyargs package's conftest, so the option lives here and is loaded with `-p`)."""
from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default=None,
                     help="the platform to test (default: RUNTIME_DEVICE, else detection)")
