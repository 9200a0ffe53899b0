"""docs/design.md's claims name the tests that pin them (issue 23 item 4), as docs/errors.md rows do.

The convention: a *claim* is a paragraph or a bullet that opens with a bold sentence
(`**One memory system.** ...`, `- **Syncs.** ...`). Each claim names, inside that paragraph
or bullet, at least one test as `tests/test_x.py::test_name` (a parametrized id may follow in
brackets). Text that explains without a bold lead is explanation, not a claim. Every test node id
named anywhere in the document must exist.

The module map (the code block under "## Modules and boundaries") names every module of the
tree: each file `zerotier/x.py` has an entry `x.py`, each package `zerotier/p/` an entry `p/`
whose text names each of its modules (`q.py`, or `q` as a word), and every name the map gives
exists (issue 33 item 6).
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


def module_map(text: str) -> dict[str, str]:
    """The map's `zerotier/` entries: name (`x.py` or `p/`) -> the entry's text (continuation lines included)."""
    block = text.split("## Modules and boundaries", 1)[1].split("```", 2)[1]
    entries, name = {}, None
    for line in block.split("zerotier/", 1)[1].splitlines()[1:]:
        if not line.startswith("  "):  # the next top-level directory (native/): the map of zerotier/ ends
            break
        head = line[2:].split(" ", 1)
        if not line.startswith("   ") and head[0]:
            name = head[0]
            entries[name] = head[1] if len(head) > 1 else ""
        else:
            entries[name] += " " + line.strip()
    return entries


def map_drift(text: str, package: Path) -> list[str]:
    """What the module map of `text` and the tree under `package` disagree on."""
    entries = module_map(text)
    tree = {f.name for f in package.glob("*.py") if f.name != "__init__.py"}
    tree |= {d.name + "/" for d in package.iterdir() if (d / "__init__.py").exists()}
    drift = [f"zerotier/{n} is not in the map" for n in sorted(tree - set(entries))]
    drift += [f"the map names zerotier/{n}, which does not exist" for n in sorted(set(entries) - tree)]
    for pkg in sorted(n for n in entries if n.endswith("/") and n in tree):
        files = {f.stem for f in (package / pkg).glob("*.py") if f.name != "__init__.py"}
        said = entries[pkg]
        drift += [f"zerotier/{pkg}{m}.py is not in the map's {pkg} entry" for m in sorted(files)
                  if not re.search(rf"(?<![\w.]){re.escape(m)}\b", said)]
        drift += [f"the map's {pkg} entry names {pkg}{m}, which does not exist"
                  for m in sorted(set(re.findall(r"(\w+)\.py\b", said)) - files)]
    return drift


def test_the_module_map_in_docs_design_md_matches_the_tree():
    drift = map_drift((ROOT / "docs" / "design.md").read_text(), ROOT / "zerotier")
    assert not drift, "docs/design.md's module map and zerotier/ disagree:\n" + "\n".join(drift)


def test_the_map_checker_catches_a_missing_and_an_invented_module(tmp_path):
    (tmp_path / "pkg").mkdir()
    for f in ("a.py", "b.py", "pkg/__init__.py", "pkg/one.py", "pkg/two.py"):
        (tmp_path / f).write_text("")
    doc = ("## Modules and boundaries\n\n```\nzerotier/\n  a.py   first\n  ghost.py  gone\n"
           "  pkg/   one.py (a thing), three.py\n         more text\nnative/\n  x\n```\n")
    assert set(module_map(doc)) == {"a.py", "ghost.py", "pkg/"}
    assert "more text" in module_map(doc)["pkg/"]
    assert map_drift(doc, tmp_path) == [
        "zerotier/b.py is not in the map", "the map names zerotier/ghost.py, which does not exist",
        "zerotier/pkg/two.py is not in the map's pkg/ entry", "the map's pkg/ entry names pkg/three, which does not exist"]


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
