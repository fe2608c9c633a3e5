"""Where a configuration comes from: preset < TOML file < command line, typed and validated;
and back to TOML for the run folder."""

from __future__ import annotations

import ast
import copy
import difflib
import inspect
import sys
from dataclasses import fields
from importlib import resources
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


from onegpu.config.options import HF_FIXED_FIELDS, SECTIONS, Config, ConfigError
from onegpu.config.validation import validate

# ---------------------------------------------------------------------------- field metadata


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass, read from its source (they are not kept at runtime)."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def field_types(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def all_fields() -> list[tuple[str, str, Any, Any, str]]:
    """(section, name, type, default, doc) for every option, in declaration order."""
    out = []
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        defaults = cls()
        for name, typ in field_types(cls).items():
            out.append((section, name, typ, getattr(defaults, name), docs.get(name, "")))
    return out


def type_name(typ: Any) -> str:
    if get_origin(typ) is Literal:
        return "{" + ",".join(str(a) for a in get_args(typ)) + "}"
    if get_origin(typ) in (Union, UnionType):  # int | Literal["auto"]
        return "|".join(type_name(a).strip("{}") for a in get_args(typ))
    return getattr(typ, "__name__", str(typ))


# ---------------------------------------------------------------------------- value coercion


def _coerce(key: str, typ: Any, value: Any, from_cli: bool) -> Any:
    """Turn a TOML value, or a command-line string, into the field's type (or ConfigError)."""
    from_cli = from_cli and isinstance(value, str)
    if get_origin(typ) in (
        Union,
        UnionType,
    ):  # int | Literal["auto"]: a word of the Literal, else an int
        literal, number = sorted(get_args(typ), key=lambda a: get_origin(a) is not Literal)
        if value in get_args(literal):
            return value
        try:
            return _coerce(key, number, value, from_cli)
        except ConfigError:
            words = " or ".join(repr(w) for w in get_args(literal))
            raise ConfigError(key, f"expected an integer or {words}, got {value!r}") from None
    if get_origin(typ) is Literal:
        choices = get_args(typ)
        if value not in choices:
            hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(
                key, f"{value!r} is not one of {', '.join(map(repr, choices))}{extra}"
            )
        return value
    if typ is bool:
        if isinstance(value, bool):
            return value
        if from_cli and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(key, f"expected true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(key, f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if from_cli:
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(key, f"expected an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_cli:
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(key, f"expected a number, got {value!r}")
    if typ is str:
        if isinstance(value, str):
            return value
        raise ConfigError(key, f"expected a string, got {value!r}")
    raise TypeError(f"unsupported field type {typ!r} for {key}")  # a bug in this file


def _unknown(key: str, candidates: list[str]) -> ConfigError:
    hint = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    fix = f"did you mean {hint[0]}?" if hint else "see `onegpu train --help` for the options"
    return ConfigError(key, f"unknown option; {fix}")


def all_keys() -> list[str]:
    return [f"{s}.{n}" for s, n, *_ in all_fields()]


def apply_values(cfg: Config, values: dict[str, Any], origin: str = "") -> Config:
    """Set `section.field` keys on cfg (in place) with type checks; returns cfg.

    Without an origin (a file or preset) the values are command-line strings, converted to
    the field's type; values from TOML must already have the right type.
    """
    for key, value in values.items():
        section, _, name = key.partition(".")
        cls = SECTIONS.get(section)
        types = field_types(cls) if cls else {}
        if name not in types:
            err = _unknown(key, all_keys())
            if origin:
                err = ConfigError(key, f"{err.args[0].split(': ', 1)[1]} (in {origin})")
            raise err
        setattr(getattr(cfg, section), name, _coerce(key, types[name], value, from_cli=not origin))
    return cfg


def flatten_toml(doc: dict[str, Any], origin: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for section, table in doc.items():
        if section == "preset":
            continue
        if not isinstance(table, dict) and section in SECTIONS:
            raise ConfigError(section, f"expected a [{section}] table in {origin}")
        if not isinstance(table, dict):
            owner = next(
                (sec for sec, cls in SECTIONS.items() if section in {f.name for f in fields(cls)}),
                None,
            )
            fix = (
                f"put `{section} = ...` under [{owner}]"
                if owner
                else f"sections are {', '.join(SECTIONS)}"
            )
            raise ConfigError(section, f"a top-level setting in {origin}: {fix}")
        for name, value in table.items():
            flat[f"{section}.{name}"] = value
    return flat


# ---------------------------------------------------------------------------- presets and files


def preset_names() -> list[str]:
    root = resources.files("onegpu") / "presets"
    return sorted(p.name.removesuffix(".toml") for p in root.iterdir() if p.name.endswith(".toml"))


def load_toml(path: Path) -> dict[str, Any]:
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError("--config", f"file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError("--config", f"{path} is a folder; give a TOML file") from None
    except OSError as e:
        raise ConfigError("--config", f"{path} cannot be read ({e.strerror})") from None
    try:
        text = raw.decode("utf-8-sig")  # a UTF-8 byte-order mark is harmless: drop it
    except UnicodeDecodeError:
        raise ConfigError("--config", f"{path} is not UTF-8 text; save it as UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("--config", f"{path} is not valid TOML: {e}") from None


def preset_values(name: str) -> dict[str, Any]:
    if name not in preset_names():
        hint = difflib.get_close_matches(name, preset_names(), n=1)
        extra = f"did you mean {hint[0]!r}? " if hint else ""
        raise ConfigError(
            "--preset", f"unknown preset {name!r}; {extra}choose from {', '.join(preset_names())}"
        )
    text = (resources.files("onegpu") / "presets" / f"{name}.toml").read_text()
    return flatten_toml(tomllib.loads(text), f"preset {name}")


DEFAULT_PRESET = "small"


def load_config(
    preset: str | None = None,
    file: str | Path | None = None,
    overrides: dict[str, str] | None = None,
) -> Config:
    """Resolve preset < file < overrides into a validated Config.

    The preset is the one named on the command line, else a top-level `preset = "..."` of the
    file, else `small`.
    """
    cfg = Config()
    doc = load_toml(Path(file)) if file else {}
    if "preset" in doc and not isinstance(doc["preset"], str):
        raise ConfigError(
            "preset",
            f'must be a preset\'s name in quotes (e.g. preset = "small") '
            f"in {file}, got {doc['preset']!r}",
        )
    preset = preset or doc.get("preset") or DEFAULT_PRESET
    if preset:
        apply_values(cfg, preset_values(preset), f"preset {preset}")
    given = {}
    if file:
        given = flatten_toml(doc, str(file))
        apply_values(cfg, given, str(file))
    if overrides:
        apply_values(cfg, overrides)
        given = {**given, **overrides}
    check_hf_fields(cfg, given)
    validate(cfg)
    return cfg


def check_hf_fields(cfg: Config, given: dict[str, Any]) -> None:
    """With model.hf, the folder's config.json is the architecture: a [model] field it fixes,
    given in a file or on the command line, is refused (a preset's are simply replaced)."""
    if not cfg.model.hf:
        return
    for key in given:
        section, _, name = key.partition(".")
        if section == "model" and name in HF_FIXED_FIELDS:
            raise ConfigError(
                key,
                f"fixed by the config.json of model.hf={cfg.model.hf!r}; remove it (edit the "
                "folder's config.json to change the architecture)",
            )


def with_overrides(cfg: Config, values: dict[str, str]) -> Config:
    """A validated copy of cfg with `section.field` command-line strings applied (ConfigError
    if the result is not a valid configuration); cfg itself is untouched."""
    new = copy.deepcopy(cfg)
    apply_values(new, values)
    validate(new)
    return new


# ---------------------------------------------------------------------------- writing


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'


def to_toml(cfg: Config) -> str:
    """The config as a TOML file that loads back to it. With model.hf the fields its
    config.json fixes are left out (they come from the folder; giving them is refused)."""
    lines: list[str] = []
    for section, obj in cfg.sections().items():
        lines.append(f"[{section}]")
        for f in fields(obj):
            if section == "model" and cfg.model.hf and f.name in HF_FIXED_FIELDS:
                continue
            lines.append(f"{f.name} = {_toml_value(getattr(obj, f.name))}")
        lines.append("")
    return "\n".join(lines)
