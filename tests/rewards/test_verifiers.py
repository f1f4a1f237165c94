"""The built-in verifiers on hand-picked answers: what each one counts right, and wrong."""
from __future__ import annotations

import pytest

from elasticrl.rewards.verifiers import exact, integer, json_schema, last_integer, regex
from elasticrl.spec import load_spec


def test_exact_compares_the_stripped_texts_and_nothing_else():
    assert exact("q", "  Paris\n", "Paris") == 1.0
    assert exact("q", "paris", "Paris") == 0.0          # case matters
    assert exact("q", "Paris.", "Paris") == 0.0         # so does punctuation
    assert exact("q", "12", 12) == 1.0                  # a numeric answer is compared as its text
    assert exact("q", "12", None) == 0.0                # no reference: never right


def test_regex_searches_the_answer_pattern_anywhere_in_the_completion():
    assert regex("q", "the answer is 42.", r"\b42\b") == 1.0
    assert regex("q", "the answer is 420", r"\b42\b") == 0.0
    assert regex("q", "FOO", "(?i)foo") == 1.0          # flags in the pattern work
    assert regex("q", "anything", None) == 0.0


SCHEMA = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'


@pytest.mark.parametrize("completion, right", [
    ('{"n": 3}', 1.0),
    ('{"n": 3, "extra": true}', 1.0),      # the schema allows more properties
    ('{"n": "3"}', 0.0),                   # the wrong type
    ('{"m": 3}', 0.0),                     # the required key missing
    ("n = 3", 0.0),                        # not JSON at all
])
def test_json_schema_validates_the_completion_against_the_answer(completion, right):
    assert json_schema("q", completion, SCHEMA) == right
    assert json_schema("q", completion, None) == 0.0


def test_integer_takes_the_first_integer_of_the_completion():
    assert integer("17+5=", "22", "22") == 1.0 and integer("17+5=", "22 or 23", "22") == 1.0
    assert integer("17+5=", "23 not 22", "22") == 0.0


def test_last_integer_takes_the_chain_s_last_number():
    chain = "980+13=993\n993+13=1006"
    assert last_integer("980+13...>999=", chain, "1006") == 1.0 and last_integer("q", chain, 1006) == 1.0
    assert last_integer("q", chain + "\n1006+13=1019", "1006") == 0.0   # counted past the answer
    assert last_integer("q", "980+13=993", "1006") == 0.0                # stopped short
    assert last_integer("q", "no number", "1006") == 0.0 and last_integer("q", chain, None) == 0.0
    # the reasoning world's jobs judge by it unless told otherwise
    assert load_spec({"world": {"task": "reasoning"}}, check_paths=False).rewards.verifier == "last_integer"
    assert load_spec({"world": {"task": "reasoning"}, "rewards": {"verifier": "exact"}},
                     check_paths=False).rewards.verifier == "exact"
