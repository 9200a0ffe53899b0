"""Install commands: every `pip install` the project prints or documents names a real distribution.

zerotier's distribution is "zerotier-offload" ("zerotier" on PyPI is an unrelated 2017 project, so a
hint saying `pip install 'zerotier[hf]'` installs someone else's package). Each install command in
the package's messages, the docs, examples and benchmarks must name ours, a local checkout (`-e .`)
or a known third-party package, and each extra it asks for must exist in pyproject.toml. The
README's two commands go through tools/install_torch.py, which picks the torch build for the host;
its choice is tested here, and CI runs the README's test command verbatim.
"""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Where users meet install commands: messages and docstrings (Python string literals), docs, scripts.
SCANNED = ["zerotier", "README.md", "docs", "examples", "benchmarks", "tools", "setup.py", ".ci/run"]
THIRD_PARTY = {  # named by a hint but not a dependency of ours
    "tomli": "zerotier/config.py reads TOML with it on Python 3.10",
    "deepspeed": "benchmarks/bench_cpu_adam.py compares DeepSpeedCPUAdam when it is installed",
    "pip": ".ci/run upgrades the build tools", "setuptools": ".ci/run", "wheel": ".ci/run",
}
OPTIONS_WITH_VALUE = {"-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url",
                      "-f", "--find-links", "-t", "--target", "--prefix", "--root", "--report",
                      "--upgrade-strategy"}
COMMAND = re.compile(r"\bpip3? install\b")
END_OF_COMMAND = re.compile(r"`|\(|\)|;|&&|\|\||\||#|\n")   # a code span, a parenthesis, the shell
REQUIREMENT = re.compile(r"(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)"
                         r"(?:\[(?P<extras>[^\]]*)\])?(?:\s*[<>=!~].*)?")


