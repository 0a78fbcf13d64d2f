"""Fixtures of the command-line tests."""

import pytest


@pytest.fixture
def _cache(tmp_path, monkeypatch):
    """oomb's cache folder ($OOMB_CACHE_DIR) in the test's own tmp_path, so that no test reads what another cached;
    the modules whose tests all need it use it through ``pytestmark = pytest.mark.usefixtures("_cache")``."""
    monkeypatch.setenv("OOMB_CACHE_DIR", str(tmp_path / "cache"))
