"""The documents as contracts: every relative link resolves inside the repository (to a file
and, where it names one, a heading), every run folder a document cites exists and every run
folder kept is cited, no document names a path of the machine it was written on, and each
stays short enough to read (README.md <= 250 lines, docs/*.md <= 400)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BENCH = DOCS / "bench"
README = ROOT / "README.md"
MAX_README_LINES = 250
MAX_DOC_LINES = 400

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
CODE_BLOCK = re.compile(r"^```.*?^```", re.M | re.S)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
# a run folder cited: docs/bench/NAME[/SUB], or bench/NAME[/SUB] opening a link or a code span
CITED_RUN = re.compile(r"(?:docs/|\(|`)bench/([A-Za-z0-9][A-Za-z0-9._-]*)(/[A-Za-z0-9._-]+)?")
MACHINE_PATHS = ("/work/", "/root/", "/home/", "/tmp/", "/Users/")


def documents() -> list[Path]:
    """The prose documents: README.md, docs/*.md and the run folders' index."""
    return [README, *sorted(DOCS.glob("*.md")), BENCH / "README.md"]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to
    hyphens (letters, digits, '-' and '_' kept)."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor in a Markdown text, repeated headings numbered as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(CODE_BLOCK.sub("", markdown)):
        base = slug(heading)
        count = seen.get(base, 0)
        found.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return found


def broken_links(markdown: str, path: Path) -> list[str]:
    """The relative links of `markdown`, read as the file `path`, that do not resolve to a
    file (and, for a Markdown file, a heading) inside the repository."""
    broken = []
    for target in LINK.findall(CODE_BLOCK.sub("", markdown)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        if not file_part:
            ok = anchor in anchors(markdown)
        else:
            resolved = (path.parent / file_part).resolve()
            ok = resolved.is_relative_to(ROOT) and resolved.exists()
            if ok and anchor and resolved.suffix == ".md":
                ok = anchor in anchors(resolved.read_text())
        if not ok:
            broken.append(target)
    return broken


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path.read_text(), path) == []


def test_a_broken_link_is_caught() -> None:
    """The check has power: each kind of broken link added to a sound document is reported,
    and nothing else is."""
    doc = DOCS / "design.md"
    text = doc.read_text()
    assert broken_links(text, doc) == []
    mutants = {
        "nowhere.md": "a missing file",
        "#no-such-heading": "a missing heading here",
        "benchmarks.md#no-such-table": "a missing heading there",
        "../../outside.md": "a file outside the repository",
    }
    for target in mutants:
        assert broken_links(text + f"\n[x]({target})\n", doc) == [target], mutants[target]


def test_documents_stay_short() -> None:
    lengths = {p.name: len(p.read_text().splitlines()) for p in DOCS.glob("*.md")}
    assert {name: n for name, n in lengths.items() if n > MAX_DOC_LINES} == {}
    assert len(README.read_text().splitlines()) <= MAX_README_LINES


def test_no_machine_paths() -> None:
    """A document names files of the repository, never paths of the machine it was run on."""
    offenders = [
        f"{p.relative_to(ROOT)}: {needle}"
        for p in documents()
        for needle in MACHINE_PATHS
        if needle in p.read_text()
    ]
    assert offenders == []


def cited_runs() -> set[str]:
    """Run folders (and run subfolders) that README.md and docs/*.md cite."""
    cited = set()
    for path in [README, *DOCS.glob("*.md")]:
        for folder, sub in CITED_RUN.findall(path.read_text()):
            cited.add(folder + sub)
    return cited


def test_cited_runs_exist_and_kept_runs_are_cited() -> None:
    cited = cited_runs()
    missing = sorted(c for c in cited if not (BENCH / c).exists())
    kept = {p.name for p in BENCH.iterdir() if p.is_dir()}
    uncited = sorted(k for k in kept if not any(c.split("/")[0] == k for c in cited))
    assert missing == [] and uncited == [], (missing, uncited)
