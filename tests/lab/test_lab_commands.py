"""The lab's two commands print their tables and write nothing unless told where (hardening round 3, item 9): run
inside a checkout, ``python -m prefzoo.lab.conformance`` used to overwrite the project's docs/conformance.md (and
``python -m prefzoo.lab.toy`` docs/toy_bandit.*) with whatever subset it had run."""

from __future__ import annotations

from prefzoo.lab import conformance, toy


def test_conformance_prints_its_table_and_writes_nothing_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert conformance.main(["--only", "best-of-4", "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert "best-of-4" in out and "pi*" in out
    assert list(tmp_path.rglob("*")) == []
    page = tmp_path / "page" / "conformance.md"
    assert conformance.main(["--only", "best-of-4", "--seeds", "2", "--out", str(page)]) == 0
    assert "best-of-4" in page.read_text()


def test_the_toy_prints_its_table_and_writes_nothing_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert toy.main(["--steps", "3"]) == 0
    assert "nothing written" in capsys.readouterr().out
    assert list(tmp_path.rglob("*")) == []
    assert toy.main(["--steps", "3", "--out-dir", "plots"]) == 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["toy_bandit.md", "toy_bandit.png"]
