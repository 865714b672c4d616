"""What a reply must look like: a JSON Schema, any JSON object, a regex or a grammar (OpenAI's ``response_format``).

`ResponseFormat` is the validated value of ``SamplingProfile.response_format``, in OpenAI's shapes plus two of its
own::

    {"type": "json_object"}
    {"type": "json_schema", "json_schema": {"name": "person", "schema": {...}, "strict": true}}
    {"type": "regex", "regex": "\\d{3}-\\d{4}"}
    {"type": "grammar", "grammar": "start: ..."}        # Lark, or GBNF (llguidance converts it)

``{"type": "text"}`` means no constraint and validates to ``None`` in the profile. Each format becomes one
llguidance grammar (`ResponseFormat.grammar`), compiled and checked here once, at the edge, so an invalid schema,
an unsupported keyword or a grammar that does not compile fails as one line naming the field
(``response_format.json_schema.schema: ...``), never at the first token. The sampler's stage that enforces it is
`core.sampling.constraint.Constraint`. Nothing here imports MLX.

JSON is generated compactly (``{"a": 1, "b": [2, 3]}``: one space after ``:`` and ``,``, no other whitespace):
flexible whitespace lets a small model spend its whole budget on newlines inside a valid but unfinished object.

**A schema holds the reply to what it says** (`closed`): an object schema with ``properties`` and no
``additionalProperties`` is read as ``"additionalProperties": false`` (as llama.cpp's schema converter reads it), so
the object's keys are its properties, each at most once, in the schema's order; a bare ``{"type": "object"}`` stays
any object. Left open, a small model fills an object with keys the schema never named and repeats them until its
token budget runs out. A keyword the constraint cannot enforce (``not``, ``uniqueItems``, ...) is an error naming
it, ``strict`` or not: a reply that only looks constrained is worse than a refusal.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Literal

import jsonschema
from llguidance import LLMatcher, grammar_from
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

# llguidance's JSON compile options (docs: llguidance/docs/json_schema.md): compact, one canonical spacing.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FormatType = Literal["json_object", "json_schema", "regex", "grammar"]


class JsonSchemaSpec(BaseModel):
    """OpenAI's ``response_format.json_schema`` object."""

    # "schema" is BaseModel's own (deprecated) method's name, hence the alias, written back as "schema".
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, serialize_by_alias=True)

    name: str = Field("schema", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """One validated response format; see the module docstring."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: FormatType
    json_schema: JsonSchemaSpec | None = None
    regex: str | None = None
    grammar: str | None = None
    # What the chain prints for a regex or grammar (e.g. the server's tool calls: "Grammar(tool calls: f, g)").
    name: str | None = Field(None, min_length=1, max_length=64)

    @model_validator(mode="after")
    def _compiles(self) -> "ResponseFormat":
        wanted = {"json_schema": "json_schema", "regex": "regex", "grammar": "grammar"}.get(self.type)
        for name in ("json_schema", "regex", "grammar"):
            given = getattr(self, name) is not None
            if given != (name == wanted):
                need = "is required" if not given else "is not allowed"
                raise PydanticCustomError("bad_format", "response_format.{name} {need} when type is '{type}'",
                                          {"name": name, "need": need, "type": self.type})
        if self.json_schema is not None:
            _check_schema(self.json_schema.schema_)
        error = _validate(self.llg_grammar())
        if error:
            raise PydanticCustomError("bad_format", "{field}: {error}",
                                      {"field": self.field_name(), "error": explain(error)})
        return self

    def field_name(self) -> str:
        """The request field that holds what compiles: where an error points."""
        return {"json_object": "response_format", "json_schema": "response_format.json_schema.schema",
                "regex": "response_format.regex", "grammar": "response_format.grammar"}[self.type]

    def llg_grammar(self) -> str:
        """The llguidance grammar (its JSON text) that accepts exactly this format's replies."""
        if self.type == "regex":
            return grammar_from("regex", self.regex)
        if self.type == "grammar":
            return grammar_from("grammar", self.grammar)
        schema = closed(self.json_schema.schema_) if self.json_schema is not None else {"type": "object"}
        return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={**_JSON_OPTIONS, "lenient": False})

    def label(self) -> str:
        """How the sampler chain prints this stage: ``JsonSchema(person)``, ``JsonObject``, ``Regex(...)``,
        ``Grammar(...)``."""
        if self.type == "json_schema":
            return f"JsonSchema({self.json_schema.name})"
        if self.type == "json_object":
            return "JsonObject"
        text = self.name or (self.regex if self.type == "regex" else self.grammar.strip().splitlines()[0])
        short = text if len(text) <= 24 else text[:23] + "…"
        return f"{'Regex' if self.type == 'regex' else 'Grammar'}({short})"


def parse_response_format(value: Any) -> ResponseFormat | None:
    """A profile's ``response_format`` from OpenAI's dict (or a `ResponseFormat`); ``{"type": "text"}`` is None."""
    if isinstance(value, dict) and value.get("type") == "text":
        if len(value) > 1:
            raise PydanticCustomError("bad_format", "response_format of type 'text' takes no other field, got {keys}",
                                      {"keys": ", ".join(sorted(set(value) - {"type"}))})
        return None
    return value


def _check_schema(schema: dict[str, Any]) -> None:
    """The schema must be a valid JSON Schema itself (its own metaschema), e.g. ``"type": "strin"`` is refused."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
        raise PydanticCustomError("bad_schema", "response_format.json_schema.schema{where}: {error}",
                                  {"where": where, "error": _one_line(e.message)}) from None


@functools.lru_cache(maxsize=256)
def _validate(grammar: str) -> str:
    """llguidance's verdict on a grammar ('' when it compiles); cached, since the server validates every request."""
    return LLMatcher.validate_grammar(grammar)


# The JSON Schema keywords whose value is a schema, a list of schemas, or a map of names to schemas (`closed` walks
# them).
_SCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
           "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: Any, in_all_of: bool = False) -> Any:
    """`schema` with every object schema that lists ``properties`` but says nothing of ``additionalProperties``
    closed (``"additionalProperties": false``); see the module docstring. A branch of ``allOf`` stays open: closing
    each branch would forbid the properties the other branches add."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA:
        if key in out:
            out[key] = closed(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(s, key == "allOf") for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if ("properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out
            and not in_all_of):
        out["additionalProperties"] = False
    return out


def explain(error: str) -> str:
    """llguidance's verdict in one line; its "Unimplemented keys" says which keywords and what to do."""
    if (m := re.search(r"Unimplemented keys: \[([^\]]*)\]", error)) is not None:
        keys = ", ".join(k.strip().strip('"') for k in m.group(1).split(","))
        return f"the constraint cannot enforce the JSON Schema keyword(s) {keys}: remove them from the schema"
    return _one_line(error)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


__all__ = ["FormatType", "JsonSchemaSpec", "ResponseFormat", "closed", "explain", "parse_response_format"]
