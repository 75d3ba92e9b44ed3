"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest


@pytest.fixture
def runtime():
    """An installed :class:`relax_gdn.runtime.Runtime` for a test that runs an entry point's work in
    the pytest process (``run_training`` on CPU, a model build that needs the CPU shims), closed
    after the test so no shim, filter or patch reaches a later test."""
    from relax_gdn.runtime import Runtime

    with Runtime() as installed:
        yield installed
