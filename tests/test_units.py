import pytest

from basics.units import format_bytes, format_ms, parse_bytes
from simulator import InputError


@pytest.mark.parametrize(
    "text, expected",
    [
        ("56GB", 56_000_000_000),
        ("56000MB", 56_000_000_000),
        ("52GiB", 52 * 2**30),
        ("1.5 GiB", 3 * 2**29),
        ("512mib", 512 * 2**20),
        ("7B", 7),
        ("2TB", 2 * 10**12),
        ("0", 0),
        (".5KiB", 512),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text, "--memory") == expected


@pytest.mark.parametrize(
    "text, words",
    [("56", "expected a unit"), ("56 GQ", "unknown unit"), ("-1GB", "expected a size"), ("", "expected a size")],
)
def test_parse_bytes_refuses(text, words):
    with pytest.raises(InputError) as caught:
        parse_bytes(text, "--memory")
    assert caught.value.field == "--memory" and words in str(caught.value)


@pytest.mark.parametrize(
    "size, text", [(0, "0 B"), (1023, "1023 B"), (2**20, "1 MiB"), (1.5 * 2**30, "1.5 GiB"), (56e9, "52.2 GiB")]
)
def test_format_bytes(size, text):
    assert format_bytes(size) == text


@pytest.mark.parametrize(
    "milliseconds, text",
    [(27, "27"), (1525.31015, "1,525.31"), (99999.4, "99,999.4"), (1076938.2, "1,076,938"), (0.0004, "0.0004")],
)
def test_format_ms(milliseconds, text):
    assert format_ms(milliseconds) == text
