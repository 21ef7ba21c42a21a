"""``--config FILE.toml``: one table per config section, read into flat field values.

``[downpour]`` / ``n_fetch = 2`` sets :attr:`TrainConfig.n_fetch`; each key must sit in its
field's section (:data:`distbelief.config.SECTIONS`) and have its field's type. Flags given
on the command line override the file (:mod:`distbelief.cli`). Write one with
:func:`to_toml`.
"""

from __future__ import annotations

import json
import os
import tomllib
import typing

from distbelief.config import FIELDS, SECTIONS, TrainConfig, field_type
from distbelief.errors import UserError


def load_toml(path: str | os.PathLike) -> dict[str, typing.Any]:
    """The flat field values a ``--config`` TOML file sets (one table per section).

    Any problem (missing file, malformed TOML, unknown section or key, wrong type) is a
    one-line :class:`UserError` naming it and the fix.
    """
    where = f"--config {os.fspath(path)}"
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except FileNotFoundError:
        raise UserError(f"{where}: no such file: check the path") from None
    except OSError as err:
        raise UserError(f"{where}: cannot read it ({err.strerror or err}): check the path"
                        ) from None
    except UnicodeDecodeError:
        raise UserError(f"{where} is not UTF-8 text: pass a TOML file") from None
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"{where} is not valid TOML ({err}): fix that line") from None
    return from_sections(doc, where)


def from_sections(doc: dict[str, typing.Any], where: str = "config") -> dict[str, typing.Any]:
    """Flat field values from ``{section: {field: value}}``, each checked against its field."""
    tables = ", ".join(f"[{s}]" for s in SECTIONS)
    values: dict[str, typing.Any] = {}
    for section, table in doc.items():
        if section in FIELDS and not isinstance(table, dict):
            raise UserError(f"{where}: {section} is outside any section: write it under "
                            f"[{FIELDS[section].metadata['section']}]")
        if section not in SECTIONS:
            raise UserError(f"{where}: unknown section [{section}]: use {tables}")
        if not isinstance(table, dict):
            raise UserError(f"{where}: {section} must be a table: write [{section}] and its "
                            "options below it")
        for name, value in table.items():
            if name not in FIELDS:
                known = ", ".join(k for k, f in FIELDS.items()
                                  if f.metadata["section"] == section)
                raise UserError(f"{where}: [{section}] has no option {name!r}: choose from "
                                f"{known}")
            home = FIELDS[name].metadata["section"]
            if home != section:
                raise UserError(f"{where}: {name} belongs in [{home}], not [{section}]: "
                                "move it there")
            values[name] = _typed(name, value, f"{where}: [{section}] {name}")
    return values


def _typed(name: str, value: typing.Any, where: str) -> typing.Any:
    """``value`` as field ``name``'s type, or a one-line :class:`UserError` at ``where``."""
    kind = field_type(name)
    if kind is dict and FIELDS[name].metadata.get("sep") == "=":  # optimizer_args
        if isinstance(value, dict) and all(_is(v, float) or _is(v, bool) or isinstance(v, str)
                                           or isinstance(v, list) for v in value.values()):
            return dict(value)
        raise UserError(f"{where} must be a table of name = value, e.g. {name} = "
                        "{ weight_decay = 0.01, betas = [0.9, 0.99] }")
    if kind is dict:  # slow_replicas: { 0 = 4.0 }, keys are replica indices
        if isinstance(value, dict) and all(k.isdigit() and _is(v, float) for k, v in
                                           value.items()):
            return {int(k): float(v) for k, v in value.items()}
        raise UserError(f"{where} must be a table of index = factor, e.g. {name} = "
                        "{ 0 = 4.0 }")
    if kind is list:  # model_args: ["hidden=32", ...]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise UserError(f"{where} must be a list of strings, e.g. {name} = [\"hidden=32\"]")
    if not _is(value, kind):
        default = FIELDS[name].metadata.get("auto", FIELDS[name].default)
        example = default if default is not None else EXAMPLES[kind]
        raise UserError(f"{where} = {toml_value(value)} must be {KINDS[kind]}, e.g. "
                        f"{name} = {toml_value(example)}")
    return float(value) if kind is float else value


KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
EXAMPLES = {bool: True, int: 2, float: 0.5, str: "TEXT"}


def _is(value: typing.Any, kind: type) -> bool:
    """Whether TOML ``value`` fits a field of type ``kind`` (an integer fits a float field)."""
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, kind) or (kind is float and isinstance(value, int))


def sections(cfg: TrainConfig) -> dict[str, dict]:
    """``cfg``'s fields by section, as a ``--config`` file holds them (``None`` left out)."""
    out: dict[str, dict] = {name: {} for name in SECTIONS}
    for name, value in cfg.to_dict().items():
        if value is not None:
            out[FIELDS[name].metadata["section"]][name] = value
    return out


def to_toml(cfg: TrainConfig) -> str:
    """``cfg`` as a TOML file that ``distbelief train --config FILE`` reads back."""
    blocks = []
    for section, values in sections(cfg).items():
        lines = [f"{name} = {toml_value(value)}" for name, value in values.items()]
        blocks.append("\n".join([f"[{section}]", *lines]))
    return "\n\n".join(blocks) + "\n"


def toml_value(value: typing.Any) -> str:
    """A TOML literal of a config value (str, bool, int, float, or a flat dict of them)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{toml_value(str(k))} = {toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON's escapes are TOML's
    return repr(value)
