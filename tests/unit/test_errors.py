"""The phrases user errors name a wrong value's type with."""

from __future__ import annotations

import json

import pytest

from batchrl.errors import type_phrase


@pytest.mark.parametrize(
    ("value", "phrase"),
    [
        (42, "an integer"),
        (2.5, "a float"),
        (True, "a boolean"),
        ("x", "a string"),
        (None, "None"),
        ([1], "a list"),
        ({"a": 1}, "a dict"),
        (json, "a module"),
        (int, "a class"),
        (object(), "an object"),
    ],
)
def test_a_type_is_named_in_words_with_its_article(value, phrase):
    assert type_phrase(value) == phrase
