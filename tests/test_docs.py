"""The project stands alone: no tracked file outside docs/ and benches/ points at guidance documents
that live outside the repository, and every docs/ page (and quoted section) a tracked file names exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# Names of the engineers' guidance documents kept beside the checkout (never shipped), in the forms
# the code used to cite them: DESIGN.md, STYLE.md, spec/<page>, "spec model.md §3", "spec §2.2",
# kernels-perf, landscape.md, qkp.md, and ../shared/ or shared/<folder> paths.
OUTSIDE = re.compile(
    r"DESIGN\.md|STYLE\.md|(?<![\w./-])spec/|\bspec (?:model\.md|§)|kernels-perf|landscape\.md"
    r"|(?<![\w/-])qkp\.md|\.\./shared\b|(?<![\w.-])shared/(?:spec|tools|seeds|hooks)\b"
)
# docs/page.md, optionally followed (across spaces and comment markers) by a quoted section name.
DOC_REF = re.compile(r'docs/([\w./-]+?\.md)(?:[\s/#!*]*"([^"\n]+)")?')
EXEMPT = ("docs/", "benches/")


def tracked_texts() -> list[tuple[str, str]]:
    """(path, text) of every tracked text file but this one (its patterns and examples would match
    themselves); binaries (the GGUF fixtures) are skipped."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    me = Path(__file__).resolve().relative_to(ROOT).as_posix()
    texts = []
    for rel in filter(None, out.split("\0")):
        path = ROOT / rel
        if rel == me or not path.is_file():  # deleted in the working tree
            continue
        try:
            texts.append((rel, path.read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            continue
    return texts


def headings(page: Path) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+\s+(.+)$", page.read_text(encoding="utf-8"), re.M)}


def test_no_reference_outside_the_repository():
    found = []
    for rel, text in tracked_texts():
        if rel.startswith(EXEMPT):
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, "point these at docs/ instead:\n" + "\n".join(found)


def test_every_docs_reference_exists():
    missing = []
    cache: dict[str, set[str]] = {}
    for rel, text in tracked_texts():
        for m in DOC_REF.finditer(text):
            page, section = m.group(1), m.group(2)
            line = text.count("\n", 0, m.start()) + 1
            if not (DOCS / page).is_file():
                missing.append(f"{rel}:{line}: docs/{page} does not exist")
                continue
            if section is not None:
                names = cache.setdefault(page, headings(DOCS / page))
                if section not in names:
                    missing.append(f'{rel}:{line}: docs/{page} has no section "{section}"')
    assert not missing, "\n".join(missing)


def test_the_patterns_catch_what_they_must():
    for bad in (
        "see DESIGN.md",
        "(STYLE.md §2)",
        "(spec/qkp.md)",
        "(spec model.md §3.5)",
        "(spec §2.2)",
        "kernels-perf.md §1",
        "(spec/landscape.md §3.1)",
        'qkp.md "hello"',
        "../shared/tools/make_big.py",
        "(shared/spec/model.md §1.2)",
    ):
        assert OUTSIDE.search(bad), bad
    for fine in ("docs/protocol.md", "the shared expert", "openapi/spec/x", "the inspect/ folder"):
        assert not OUTSIDE.search(fine), fine
    m = DOC_REF.search('// (docs/numerics.md\n// "Chunk alignment")')
    assert m and m.groups() == ("numerics.md", "Chunk alignment")
