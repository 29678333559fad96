"""Reading YAML a user gives: depth judged as the data loads (a merge key adds no level), alias and merge
bombs refused before anything is built."""

from __future__ import annotations

import time

import pytest

from basics.documents import parse_yaml
from basics.errors import InputError

# each mapping merges the one before it and overrides `v`: b49 holds k0 ... k49 and v 49
CHAIN = "b0: &b0 {k0: 0, v: 0}\n" + "".join(f"b{n}: &b{n} {{<<: *b{n - 1}, k{n}: {n}, v: {n}}}\n" for n in range(1, 50))
BILLION_LAUGHS = "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcdefgh", "bcdefghi")
)
# each mapping merges the one before it twice: PyYAML's merge would copy 2**59 keys
MERGE_BOMB = "m0: &m0 {k: 1}\n" + "".join(
    f"m{n}: &m{n} {{<<: [*m{n - 1}, *m{n - 1}], k{n}: 1}}\n" for n in range(1, 60)
)


def refusal(text: str) -> str:
    with pytest.raises(InputError) as caught:
        parse_yaml(text, "--config", "train.yaml")
    return str(caught.value)


def test_a_fifty_deep_chain_of_merges_loads_as_yaml_says():
    data = parse_yaml(CHAIN, "--config", "train.yaml")
    assert data["b49"] == {**{f"k{n}": n for n in range(50)}, "v": 49}
    assert data["b10"] == {**{f"k{n}": n for n in range(11)}, "v": 10}
    assert data["b0"] == {"k0": 0, "v": 0}


def test_a_chain_of_merges_under_nested_sections_counts_only_the_sections():
    text = CHAIN + "model:\n  model_config:\n    <<: *b49\n    v: own\n"
    assert parse_yaml(text, "--config", "train.yaml")["model"]["model_config"] == {
        **{f"k{n}": n for n in range(50)},
        "v": "own",
    }


def test_merges_written_in_place_add_no_level():
    text = "top: " + "{<<: " * 50 + "{k: 1}" + ", v: 2}" * 50 + "\n"
    assert parse_yaml(text, "--config", "train.yaml") == {"top": {"k": 1, "v": 2}}


def test_a_merged_list_gives_the_first_mapping_s_keys_first():
    text = "a: &a {k: a, x: 1}\nb: &b {k: b, y: 2}\nc: {<<: [*a, *b], z: 3}\nd: {<<: [*a, *b], k: own}\n"
    data = parse_yaml(text, "--config", "train.yaml")
    assert data["c"] == {"k": "a", "x": 1, "y": 2, "z": 3} and data["d"] == {"k": "own", "x": 1, "y": 2}


@pytest.mark.parametrize(
    "text, message",
    [
        ("a: " + "{a: " * 32 + "1" + "}" * 32 + "\n", "--config: train.yaml: line 1: nested deeper than 32 levels"),
        ("[" * 33 + "]" * 33, "--config: train.yaml: line 1: nested deeper than 32 levels"),
        (  # 33 levels once the aliases are expanded, each level written on a line of its own
            "l0: &l0 {x: 1}\n" + "".join(f"l{n}: &l{n} {{x: *l{n - 1}}}\n" for n in range(1, 33)),
            "--config: train.yaml: line 30: nested deeper than 32 levels once its aliases are expanded",
        ),
        (  # a merge adds no level, but a nested value under it does
            "top: {<<: " + "{a: " * 32 + "1" + "}" * 32 + "}\n",
            "--config: train.yaml: line 1: nested deeper than 32 levels",
        ),
        (
            "top: " + "{<<: " * 128 + "{k: 1}" + "}" * 128 + "\n",
            "--config: train.yaml: line 1: nested deeper than 128 levels as written",
        ),
    ],
)
def test_nesting_deeper_than_the_limit_is_refused(text, message):
    assert refusal(text) == message


@pytest.mark.parametrize(
    "text, line",
    [(BILLION_LAUGHS, 4), (MERGE_BOMB, 14)],
    ids=["billion-laughs", "merge-bomb"],
)
def test_alias_and_merge_bombs_are_refused_within_a_second(text, line):
    start = time.perf_counter()
    message = refusal(text)
    assert time.perf_counter() - start < 1.0
    assert message == (
        f"--config: train.yaml: its aliases expand it by more than 100,000 nodes (line {line}): an alias bomb?"
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("s: &s [{<<: *s}]\n", "line 1: an alias refers to a node from inside it, which never ends"),
        ("a: &a {<<: *a}\n", "line 1: an alias refers to a node from inside it, which never ends"),
    ],
)
def test_a_merge_of_a_node_from_inside_it_is_refused(text, message):
    assert refusal(text) == f"--config: train.yaml: {message}"
