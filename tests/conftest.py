"""Fixtures shared by every test directory: one CPU InferenceSession per test session."""

import pytest
from max.driver import CPU
from max.engine import InferenceSession


@pytest.fixture(scope="session")
def cpu():
    return CPU()


@pytest.fixture(scope="session")
def session(cpu):
    return InferenceSession(devices=[cpu])
