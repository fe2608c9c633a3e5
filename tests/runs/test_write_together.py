"""Result files that belong together (bench.json/md/png; best.toml and tune.*) are the old set or
the new one: a writer killed before its journal leaves the old set, one killed during its
renames is finished by the next writer."""

import os

import pytest

from onegpu.runs import atomic as folders


def _set(folder):
    return {p.name: p.read_text() for p in folder.iterdir()}


def test_a_writer_that_fails_midway_leaves_the_old_set_and_no_temporaries(tmp_path):
    folders.write_together(tmp_path, {"a.json": "old-a", "a.md": "old-md"})

    def fails(path):
        path.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        folders.write_together(tmp_path, {"a.json": "new-a", "a.md": fails})
    assert _set(tmp_path) == {"a.json": "old-a", "a.md": "old-md"}


def test_renames_cut_short_are_finished_by_the_next_writer(tmp_path, monkeypatch):
    folders.write_together(tmp_path, {"a.json": "old-a", "a.md": "old-md", "a.png": "old-png"})
    real, calls = os.replace, {"n": 0}

    def killed_after_one(src, dst):
        calls["n"] += 1
        if calls["n"] == 3:  # the journal's own rename, then one file: then the kill
            raise SystemExit("killed")
        real(src, dst)

    monkeypatch.setattr(os, "replace", killed_after_one)
    with pytest.raises(SystemExit):
        folders.write_together(tmp_path, {"a.json": "new-a", "a.md": "new-md", "a.png": "new-png"})
    monkeypatch.setattr(os, "replace", real)
    files = _set(tmp_path)
    assert files.pop(folders.JOURNAL) and files["a.json"] == "new-a" and files["a.md"] == "old-md"
    folders.finish_together(tmp_path)  # what the next writer does first
    assert _set(tmp_path) == {"a.json": "new-a", "a.md": "new-md", "a.png": "new-png"}


def test_functions_write_to_the_path_they_are_given(tmp_path):
    folders.write_together(tmp_path / "new", {"x.bin": lambda p: p.write_bytes(b"\x89PNG")})
    assert (tmp_path / "new" / "x.bin").read_bytes() == b"\x89PNG"
    assert oct((tmp_path / "new" / "x.bin").stat().st_mode & 0o777) == oct(folders.file_mode())
