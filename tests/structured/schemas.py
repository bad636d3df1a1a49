"""Thirty JSON schemas for the structured-output suite: nested objects, arrays with
bounds, enums, const, anyOf/oneOf, $ref with $defs, patterns, formats, required and
optional properties. Strings and arrays are bounded so that every output ends."""

S = {"type": "string", "maxLength": 16}
I = {"type": "integer", "minimum": 0, "maximum": 1000}


def obj(props, required=None, extra=False):
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": extra}


SCHEMAS = [
    obj({"name": S}),
    obj({"name": S, "age": I}),
    obj({"title": S, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}, "rating": {"type": "number", "minimum": 0, "maximum": 10}}),
    obj({"ok": {"type": "boolean"}, "note": S}, required=["ok"]),
    obj({"color": {"enum": ["red", "green", "blue"]}, "shade": {"enum": [1, 2, 3]}}),
    obj({"kind": {"const": "point"}, "x": I, "y": I}),
    obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": I, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}}),
    obj({"user": obj({"id": I, "name": S}), "active": {"type": "boolean"}}),
    obj({"a": obj({"b": obj({"c": obj({"d": S})})})}),
    obj({"items": {"type": "array", "items": obj({"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}), "minItems": 1, "maxItems": 3}}),
    obj({"value": {"anyOf": [I, S]}}),
    obj({"shape": {"oneOf": [obj({"circle": I}), obj({"square": I})]}}),
    {"$defs": {"person": obj({"name": S, "age": I})}, **obj({"author": {"$ref": "#/$defs/person"}, "editor": {"$ref": "#/$defs/person"}})},
    {"$defs": {"node": obj({"label": S, "weight": I})}, **obj({"nodes": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}})},
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
    obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "city": S}),
    obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    obj({"when": {"type": "string", "format": "date"}}),
    obj({"id": {"type": "string", "format": "uuid"}}),
    obj({"email": {"type": "string", "format": "email", "maxLength": 40}}),
    obj({"name": S, "nickname": S, "age": I}, required=["name"]),
    obj({"temperature": {"type": "number", "minimum": -50, "maximum": 60}, "unit": {"enum": ["C", "F"]}}),
    {"type": "array", "items": I, "minItems": 2, "maxItems": 5},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 4},
    obj({"answer": {"type": "string", "enum": ["yes", "no", "maybe"]}, "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}),
    obj({"steps": {"type": "array", "items": obj({"n": I, "text": S}), "minItems": 2, "maxItems": 3}}),
    obj({"meta": obj({"version": {"type": "string", "pattern": "^[0-9]\\.[0-9]\\.[0-9]$"}, "stable": {"type": "boolean"}}), "count": I}),
    obj({"pair": {"type": "array", "prefixItems": [S, I], "items": False, "minItems": 2}}),
    obj({"nullable": {"anyOf": [S, {"type": "null"}]}, "flag": {"type": "boolean"}}),
]
assert len(SCHEMAS) == 30


# (request field, value, check of the whole output) for the other formats.
import re as _re

OTHER_FORMATS = [
    ("guided_regex", r"[A-Z][a-z]{2,8}", lambda t: _re.fullmatch(r"[A-Z][a-z]{2,8}", t)),
    ("guided_regex", r"[0-9]{3}-[0-9]{4}", lambda t: _re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ("guided_regex", r"(yes|no), because [a-z ]{5,30}\.", lambda t: _re.fullmatch(r"(yes|no), because [a-z ]{5,30}\.", t)),
    ("guided_regex", r"#[0-9a-f]{6}", lambda t: _re.fullmatch(r"#[0-9a-f]{6}", t)),
    ("guided_choice", ["Paris", "Lyon", "Marseille"], lambda t: t in ("Paris", "Lyon", "Marseille")),
    ("guided_choice", ["positive", "negative", "neutral"], lambda t: t in ("positive", "negative", "neutral")),
    ("guided_grammar", 'start: NUMBER (" + " NUMBER){1,3}\nNUMBER: /[0-9]{1,3}/',
     lambda t: _re.fullmatch(r"[0-9]{1,3}( \+ [0-9]{1,3}){1,3}", t)),
    ("guided_grammar", 'start: "(" item ("," item)* ")"\nitem: /[a-z]{1,6}/',
     lambda t: _re.fullmatch(r"\([a-z]{1,6}(,[a-z]{1,6})*\)", t)),
]


# Schemas for `strict: true` as clients write them: no `additionalProperties`,
# integers and numbers without bounds, nested objects and arrays. Strict semantics
# must close every object and bound every number so that each answer ends,
# validates, and has no key the schema does not declare. (Strings keep a
# `maxLength`: strict semantics do not bound them, and a 135M model can fill an
# unbounded string until `max_tokens`.)
def sobj(props, required=None):
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


STR, INT, NUM, BOOL = {"type": "string", "maxLength": 24}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}

STRICT_SCHEMAS = [
    sobj({"name": STR}),
    sobj({"count": INT}),
    sobj({"price": NUM}),
    sobj({"name": STR, "age": INT}),
    sobj({"x": NUM, "y": NUM}),
    sobj({"id": INT, "score": NUM, "ok": BOOL}),
    sobj({"user": sobj({"name": STR, "id": INT})}),
    sobj({"a": sobj({"b": sobj({"c": INT})})}),
    sobj({"point": sobj({"lat": NUM, "lon": NUM}), "label": STR}),
    sobj({"values": {"type": "array", "items": INT, "maxItems": 4}}),
    sobj({"tags": {"type": "array", "items": STR, "minItems": 1, "maxItems": 3}}),
    sobj({"rows": {"type": "array", "items": sobj({"k": STR, "v": INT}), "maxItems": 2}}),
    sobj({"grid": {"type": "array", "items": {"type": "array", "items": NUM, "maxItems": 2}, "maxItems": 2}}),
    sobj({"title": STR, "year": INT, "rating": NUM}),
    sobj({"color": {"enum": ["red", "green", "blue"]}, "weight": NUM}),
    sobj({"kind": {"const": "circle"}, "radius": NUM}),
    sobj({"name": STR, "nickname": STR, "age": INT}, required=["name"]),
    sobj({"value": {"anyOf": [INT, STR]}}),
    sobj({"maybe": {"anyOf": [NUM, {"type": "null"}]}, "flag": BOOL}),
    {"$defs": {"person": sobj({"name": STR, "age": INT})}, **sobj({"owner": {"$ref": "#/$defs/person"}})},
    sobj({"order": sobj({"id": INT, "items": {"type": "array", "items": sobj({"sku": STR, "qty": INT}), "maxItems": 2},
                         "total": NUM})}),
    sobj({"meta": {"type": "object"}, "n": INT}),
    {"type": "array", "items": sobj({"n": INT}), "maxItems": 3},
    sobj({"temperature": NUM, "unit": {"enum": ["C", "F"]}, "readings": {"type": "array", "items": NUM, "maxItems": 3}}),
]
assert len(STRICT_SCHEMAS) >= 20

# Tools for the forced calls (`tool_choice` required and named) on the same model.
STRICT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
     "parameters": sobj({"city": STR, "days": INT})}},
    {"type": "function", "function": {"name": "convert", "description": "Convert an amount of money",
     "parameters": sobj({"amount": NUM, "currency": STR, "to": {"type": "object", "properties": {"currency": STR}}})}},
]
