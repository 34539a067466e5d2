"""The shared argument checks: an int (never a bool) of at least a minimum, or a number."""

from __future__ import annotations

import pytest

from phalanx.utilities.checks import check_int_at_least, is_int, is_int_at_least, is_number


@pytest.mark.parametrize(
    ("value", "minimum", "expected"),
    [
        (0, 0, True),
        (5, 1, True),
        (-1, -1, True),
        (0, 1, False),
        (-2, -1, False),
        (True, 0, False),
        (False, 0, False),
        (1.0, 0, False),
        ("3", 0, False),
        (None, 0, False),
    ],
)
def test_is_int_at_least(value: object, minimum: int, expected: bool) -> None:
    assert is_int_at_least(value, minimum) is expected
    assert is_int(value) is (isinstance(value, int) and not isinstance(value, bool))


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1, True), (0.5, True), (float("inf"), True), (True, False), (None, False), ("1", False), (1j, False)],
)
def test_is_number(value: object, expected: bool) -> None:
    assert is_number(value) is expected


@pytest.mark.parametrize("value", [0, -3, True, 2.0, "2"])
def test_check_int_at_least_names_the_argument(value: object) -> None:
    with pytest.raises(ValueError, match=r"^processes=.* must be an int >= 1 \(one or more\)\.$"):
        check_int_at_least("processes", value, 1, " (one or more)")
    assert check_int_at_least("processes", 3, 1) == 3
