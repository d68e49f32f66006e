"""The README stays a newcomer's page: short, with its two set-up commands, and every relative
link in it and in docs/ points at a file that exists."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_readme_is_short_and_holds_the_two_set_up_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert "pip install -e . && rekv handoff" in text
    assert "pip install -e '.[test]' && pytest" in text
    assert "pip install -e '.[test]' && pytest" in (ROOT / ".ci" / "run").read_text()


def test_every_relative_link_resolves():
    broken = [f"{doc.relative_to(ROOT)}: {target}" for doc in DOCS
              for target in LINK.findall(doc.read_text())
              if "://" not in target and not (doc.parent / target).exists()]
    assert not broken, broken


def test_every_doc_is_linked_from_the_readme():
    linked = {(ROOT / t).resolve() for t in LINK.findall((ROOT / "README.md").read_text())}
    assert {d.resolve() for d in DOCS[1:]} <= linked
