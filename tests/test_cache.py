import json
import multiprocessing as mp

import pytest

from pipeopt.cache import FORMAT, TunedCache, default_path, fingerprint


def _writer(path, who, n):
    cache = TunedCache(path)
    for i in range(n):
        cache.put(f"{who}-{i}", {"loader": None, "samples_per_s": float(i)})


def test_concurrent_writers_neither_corrupt_nor_lose_entries(tmp_path):
    path = tmp_path / "tuned.json"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(path, who, 25)) for who in ("a", "b", "c")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    data = json.loads(path.read_text())
    assert data["pipeopt_cache"] == FORMAT
    assert len(data["entries"]) == 75


def test_roundtrip_and_foreign_files(tmp_path):
    path = tmp_path / "sub" / "tuned.json"
    cache = TunedCache(path)
    assert cache.get("k") is None
    cache.put("k", {"loader": {"num_workers": 4}, "samples_per_s": 10.0})
    assert cache.get("k")["loader"] == {"num_workers": 4}
    path.write_text(json.dumps({"something": "else"}))
    with pytest.warns(UserWarning, match="not a pipeopt tuning cache"):
        assert cache.get("k") is None


def test_fingerprint_is_stable_and_order_free():
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})


def test_default_location(monkeypatch, tmp_path):
    monkeypatch.setenv("PIPEOPT_CACHE", str(tmp_path / "x.json"))
    assert default_path() == tmp_path / "x.json"
    monkeypatch.delenv("PIPEOPT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_path() == tmp_path / "pipeopt" / "tuned.json"
