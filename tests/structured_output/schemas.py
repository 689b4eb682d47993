"""Twenty JSON schemas of different shapes for guided-decoding tests: nested objects, arrays,
enums, bounded numbers, required fields, additionalProperties false, anyOf, $defs, patterns.

Strings and arrays are bounded so a 135M model at temperature 0.8 ends within the token limit
(the grammar guarantees the form, not that a sampler ever closes an unbounded string)."""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 12}

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat_required": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
    "enum_only": {"type": "string", "enum": ["red", "green", "blue"]},
    "bounded_number": {
        "type": "object",
        "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 50},
                       "unit": {"enum": ["C", "F"]}},
        "required": ["temperature", "unit"], "additionalProperties": False},
    "int_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                  "minItems": 1, "maxItems": 5},
    "nested_address": {
        "type": "object",
        "properties": {
            "person": {"type": "object", "properties": {"name": NAME, "email": {
                "type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"}},
                "required": ["name", "email"], "additionalProperties": False},
            "address": {"type": "object", "properties": {"city": NAME, "zip": {
                "type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["person", "address"], "additionalProperties": False},
    "array_of_objects": {
        "type": "array", "maxItems": 3, "minItems": 1,
        "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                           "maximum": 999},
                                                    "done": {"type": "boolean"}},
                  "required": ["id", "done"], "additionalProperties": False}},
    "optional_fields": {
        "type": "object",
        "properties": {"title": NAME, "subtitle": NAME,
                       "pages": {"type": "integer", "minimum": 1, "maximum": 2000}},
        "required": ["title"], "additionalProperties": False},
    "boolean_flags": {
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"},
                       "c": {"type": "null"}},
        "required": ["a", "b", "c"], "additionalProperties": False},
    "enum_mixed": {
        "type": "object",
        "properties": {"level": {"enum": [1, 2, 3, "max"]}, "ok": {"const": True}},
        "required": ["level", "ok"], "additionalProperties": False},
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                           {"type": "string", "maxLength": 8}]}},
        "required": ["value"], "additionalProperties": False},
    "defs_ref": {
        "$defs": {"point": {"type": "object",
                            "properties": {"x": {"type": "integer", "minimum": -9,
                                                 "maximum": 9},
                                           "y": {"type": "integer", "minimum": -9,
                                                 "maximum": 9}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False},
    "string_pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "deep_nesting": {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {
            "type": "object", "properties": {"c": {"type": "object", "properties": {
                "d": {"type": "integer", "minimum": 0, "maximum": 5}},
                "required": ["d"], "additionalProperties": False}},
            "required": ["c"], "additionalProperties": False}},
            "required": ["b"], "additionalProperties": False}},
        "required": ["a"], "additionalProperties": False},
    "string_array_unique_len": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["x", "y", "z"]},
                                "minItems": 2, "maxItems": 4}},
        "required": ["tags"], "additionalProperties": False},
    "number_exclusive": {
        "type": "object",
        "properties": {"p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                       "n": {"type": "integer", "minimum": 10, "maximum": 20}},
        "required": ["p", "n"], "additionalProperties": False},
    "tuple_prefix_items": {
        "type": "array",
        "prefixItems": [{"type": "string", "maxLength": 6}, {"type": "integer", "minimum": 0,
                                                             "maximum": 100},
                        {"type": "boolean"}],
        "items": False},
    "recipe": {
        "type": "object",
        "properties": {"dish": NAME, "servings": {"type": "integer", "minimum": 1, "maximum": 8},
                       "ingredients": {"type": "array", "minItems": 1, "maxItems": 3,
                                       "items": {"type": "object",
                                                 "properties": {"item": NAME,
                                                                "grams": {"type": "integer",
                                                                          "minimum": 1,
                                                                          "maximum": 500}},
                                                 "required": ["item", "grams"],
                                                 "additionalProperties": False}},
                       "vegan": {"type": "boolean"}},
        "required": ["dish", "servings", "ingredients", "vegan"],
        "additionalProperties": False},
    "weather_call": {
        "type": "object",
        "properties": {"location": NAME, "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 7},
                       "units": {"enum": ["metric", "imperial"]}},
        "required": ["location", "days", "units"], "additionalProperties": False},
    "nullable": {
        "type": "object",
        "properties": {"middle_name": {"type": ["string", "null"], "maxLength": 8},
                       "score": {"type": ["number", "null"], "minimum": 0, "maximum": 10}},
        "required": ["middle_name", "score"], "additionalProperties": False},
    "matrix": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "integer", "minimum": -5, "maximum": 5}}},
}

assert len(SCHEMAS) == 20
# The default (fast) run's subset.
FAST = ["flat_required", "nested_address", "array_of_objects", "enum_mixed"]
