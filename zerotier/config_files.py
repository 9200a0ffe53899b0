"""Config files: reading .toml, .json, .yaml / .yml into plain dicts (`read`), and writing the TOML
that `zerotier convert` prints (`to_toml`). A bad file is a ConfigError naming the file, never a traceback.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

from .errors import ConfigError


def read(path: Path) -> Any:
    """The data of a .toml, .json, .yaml or .yml file: {} for an empty YAML file."""
    reader = _FILE_READERS.get(path.suffix.lower())
    if reader is None:
        raise ConfigError(
            f"{path}: unknown config file extension {path.suffix!r}; use .toml, .json, .yaml or .yml"
        )
    try:
        data = reader(path)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    return {} if data is None else data  # None: an empty YAML file


def _read_toml(path: Path) -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigError(f"{path}: reading TOML on Python 3.10 needs tomli: pip install tomli") from None
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except (ValueError, RecursionError) as exc:  # TOMLDecodeError is a ValueError
            raise _not_valid(path, "TOML", exc) from None


def _read_json(path: Path) -> Any:
    with open(path, "rb") as f:
        try:
            return json.load(f)
        except (ValueError, RecursionError) as exc:
            raise _not_valid(path, "JSON", exc) from None


def _read_yaml(path: Path) -> Any:
    try:
        import yaml
    except ImportError:
        raise ConfigError(
            f"{path}: reading YAML needs PyYAML: pip install pyyaml (or use a .toml or .json file)"
        ) from None
    with open(path, "rb") as f:
        try:
            return yaml.safe_load(f)
        except (yaml.YAMLError, ValueError, RecursionError) as exc:  # ValueError: a bad date, a 5000-digit int
            raise _not_valid(path, "YAML", exc) from None


def _not_valid(path: Path, kind: str, exc: Exception) -> ConfigError:
    """Any parser error (bad syntax, not UTF-8, nested too deeply, a value the parser's own
    constructor refuses) as a ConfigError naming the file: a bad file is never a traceback."""
    if isinstance(exc, UnicodeDecodeError):
        why = f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); save it as UTF-8"
    elif isinstance(exc, RecursionError):
        why = "nested too deeply"
    else:
        why = str(exc)
    return ConfigError(f"{path}: not valid {kind}: {why}")


_FILE_READERS: dict[str, Callable[[Path], Any]] = {
    ".toml": _read_toml,
    ".json": _read_json,
    ".yaml": _read_yaml,
    ".yml": _read_yaml,
}


def to_toml(sections: Mapping[str, Mapping[str, Any]]) -> str:
    """TOML text of {section: {key: value}}, ending with a newline; tomllib reads back the same dict.

    Values: str, int, float, bool, lists of those, and dicts as sub-tables ([section.key]); None is
    left out. Written here rather than with tomli-w, which is not a dependency: zerotier only writes
    this small subset (tests/test_deepspeed_config.py round-trips it through tomllib)."""
    lines: list[str] = []
    _toml_table(lines, [], sections)
    return "\n".join(lines).strip("\n") + "\n"


def _toml_table(lines: list[str], path: list[str], table: Mapping[str, Any]) -> None:
    body = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()
            if v is not None and not isinstance(v, Mapping)]
    if body:  # a table with nothing to say is left out, as None values are
        lines += [f"[{'.'.join(map(_toml_key, path))}]"] * bool(path) + [*body, ""]
    for key, value in table.items():
        if isinstance(value, Mapping):
            _toml_table(lines, [*path, key], value)


def _toml_key(key: str) -> str:
    return key if key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key) else _toml_string(key)


def _toml_string(text: str) -> str:
    """A TOML basic string: quote, backslash and control characters escaped, the rest as is (UTF-8)."""
    escaped = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    return '"' + "".join(escaped.get(c) or (f"\\u{ord(c):04X}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                         for c in text) + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # TOML reads Python's float repr (1e-08, inf, nan) and int repr
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")
