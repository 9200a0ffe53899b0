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

Claim and test name each other (issue 33 item 6): a claim's id is its bold lead as a slug
(`**Syncs.**` -> `design#syncs`), and each test a claim names carries
`@pytest.mark.pins("design#syncs")`. A claim naming a test without that marker fails, and so
does a marker naming a claim the document lacks or a claim that does not name the test. The
tests a claim names that only run on CUDA (`@cuda`, `pytest.mark.cuda`, or a module's
`pytestmark`) are listed, and only they, under "## Not verified in CI".
"""
import ast

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


def claim_id(paragraph: str) -> str:
    lead = re.match(r"(?:- )?\*\*(.+?)\*\*", paragraph).group(1)
    return "design#" + re.sub(r"[^a-z0-9]+", "-", lead.lower()).strip("-")


def claim_pins(text: str) -> dict[str, set[str]]:
    """claim id -> the tests (`tests/x.py::test_y`, parametrized ids dropped) the claim names."""
    out: dict[str, set[str]] = {}
    for _, p in claims(text):
        out.setdefault(claim_id(p), set()).update(f"{f}::{n}" for f, n in NODE.findall(p))
    return out


def _is_cuda(node: ast.expr) -> bool:
    node = node.func if isinstance(node, ast.Call) else node
    return (isinstance(node, ast.Name) and node.id == "cuda") or (isinstance(node, ast.Attribute) and node.attr == "cuda")


def marked_pins(tests: Path) -> dict[str, tuple[set[str], bool]]:
    """test node id -> (the claims its `pytest.mark.pins` names, whether it only runs on CUDA)."""
    out = {}
    for file in sorted(tests.glob("test_*.py")):
        tree = ast.parse(file.read_text())
        module_cuda = False
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in stmt.targets):
                marks = stmt.value.elts if isinstance(stmt.value, (ast.List, ast.Tuple)) else [stmt.value]
                module_cuda = any(_is_cuda(m) for m in marks)
        for fn in tree.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.name.startswith("test_"):
                continue
            pins = {a.value for d in fn.decorator_list if isinstance(d, ast.Call)
                    and isinstance(d.func, ast.Attribute) and d.func.attr == "pins"
                    for a in d.args if isinstance(a, ast.Constant)}
            cuda = module_cuda or any(_is_cuda(d) for d in fn.decorator_list)
            out[f"tests/{file.name}::{fn.name}"] = (pins, cuda)
    return out


def unverified_section(text: str) -> set[str]:
    """The tests listed under "## Not verified in CI"."""
    section = text.split("\n## Not verified in CI\n", 1)
    section = section[1].split("\n## ", 1)[0] if len(section) == 2 else ""
    return {f"{f}::{n}" for f, n in NODE.findall(section)}


def pin_drift(text: str, tests: Path) -> list[str]:
    """Where claims and `pytest.mark.pins` markers disagree, and what "Not verified in CI" gets wrong."""
    ids = [claim_id(p) for _, p in claims(text)]
    drift = [f"two claims have the id {i}: reword one bold lead" for i in sorted({i for i in ids if ids.count(i) > 1})]
    named, marked = claim_pins(text), marked_pins(tests)
    for claim, nodes in sorted(named.items()):
        drift += [f"{claim} names {node}, which lacks @pytest.mark.pins(\"{claim}\")"
                  for node in sorted(nodes) if node in marked and claim not in marked[node][0]]
        drift += [f"{claim} names {node}, which is no test function at the top of a tests/ file"
                  for node in sorted(nodes) if node not in marked]
    for node, (pins, _) in sorted(marked.items()):
        for claim in sorted(pins):
            if claim not in named:
                drift.append(f"{node} pins {claim}, which docs/design.md does not contain")
            elif node not in named[claim]:
                drift.append(f"{node} pins {claim}, which does not name it")
    cuda_only = {node for nodes in named.values() for node in nodes if node in marked and marked[node][1]}
    listed = unverified_section(text)
    drift += [f"{node} runs only on CUDA: list it under \"## Not verified in CI\"" for node in sorted(cuda_only - listed)]
    drift += [f"\"## Not verified in CI\" lists {node}, which is not a CUDA-only pin" for node in sorted(listed - cuda_only)]
    return drift


def test_claims_and_the_tests_that_pin_them_name_each_other():
    drift = pin_drift((ROOT / "docs" / "design.md").read_text(), ROOT / "tests")
    assert not drift, "docs/design.md's claims and the tests' pins markers disagree:\n" + "\n".join(drift)


def test_the_pin_checker_catches_each_way_of_drifting(tmp_path):
    (tmp_path / "test_a.py").write_text(
        "import pytest\ncuda = pytest.mark.cuda\n\n"
        "@pytest.mark.pins(\"design#one\")\ndef test_pinned(): pass\n\n"
        "def test_unmarked(): pass\n\n"
        "@pytest.mark.pins(\"design#gone\")\ndef test_pins_a_missing_claim(): pass\n\n"
        "@pytest.mark.pins(\"design#one\")\ndef test_not_named_by_its_claim(): pass\n\n"
        "@cuda\n@pytest.mark.pins(\"design#two\")\ndef test_on_cuda(): pass\n")
    (tmp_path / "test_b.py").write_text("import pytest\npytestmark = [pytest.mark.cuda]\n\n"
                                        "@pytest.mark.pins(\"design#two\")\ndef test_gpus(): pass\n")
    doc = ("**One.** `tests/test_a.py::test_pinned`, `tests/test_a.py::test_unmarked`.\n\n"
           "- **Two.** `tests/test_a.py::test_on_cuda`, `tests/test_b.py::test_gpus`.\n\n"
           "## Not verified in CI\n\n- `tests/test_a.py::test_on_cuda`\n- `tests/test_a.py::test_pinned`\n")
    assert marked_pins(tmp_path)["tests/test_b.py::test_gpus"] == ({"design#two"}, True)
    assert pin_drift(doc, tmp_path) == [
        "design#one names tests/test_a.py::test_unmarked, which lacks @pytest.mark.pins(\"design#one\")",
        "tests/test_a.py::test_not_named_by_its_claim pins design#one, which does not name it",
        "tests/test_a.py::test_pins_a_missing_claim pins design#gone, which docs/design.md does not contain",
        "tests/test_b.py::test_gpus runs only on CUDA: list it under \"## Not verified in CI\"",
        "\"## Not verified in CI\" lists tests/test_a.py::test_pinned, which is not a CUDA-only pin"]
    assert pin_drift("**Three.** `tests/test_a.py::test_nowhere`\n", tmp_path)[0] == \
        "design#three names tests/test_a.py::test_nowhere, which is no test function at the top of a tests/ file"
    assert pin_drift(doc.replace("**Two.**", "**One.**"), tmp_path)[0] == "two claims have the id design#one: reword one bold lead"


def hidden_claims(text: str) -> list[int]:
    """Lines with bold the checker does not read as a claim: past a paragraph's lead, or in a table
    (code spans and code blocks aside). Claims live only where the checker looks."""
    bold = lambda s: "**" in re.sub(r"`[^`]*`", "", s)
    hidden = [n for n, p in paragraphs(text) if bold(re.sub(r"^(- )?\*\*.+?\*\*", "", p))]
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("|") and bold(line):
            hidden.append(number)
    return sorted(hidden)


def test_docs_design_md_has_no_bold_outside_a_claims_lead():
    hidden = hidden_claims((ROOT / "docs" / "design.md").read_text())
    assert not hidden, (f"docs/design.md lines {hidden}: bold past a paragraph's lead or in a table is a claim the "
                        "checker cannot see; open a paragraph with it (and pin it) or drop the bold")
    assert hidden_claims("**Lead.** then **more**.\n\n- **B.** `**code**`\n\n| a | **b** |\n\n```\n| **x** |\n```\n") == [1, 5]


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
