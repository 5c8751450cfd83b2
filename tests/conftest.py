import pytest


@pytest.fixture(autouse=True)
def private_tuning_cache(tmp_path, monkeypatch):
    """Each test gets its own tuning cache: a cached configuration from another test would skip the trials."""
    path = tmp_path / "pipeopt-cache" / "tuned.json"
    monkeypatch.setenv("PIPEOPT_CACHE", str(path))
    return path
