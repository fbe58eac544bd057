"""The pack schema, as pydantic models: what ``format.validate`` checks, and the source of
the published JSON Schema (``pack.schema.json``, which ``json_schema()`` regenerates).

A pack is JSON only: scalars, objects and strings of fixed forms; nothing in it is
evaluated. Validation is strict: ``"128"`` is not an integer, ``true`` is not a number.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    StringConstraints,
    ValidationError,
)

SCHEMA_VERSION = 1

Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]
DType = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_]+$")]
ShapeKey = Annotated[str, StringConstraints(
    pattern=r"^[A-Za-z_][A-Za-z0-9_]*=[0-9]+(,[A-Za-z_][A-Za-z0-9_]*=[0-9]+)*$")]
Param = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
FiniteFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Scalar = StrictBool | StrictInt | FiniteFloat | StrictStr


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class Provenance(_Model):
    """Where an entry was measured; other keys are kept as they are."""

    # A string where given (never null): the defaults only stand for "not recorded".
    triton: StrictStr = Field(default=None)  # type: ignore[assignment]
    torch: StrictStr = Field(default=None)  # type: ignore[assignment]
    device_name: StrictStr = Field(default=None)  # type: ignore[assignment]
    date: StrictStr = Field(default=None)  # type: ignore[assignment]
    # What the config computes in (``Kernel.precision``: ieee fp32, tf32x3, tf32, ...).
    precision: StrictStr = Field(default=None)  # type: ignore[assignment]


class Metrics(_Model):
    """What was measured: the latency (ms, the lookup's merge key) and other scalars."""

    __pydantic_extra__: dict[str, Scalar | None] = Field(init=False)  # type: ignore[assignment]

    latency_ms: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None


class Entry(_Model):
    """One frozen winner: its config, what was measured, and where."""

    config: dict[Param, Scalar] = Field(min_length=1, description=(
        "Triton meta-parameters (UPPER_CASE) plus launch options (num_warps, num_stages, ...)"))
    metrics: Metrics
    provenance: Provenance


class Pack(_Model):
    """One file per (hardware, kernel) at ``<packs>/<hardware>/<kernel>.json``: kernels ->
    dtype -> shape key -> entry. ``checksum`` is 'sha256:' + the hex SHA-256 of the
    canonical JSON of every other top-level field (sorted keys, no whitespace, separators
    ',' and ':')."""

    model_config = ConfigDict(strict=True, extra="allow",
                              title="kernel-harness config pack (schema_version 1)")

    schema_version: Literal[1]
    hardware: Name = Field(description="hardware key: H100, H200, A100, V710, cpu, ...")
    kernel: Name = Field(description="the kernel family's name; also the file name")
    kernels: dict[Name, dict[DType, dict[ShapeKey, Entry]]]
    checksum: Annotated[str, StringConstraints(pattern=r"^sha256:[0-9a-f]{64}$")]


#: Pydantic's names for the members of a union, not keys of the pack.
_UNION_TAG = re.compile(r"^(bool|int|float|str|none|constrained-\w+|function-\w+\[.*\])$")


def _where(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and _UNION_TAG.match(p)))


def _show(value: Any) -> str:
    try:
        return json.dumps(value, allow_nan=True)[:60]
    except (TypeError, ValueError):
        return repr(value)[:60]


def error(data: Any) -> str | None:
    """Why ``data`` does not follow the schema (None if it does). Checksum aside."""
    if not isinstance(data, dict):
        return "not a JSON object"
    if data.get("schema_version") != SCHEMA_VERSION:
        return f"schema_version {data.get('schema_version')!r} is not {SCHEMA_VERSION}"
    try:
        Pack.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        where = _where(loc) or "pack"
        if len(_where(loc)) != len(".".join(map(str, loc))):  # a scalar of no allowed type
            return f"{where}: {_show(err.get('input'))} is not a finite number, a string or " \
                   "a boolean"
        return f"{where}: {err['msg']}"
    return None


def _key_patterns(node: Any) -> Any:
    """Pydantic writes a dict with constrained keys as ``patternProperties``, which lets
    other keys through; as ``propertyNames`` + ``additionalProperties`` a JSON Schema
    validator refuses them, as the models do."""
    if isinstance(node, list):
        return [_key_patterns(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _key_patterns(v) for k, v in node.items()}
    patterns = out.get("patternProperties")
    if isinstance(patterns, dict) and len(patterns) == 1:
        (pattern, value), = patterns.items()
        del out["patternProperties"]
        out["propertyNames"] = {"pattern": pattern}
        out["additionalProperties"] = value
    return out


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a pack, from the models."""
    schema = _key_patterns(Pack.model_json_schema())
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": "urn:kernel-harness:pack:1", **schema}
