"""Hostlist expressions as sinfo/squeue print them, both directions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.domain.hostlist import compress_hostlist, expand_hostlist, hostname_sort_key


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("node[01-04,07],gpu1", ["node01", "node02", "node03", "node04", "node07", "gpu1"]),
        ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
        ("node[8-10]", ["node8", "node9", "node10"]),  # no padding: width of the start
        ("node[08-10]", ["node08", "node09", "node10"]),  # padding kept
        ("n[001-002]-ib", ["n001-ib", "n002-ib"]),
        ("gpu1", ["gpu1"]),
        ("a,b c", ["a", "b", "c"]),  # whitespace separates too
        ("n1,n[1-2]", ["n1", "n2"]),  # repeats dropped, first order kept
        ("", []),
        ("[1-3]", ["1", "2", "3"]),
    ],
)
def test_expand_hostlist(text: str, names: list[str]) -> None:
    assert expand_hostlist(text) == names


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("node[1-", "never closed"),
        ("node]1", "without"),
        ("node[[1]]", "nested"),
        ("node[]", "cannot read"),
        ("node[a-b]", "cannot read"),
        ("node[3-1]", "ends before it starts"),
        ("node/1", "not a host name"),
        ("node[0-99999999]", "more than 100000 hosts"),
        ("a[1-1000]b[1-1000]", "more than 100000 hosts"),
    ],
)
def test_expand_hostlist_refuses(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        expand_hostlist(text)


@pytest.mark.parametrize(
    ("names", "text"),
    [
        (["node01", "node02", "node03", "node04", "node07"], "node[01-04,07]"),
        (["node07", "node03", "node01", "node04", "node02"], "node[01-04,07]"),
        (["gpu1", "node01", "node02"], "gpu1,node[01-02]"),
        (["node10", "node9", "node8"], "node[8-10]"),  # numeric, not lexical, order
        (["node09", "node10"], "node[09-10]"),
        (["n1", "n01"], "n[1,01]"),  # same number, different names: both kept
        (["login", "node1"], "login,node1"),
        (["node1", "node1"], "node1"),
        ([], ""),
    ],
)
def test_compress_hostlist(names: list[str], text: str) -> None:
    assert compress_hostlist(names) == text


@pytest.mark.parametrize("bad", ["", "a,b", "n[1]", "a b"])
def test_compress_refuses_names_that_would_not_round_trip(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid host name"):
        compress_hostlist([bad])


def test_hostname_sort_key_is_natural() -> None:
    assert sorted(["n10", "n9", "m", "n"], key=hostname_sort_key) == ["m", "n", "n9", "n10"]


_numbered = st.builds(
    lambda prefix, number, width: f"{prefix}{number:0{width}d}",
    st.text(alphabet="abn-._", min_size=0, max_size=3),
    st.integers(min_value=0, max_value=1200),
    st.integers(min_value=1, max_value=4),
)
_any_name = st.text(alphabet="ab1-._0", min_size=1, max_size=6)
_hostnames = st.lists(st.one_of(_numbered, _any_name), min_size=0, max_size=40)


@given(_hostnames)
def test_compress_then_expand_round_trips(names: list[str]) -> None:
    text = compress_hostlist(names)
    assert expand_hostlist(text) == sorted(set(names), key=hostname_sort_key)


@given(_hostnames)
def test_compressed_form_is_canonical(names: list[str]) -> None:
    text = compress_hostlist(names)
    assert compress_hostlist(expand_hostlist(text)) == text
    assert compress_hostlist(reversed(names)) == text
