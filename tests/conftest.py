import pytest


@pytest.fixture(autouse=True)
def private_tuning_cache(tmp_path, monkeypatch):
    """Each test gets its own tuning cache: a cached configuration from another test would skip the trials."""
    path = tmp_path / "pipeopt-cache" / "tuned.json"
    monkeypatch.setenv("PIPEOPT_CACHE", str(path))
    return path


@pytest.fixture
def room_for_a_trial(monkeypatch):
    """At most 4 loader workers: a trial and its after-windows then fit a short test fit whatever count the loader
    model picks on this machine (a large pick's in-flight batches alone could outlast the fit, and then no trial
    starts - the rule that no trial begins that the fit cannot finish)."""
    from pipeopt.tuning import loader_search

    monkeypatch.setattr(loader_search, "MAX_WORKERS", 4)
