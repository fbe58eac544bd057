"""Reading an experiment file: bounded in size, strict YAML, then the schema.

Nothing else in the harness reads experiment YAML. Every failure is an
``ExperimentError`` naming the file and the field, raised before anything is written.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from harness.experiment.checks import check_semantics
from harness.experiment.schema import Experiment, ExperimentError, SearchSpace

#: An experiment is a few KB; anything far larger is a mistake (or an attack on the
#: YAML parser's memory), refused before it is parsed.
MAX_BYTES = 256 * 1024

#: Pydantic's names for the members of a union (``int | "auto"``), not field names.
_UNION_TAG = re.compile(r"^(constrained-\w+|literal\[.*\]|int|float|str|bool)$")


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping (YAML itself
    lets the last one win, silently) and any explicit tag: an experiment file is plain
    data, and the safe loader's own tags (``!!binary``, ``!!set``, ``!!timestamp``)
    made values no field expects."""

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()
        tag = getattr(event, "tag", None)
        if tag is not None:
            shown = tag.replace("tag:yaml.org,2002:", "!!")
            raise yaml.composer.ComposerError(
                None, None, f"the tag {shown!r}: an experiment file is plain data, "
                "without tags", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # '<<' merges may be overridden by the mapping's own keys
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:
                continue  # unhashable: the base class says so, with its line
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"the key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 reads ``1e-3`` (no '.') as a string, which a strict float field refuses:
# read as YAML 1.2 and everyone else does, a float.
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, str) and _UNION_TAG.match(part):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _read(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ExperimentError(path, "", f"cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_BYTES:
        raise ExperimentError(path, "", f"larger than {MAX_BYTES // 1024} KB: an experiment "
                              "file is a few KB (is this the right file?)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ExperimentError(path, "", f"not UTF-8 text (byte {exc.start})") from None


def parse(path: Path, text: str) -> Any:
    """The YAML document of ``text``; ExperimentError on bad YAML or a repeated key."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or exc
        raise ExperimentError(path, where, f"not valid YAML: {problem}") from None
    except RecursionError:
        raise ExperimentError(path, "", "not valid YAML: nested too deeply") from None


def _validate(path: Path, model: type[BaseModel], data: Any, prefix: tuple = ()) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ExperimentError(path, _loc(prefix + tuple(err["loc"])), err["msg"]) from None
    except RecursionError:
        raise ExperimentError(path, _loc(prefix), "nested too deeply") from None


def load(path: str | Path, overrides: Sequence[str] = (), semantics: bool = True) -> Experiment:
    """Read and validate an experiment file; raise ExperimentError on any problem.

    ``overrides`` are ``dotted.key=value`` strings (the CLI's ``--set``) applied over the
    file before validation; values are YAML (``--set search.trials=50``,
    ``--set "hardware=[H100]"``). ``semantics=False`` checks the file's form only; the
    checks that import the kernel family (seconds: torch) are then ``check_semantics``."""
    path = Path(path)
    data = parse(path, _read(path))
    if not isinstance(data, dict):
        raise ExperimentError(path, "", "must be a mapping of fields")
    for item in overrides:
        _override(path, data, item)
    if data.get("search_space") is not None:
        _validate(path, SearchSpace, data["search_space"], ("search_space",))
    exp = _validate(path, Experiment, data)
    if semantics:
        check_semantics(path, exp)
    return exp


def _override(path: Path, data: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ExperimentError(path, f"--set {item}", "expected KEY=VALUE, e.g. search.trials=50")
    try:
        value = yaml.load(raw, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader)
    except (yaml.YAMLError, RecursionError):
        raise ExperimentError(path, key, f"--set value {raw!r} is not valid YAML") from None
    node = data
    *parents, leaf = key.strip().split(".")
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ExperimentError(path, ".".join(parents[:i + 1]),
                                  f"--set {key}: this field is not a section")
        node = child
    node[leaf] = value
