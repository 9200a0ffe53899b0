"""docs/design.md's claims name the tests that pin them (issue 23 item 4), as docs/errors.md rows do.

The convention: a *claim* is a paragraph or a bullet that opens with a bold sentence
(`**One memory system.** ...`, `- **Syncs.** ...`). Each claim names, inside that paragraph
or bullet, at least one test as `tests/test_x.py::test_name` (a parametrized id may follow in
brackets). Text that explains without a bold lead is explanation, not a claim. Every test node id
named anywhere in the document must exist.
"""

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
NODE = re.compile(r"`(tests/\w+\.py)::(test_\w+)(?:\[[^\]`]+\])?`")


def paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each paragraph or bullet, code blocks and tables skipped."""
    out, cur, start, fenced = [], [], 0, False

    def flush():
        if cur:
            out.append((start, " ".join(cur)))
            cur.clear()

    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            flush()
            fenced = not fenced
            continue
        if fenced or line.startswith("|") or line.startswith("#") or not line.strip():
            flush()
            continue
        if line.startswith("- "):  # a bullet starts its own paragraph
            flush()
        if not cur:
            start = number
        cur.append(line.strip())
    flush()
    return out


def claims(text: str) -> list[tuple[int, str]]:
    return [(n, p) for n, p in paragraphs(text) if re.match(r"(- )?\*\*", p)]


def missing_tests(text: str) -> list[str]:
    gone = []
    for path, name in NODE.findall(text):
        file = ROOT / path
        if not file.exists() or not re.search(rf"^\s*(async )?def {name}\(", file.read_text(), re.M):
            gone.append(f"{path}::{name}")
    return gone


def test_every_claim_in_docs_design_md_names_a_test_that_exists():
    text = (ROOT / "docs" / "design.md").read_text()
    found = claims(text)
    assert len(found) >= 10, "the claim convention found almost no claims: did the bold leads change?"
    unpinned = [f"docs/design.md:{n}: {p[:70]}" for n, p in found if not NODE.search(p)]
    assert not unpinned, "claims naming no `tests/x.py::test_name`:\n" + "\n".join(unpinned)
    assert not missing_tests(text), f"docs/design.md names tests that do not exist: {missing_tests(text)}"


def test_the_checker_catches_an_unpinned_claim_and_a_missing_test():
    doc = ("Intro text without a claim.\n\n**A claim.** It holds.\n\n"
           "**Another.** Pinned by `tests/test_design_doc.py::test_no_such_test`.\n\n"
           "```\n**not a claim** inside code\n```\n- **Bullet claim.** `tests/test_design_doc.py::paragraphs`\n")
    found = claims(doc)
    assert [n for n, _ in found] == [3, 5, 10]
    assert [n for n, p in found if not NODE.search(p)] == [3, 10]
    assert missing_tests(doc) == ["tests/test_design_doc.py::test_no_such_test"]
    assert missing_tests("`tests/test_design_doc.py::test_the_checker_catches_an_unpinned_claim_and_a_missing_test`") == []
