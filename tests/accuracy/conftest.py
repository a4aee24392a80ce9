"""The accuracy runners set MOIRA_* variables in their own process (as a run does before it
starts an engine); tests that call them in-process must not leak those into later tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _restore_environ():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
