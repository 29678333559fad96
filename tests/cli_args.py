"""Building CLI argument lists for the tests."""

from __future__ import annotations


def with_flags(base: list[str], flags: list[str]) -> list[str]:
    """`base` with each `--flag value` pair of `flags` replacing the flag's value, or appended."""
    argv = list(base)
    for flag, value in zip(flags[::2], flags[1::2]):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return argv
