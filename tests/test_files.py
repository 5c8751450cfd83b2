"""The one atomic writer: a reader sees the old file or the new one, never half; a failed write leaves nothing."""

import pytest

from pipeopt.files import write_atomic


def test_a_write_replaces_the_file_whole_and_creates_its_directory(tmp_path):
    path = tmp_path / "a" / "b.json"
    write_atomic(path, "old")
    assert write_atomic(path, "new") == path and path.read_text() == "new"
    assert sorted(p.name for p in path.parent.iterdir()) == ["b.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "b.json"
    write_atomic(path, "old")
    with pytest.raises(UnicodeEncodeError):
        write_atomic(path, "\udcff")  # a lone surrogate cannot be written as UTF-8
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["b.json"]
