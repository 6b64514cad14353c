"""``parse_json`` is ``json.loads``: the same value or the same error, for any text."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from agentloop._json import parse_json

_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
_space = st.sampled_from(["", " ", "\n", "\t ", "\r\n"])


def _outcome(parse: Any, text: str) -> tuple[str, Any]:
    try:
        value = parse(text)
    except Exception as exc:  # the error itself is what is compared
        return type(exc).__name__, str(exc)
    # NaN is not equal to itself: compare what json writes back instead.
    return "value", json.dumps(value, sort_keys=True)


@given(value=_values, before=_space, after=_space, tail=st.sampled_from(["", "x", ",1", "}"]))
def test_json_text_parses_as_json_loads_parses_it(
    value: Any, before: str, after: str, tail: str
) -> None:
    text = before + json.dumps(value) + after + tail
    assert _outcome(parse_json, text) == _outcome(json.loads, text)


@given(text=st.text(alphabet=st.sampled_from('{}[]":,0123456789.eE-+ntrufals \\\ufeffx'),
                    max_size=20))
def test_any_text_parses_or_fails_as_json_loads_does(text: str) -> None:
    assert _outcome(parse_json, text) == _outcome(json.loads, text)


def test_the_values_json_loads_gives_and_refuses() -> None:
    assert parse_json('{"a": 1, "b": [true, null]}') == {"a": 1, "b": [True, None]}
    assert math.isnan(parse_json("NaN"))
    assert _outcome(parse_json, "\ufeff{}") == _outcome(json.loads, "\ufeff{}")
    assert _outcome(parse_json, '{"a": 1} {"b": 2}')[0] == "JSONDecodeError"
