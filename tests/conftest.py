"""Fixtures shared by every test directory: one CPU InferenceSession per test session."""

import pytest
from max.driver import CPU
from max.engine import InferenceSession

from .mojo_defines import set_default_mokv_defines


@pytest.fixture(scope="session")
def cpu():
    return CPU()


@pytest.fixture(scope="session")
def session(cpu):
    return InferenceSession(devices=[cpu])


@pytest.fixture(scope="session", autouse=True)
def default_mokv_defines(session):
    """Before any compile: see tests/mojo_defines.py."""
    set_default_mokv_defines(session)