def load_install_torch():
    spec = importlib.util.spec_from_file_location("install_torch", ROOT / "tools" / "install_torch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


install_torch = load_install_torch()


def pyproject() -> dict:
    import tomllib  # Python 3.11+ (CI's Python); imported here so collection works on 3.10
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()   # PEP 503


def texts(path: Path):
    """(line, text) of each place in `path` that a user reads: for Python, its string literals."""
    source = path.read_text()
    if path.suffix != ".py":
        yield from enumerate(source.splitlines(), 1)
        return
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def install_commands(text: str) -> list[str]:
    """The arguments of each `pip install` in `text`, up to where the command ends."""
    commands = []
    for match in COMMAND.finditer(text):
        rest = text[match.end():]
        end = END_OF_COMMAND.search(rest)
        commands.append(rest[:end.start()] if end else rest)
    return commands


def problems(arguments: str, ours: str, extras: dict) -> list[str]:
    """What is wrong with one install command's arguments, given our name and pyproject's extras."""
    found = []
    known = {normalized(ours)} | set(map(normalized, THIRD_PARTY)) | {
        normalized(REQUIREMENT.fullmatch(r)["name"]) for r in dependencies(extras)}
    tokens = shlex.split(arguments)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token in OPTIONS_WITH_VALUE:
            i += 1
            continue
        if token.startswith("-") and token not in ("-e", "--editable"):
            continue
        if token in ("-e", "--editable"):
            continue                        # its value is checked as the next token
        if token.startswith("$"):
            continue                        # a shell variable: not a name
        local = re.fullmatch(r"\.(?:\[(?P<extras>[^\]]*)\])?", token)
        if local:
            wanted = local["extras"]
        elif token.startswith((".", "/", "~")) or "/" in token:
            found.append(f"{token!r}: a path other than the checkout (.)")
            continue
        else:
            requirement = REQUIREMENT.fullmatch(token)
            if requirement is None:
                found.append(f"{token!r}: not a requirement")
                continue
            name = normalized(requirement["name"])
            if name not in known:
                found.append(f"{token!r}: {requirement['name']} is neither ours ({ours}) nor a known "
                             "third-party package (pyproject.toml's dependencies, THIRD_PARTY here)")
                continue
            wanted = requirement["extras"] if name == normalized(ours) else None   # others' extras: theirs
        for extra in (wanted or "").split(","):
            if extra.strip() and extra.strip() not in extras:
                found.append(f"{token!r}: no extra {extra.strip()!r} in pyproject.toml "
                             f"(it has {', '.join(sorted(extras))})")
    return found


def dependencies(extras: dict) -> list[str]:
    return [*pyproject()["project"]["dependencies"], *(r for rs in extras.values() for r in rs)]


def scanned_files() -> list[Path]:
    files = []
    for entry in SCANNED:
        path = ROOT / entry
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        files += [p for p in candidates if p.is_file() and p.suffix in (".py", ".md", ".sh", ".txt", "")
                  and "__pycache__" not in p.parts and not p.name.endswith(".so")]
    return files


def test_distribution_name_is_ours_and_the_command_stays_zerotier():
    project = pyproject()["project"]
    assert project["name"] == "zerotier-offload"
    assert project["scripts"] == {"zerotier": "zerotier.cli:main"}


def test_every_install_hint_names_our_distribution_or_a_known_package_and_real_extras():
    project = pyproject()["project"]
    extras = project["optional-dependencies"]
    seen, found = 0, []
    for path in scanned_files():
        for line, text in texts(path):
            for arguments in install_commands(text):
                seen += 1
                found += [f"{path.relative_to(ROOT)}:{line}: pip install{arguments}: {problem}"
                          for problem in problems(arguments, project["name"], extras)]
    assert seen >= 10, f"only {seen} install commands found: is the scan looking in the right places?"
    assert not found, "\n".join(found)


@pytest.mark.parametrize("arguments, expected", [
    (" 'zerotier[hf]'", "zerotier is neither ours"),                     # the unrelated 2017 project
    (" 'zerotier-offload[hf,nope]'", "no extra 'nope'"),
    (' -e ".[nope]"', "no extra 'nope'"),
    (" deepspeed to add it", "to is neither ours"),                      # prose after a command
    (" ../elsewhere", "a path other than the checkout"),
])
def test_the_hint_check_reports(arguments, expected):
    extras = pyproject()["project"]["optional-dependencies"]
    assert any(expected in problem for problem in problems(arguments, "zerotier-offload", extras))


@pytest.mark.parametrize("arguments", [' -e ".[test]"', " 'zerotier-offload[hf]'", " pyyaml ",
                                       ' --no-index --find-links "$WHEELS" "$@"', " torch==2.13.0"])
def test_the_hint_check_accepts(arguments):
    extras = pyproject()["project"]["optional-dependencies"]
    assert problems(arguments, "zerotier-offload", extras) == []


def readme_command(heading: str) -> str:
    readme = (ROOT / "README.md").read_text()
    match = re.search(re.escape(heading) + r".*?```bash\n(?P<command>[^\n]+)\n```", readme, re.DOTALL)
    assert match, f"README.md has no ```bash block after {heading!r}"
    return match["command"]


def test_readme_commands_install_torch_first_and_ci_runs_the_test_command_verbatim():
    demo, tests = readme_command("Run the demo"), readme_command("Run the tests:")
    for command in (demo, tests):
        # torch first, in the build for this host; then pip keeps it (pyproject.toml leaves it unpinned)
        assert command.startswith("python tools/install_torch.py && python -m pip install -e ")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci, f".ci/run does not run the README's test command {tests!r}"


def test_install_torch_minimum_is_pyprojects():
    torch_requirement = next(d for d in pyproject()["project"]["dependencies"] if d.startswith("torch"))
    minimum = re.fullmatch(r"torch>=(\d+)\.(\d+)", torch_requirement)
    assert minimum, torch_requirement
    assert install_torch.TORCH_MINIMUM == (int(minimum[1]), int(minimum[2]))


CPU = ["torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cpu", "--retries", "2"]


@pytest.mark.parametrize("installed, nvidia_driver, platform, expected", [
    (None, False, "linux", CPU),                            # CPU-only Linux: never PyPI's CUDA wheel
    (None, True, "linux", ["torch==2.13.0"]),              # a GPU host: PyPI's wheel is the CUDA build
    (None, False, "darwin", ["torch==2.13.0"]),            # macOS/Windows wheels carry no CUDA
    (None, False, "win32", ["torch==2.13.0"]),
    ("2.13.0+cpu", False, "linux", None),                  # an installed torch is kept, any build
    ("2.11.0+cu130", True, "linux", None),
    ("2.11.0", False, "linux", None),
    ("2.10.0", False, "linux", CPU),                       # older than pyproject's minimum: replaced
])
def test_install_torch_picks_the_build_for_the_host(installed, nvidia_driver, platform, expected):
    assert install_torch.TORCH_VERSION == "2.13.0"
    assert install_torch.pip_arguments(installed, nvidia_driver, platform) == expected


def test_install_torch_keeps_the_installed_torch():
    # the wheel's metadata version, which the tool reads: PyPI's CUDA wheels carry no local tag
    # ("2.11.0", torch.__version__ "2.11.0+cu130"); the CPU index's do ("2.13.0+cpu")
    installed = importlib.metadata.version("torch")
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "install_torch.py")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"install_torch: torch {installed} is installed in {sys.prefix}: kept\n"


def test_install_torch_says_what_it_tried_and_how_to_install_torch_when_pip_fails(monkeypatch, capsys):
    """No CPU index reachable and no local wheel: pip's 'No matching distribution' was the last line."""
    monkeypatch.setattr(install_torch, "installed_torch", lambda: None)
    monkeypatch.setattr(install_torch, "nvidia_driver", lambda: False)
    monkeypatch.setattr(install_torch.sys, "platform", "linux")
    tried = []
    monkeypatch.setattr(install_torch.subprocess, "call", lambda command: tried.append(command) or 1)
    assert install_torch.main() == 1
    assert tried == [[sys.executable, "-m", "pip", "install", *CPU]]
    err = capsys.readouterr().err
    assert "could not install torch 2.13.0 (CPU build) from https://download.pytorch.org/whl/cpu" in err
    assert "Install torch 2.11 or newer yourself" in err and "keeps an installed torch" in err
    assert "https://pytorch.org/get-started/locally/" in err and "--find-links DIR torch==2.13.0" in err
