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


def test_a_process_crash_says_one_line_and_keeps_the_process_output_for_a_traceback():
    from batchrl.errors import NOTE_CHARS, ProcessCrash

    crash = ProcessCrash(
        process="update rank 1", signal_name="SIGABRT", details="x" * NOTE_CHARS + "free(): invalid size"
    )
    assert str(crash) == "update rank 1 died of SIGABRT"
    assert crash.one_line().startswith("update rank 1 died of SIGABRT")
    (note,) = crash.__notes__
    assert note.startswith("the last output of update rank 1:") and note.endswith("free(): invalid size")
    assert len(note) < NOTE_CHARS + 100  # the tail, not the whole output
    assert not hasattr(ProcessCrash(process="p", signal_name="SIGSEGV", details=""), "__notes__")
