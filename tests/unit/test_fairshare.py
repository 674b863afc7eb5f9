"""Fair Tree arithmetic (domain/fairshare.py) against hand-worked examples and properties.

The worked examples follow https://slurm.schedmd.com/fair_tree.html: level fair share
LF = S / U at each level (S: shares over siblings' shares, U: usage over siblings' usage),
siblings sorted by LF, the tree walked depth first, users ranked from N down, factor = rank / N.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.domain.fairshare import (
    ROOT,
    Account,
    Member,
    charge,
    decay,
    fair_tree,
    level_fs,
    validate_tree,
)


def _row(table, account, user=None):
    return next(r for r in table.rows if r.account == account and r.user == user)


def test_the_documents_tree_usera_and_userb():
    """The document's example: root => Acct1 => Acct12 => UserA, root => Acct1 => Acct16 =>
    UserB, with a second top-level account Acct2 (UserC, UserD) added so every rule shows.

    Usage: UserA 30, UserB 10, UserC 60, UserD 0; every account and user has 1 share.

    Level root:  Acct1 usage 30+10 = 40, Acct2 usage 60+0 = 60, total 100; S = 1/2 each
                 Acct1: U = 40/100 = 0.4, LF = 0.5/0.4 = 1.25
                 Acct2: U = 60/100 = 0.6, LF = 0.5/0.6 = 0.8333...
                 -> Acct1 is visited first.
    Level Acct1: Acct12 usage 30, Acct16 usage 10, total 40; S = 1/2 each
                 Acct12: U = 30/40 = 0.75, LF = 0.5/0.75 = 0.6667
                 Acct16: U = 10/40 = 0.25, LF = 0.5/0.25 = 2.0
                 -> Acct16 (UserB) before Acct12 (UserA): "Acct16 has a higher Level FS
                    value than Acct12", so UserB has the higher FairShare.
    Level Acct2: UserC U = 60/60 = 1, LF = 0.5; UserD U = 0, LF = inf -> UserD first.
    4 users, ranks from 4 down: UserB 4, UserA 3, UserD 2, UserC 1
    factors = rank / 4: UserB 1.0, UserA 0.75, UserD 0.5, UserC 0.25.
    UserD has used nothing yet ranks below UserA: all users of a higher account come first.
    """
    accounts = [
        Account("Acct1", ROOT),
        Account("Acct12", "Acct1"),
        Account("Acct16", "Acct1"),
        Account("Acct2", ROOT),
    ]
    members = [
        Member("UserA", "Acct12"),
        Member("UserB", "Acct16"),
        Member("UserC", "Acct2"),
        Member("UserD", "Acct2"),
    ]
    usage = {("Acct12", "UserA"): 30.0, ("Acct16", "UserB"): 10.0, ("Acct2", "UserC"): 60.0}
    t = fair_tree(accounts, members, usage)
    assert t.users == 4
    assert _row(t, "Acct1").level_fs == pytest.approx(1.25)
    assert _row(t, "Acct2").level_fs == pytest.approx(0.5 / 0.6)
    assert _row(t, "Acct12").level_fs == pytest.approx(0.5 / 0.75)
    assert _row(t, "Acct16").level_fs == pytest.approx(2.0)
    assert _row(t, "Acct2", "UserD").level_fs == math.inf
    assert _row(t, "Acct1").raw_usage == 40.0
    assert _row(t, "Acct1").effective_usage == pytest.approx(0.4)
    assert t.factor("Acct16", "UserB") == 1.0
    assert t.factor("Acct12", "UserA") == 0.75
    assert t.factor("Acct2", "UserD") == 0.5
    assert t.factor("Acct2", "UserC") == 0.25
    # rows in the order Fair Tree visits them (what `phalanx share` lists)
    assert [(r.account, r.user) for r in t.rows] == [
        ("Acct1", None),
        ("Acct16", None),
        ("Acct16", "UserB"),
        ("Acct12", None),
        ("Acct12", "UserA"),
        ("Acct2", None),
        ("Acct2", "UserD"),
        ("Acct2", "UserC"),
    ]


def test_sibling_users_with_equal_level_fairshare_share_a_rank():
    """Account X with u1 (usage 10), u2 (usage 10), u3 (usage 40), 1 share each.
    S = 1/3 each; total usage 60.
    u1: U = 10/60 = 1/6, LF = (1/3)/(1/6) = 2.0; u2 the same; u3: U = 40/60, LF = 0.5.
    u1 and u2 tie: both rank 3 (factor 3/3 = 1.0); the counter still moves past both, so u3
    gets rank 1 (factor 1/3)."""
    t = fair_tree(
        [Account("X", ROOT)],
        [Member("u1", "X"), Member("u2", "X"), Member("u3", "X")],
        {("X", "u1"): 10.0, ("X", "u2"): 10.0, ("X", "u3"): 40.0},
    )
    assert t.factor("X", "u1") == 1.0
    assert t.factor("X", "u2") == 1.0
    assert t.factor("X", "u3") == pytest.approx(1 / 3)


def test_tied_sibling_accounts_have_their_children_merged():
    """A (a1 usage 10) and B (b1 usage 2, b2 usage 8) under root, 1 share each.
    Root level: A usage 10, B usage 10 -> both U = 0.5, S = 0.5, LF = 1.0: a tie, so their
    children are merged and sorted together by their own level fair share:
      a1 (in A):  S = 1,   U = 10/10 = 1,  LF = 1.0
      b1 (in B):  S = 0.5, U = 2/10 = 0.2, LF = 2.5
      b2 (in B):  S = 0.5, U = 8/10 = 0.8, LF = 0.625
    Ranks: b1 3 (1.0), a1 2 (0.6667), b2 1 (0.3333). Walking A then B would have put a1 first.
    """
    t = fair_tree(
        [Account("A", ROOT), Account("B", ROOT)],
        [Member("a1", "A"), Member("b1", "B"), Member("b2", "B")],
        {("A", "a1"): 10.0, ("B", "b1"): 2.0, ("B", "b2"): 8.0},
    )
    assert t.factor("B", "b1") == 1.0
    assert t.factor("A", "a1") == pytest.approx(2 / 3)
    assert t.factor("B", "b2") == pytest.approx(1 / 3)


def test_a_user_tied_with_a_sibling_account_gets_that_accounts_highest_rank():
    """P (under root) holds account Q (q1 usage 5, q2 usage 15) and user p1 (usage 20).
    Level P: Q usage 20, p1 usage 20, S = 0.5 each -> LF = 1.0 both: a tie.
    Q is walked: q1 S = 0.5, U = 5/20 = 0.25, LF = 2.0 -> rank 3; q2 U = 0.75, LF = 0.667 ->
    rank 2. p1 takes Q's highest rank, 3. Factors: q1 1.0, p1 1.0, q2 2/3."""
    t = fair_tree(
        [Account("P", ROOT), Account("Q", "P")],
        [Member("q1", "Q"), Member("q2", "Q"), Member("p1", "P")],
        {("Q", "q1"): 5.0, ("Q", "q2"): 15.0, ("P", "p1"): 20.0},
    )
    assert t.factor("Q", "q1") == 1.0
    assert t.factor("P", "p1") == 1.0
    assert t.factor("Q", "q2") == pytest.approx(2 / 3)


def test_two_accounts_equal_shares_the_heavier_user_ranks_last():
    """The system test's cluster: accounts heavy and light, 1 share each, one user each.
    heavy used 1000, light 10: heavy LF = 0.5/(1000/1010) = 0.505, light LF = 0.5/(10/1010)
    = 50.5; light first: light 2/2 = 1.0, heavy 1/2 = 0.5."""
    t = fair_tree(
        [Account("heavy", ROOT), Account("light", ROOT)],
        [Member("hu", "heavy"), Member("lu", "light")],
        {("heavy", "hu"): 1000.0, ("light", "lu"): 10.0},
    )
    assert t.factor("light", "lu") == 1.0
    assert t.factor("heavy", "hu") == 0.5
    assert _row(t, "heavy").level_fs == pytest.approx(0.5 / (1000 / 1010))


def test_level_fs_formula_and_no_usage():
    assert level_fs(1, 4, 10, 20) == pytest.approx(0.25 / 0.5)
    assert level_fs(1, 4, 0, 20) == math.inf
    assert level_fs(1, 4, 0, 0) == math.inf


def test_decay_halves_after_one_half_life_and_is_incremental():
    assert decay(100.0, 0.0, 7 * 86400.0, 7 * 86400.0) == pytest.approx(50.0)
    assert decay(100.0, 0.0, 14 * 86400.0, 7 * 86400.0) == pytest.approx(25.0)
    assert decay(100.0, 5.0, 5.0, 10.0) == 100.0
    assert decay(100.0, 0.0, 1e9, 0.0) == 100.0  # half-life 0: no decay


def test_charge_is_tres_weighted():
    # 4 CPUs and 2 GPUs for 10 s at CPU 1.0, GPU 10.0: 10 * (4 + 20) = 240
    assert charge(4, 2, 10.0, 1.0, 10.0) == 240.0
    assert charge(4, 2, -3.0, 1.0, 10.0) == 0.0


@pytest.mark.parametrize(
    ("accounts", "members", "words"),
    [
        ([Account("a", "b")], [], "parent 'b'"),
        ([Account("a", ROOT), Account("a", ROOT)], [], "twice"),
        ([Account("a", "b"), Account("b", "a")], [], "cycle"),
        ([Account(ROOT, ROOT)], [], "root"),
        ([Account("a", ROOT)], [Member("u", "z")], "'z' is not declared"),
        ([Account("a", ROOT)], [Member("u", "a"), Member("u", "a")], "twice"),
        ([Account("a", ROOT, 0)], [], "at least 1"),
    ],
)
def test_bad_trees_are_refused_with_the_reason(accounts, members, words):
    with pytest.raises(ValueError, match=words):
        validate_tree(accounts, members)


# ------------------------------------------------------------------ properties


@st.composite
def trees(draw):
    n_acc = draw(st.integers(1, 6))
    accounts = []
    for i in range(n_acc):
        parent = ROOT if i == 0 else draw(st.sampled_from([ROOT] + [a.name for a in accounts]))
        accounts.append(Account(f"a{i}", parent, draw(st.integers(1, 5))))
    n_users = draw(st.integers(1, 10))
    members = []
    usage = {}
    for j in range(n_users):
        acct = draw(st.sampled_from([a.name for a in accounts]))
        members.append(Member(f"u{j}", acct, draw(st.integers(1, 5))))
        usage[(acct, f"u{j}")] = float(draw(st.integers(0, 1000)))
    return accounts, members, usage


@settings(max_examples=200, deadline=None)
@given(trees())
def test_every_user_ranked_factors_in_range_and_top_is_one(tree):
    accounts, members, usage = tree
    t = fair_tree(accounts, members, usage)
    assert set(t.factors) == {(m.account, m.user) for m in members}
    assert all(0 < f <= 1 for f in t.factors.values())
    assert max(t.factors.values()) == 1.0


@settings(max_examples=200, deadline=None)
@given(trees())
def test_users_of_a_better_served_sibling_account_all_rank_higher(tree):
    """Fair Tree's promise: if sibling accounts A and B have LF(A) > LF(B), every user below
    A has a higher factor than every user below B."""
    accounts, members, usage = tree
    t = fair_tree(accounts, members, usage)
    parent = {a.name: a.parent for a in accounts}

    def under(acct):
        out = []
        for m in members:
            a = m.account
            while a != ROOT:
                if a == acct:
                    out.append(t.factor(m.account, m.user))
                    break
                a = parent[a]
        return out

    rows = {r.account: r for r in t.rows if r.user is None}
    for a in accounts:
        for b in accounts:
            if a.parent == b.parent and rows[a.name].level_fs > rows[b.name].level_fs:
                fa, fb = under(a.name), under(b.name)
                if fa and fb:
                    assert min(fa) > max(fb)


@settings(max_examples=200, deadline=None)
@given(trees(), st.data())
def test_using_less_never_lowers_a_users_factor(tree, data):
    accounts, members, usage = tree
    m = data.draw(st.sampled_from(members))
    key = (m.account, m.user)
    before = fair_tree(accounts, members, usage).factor(*key)
    less = dict(usage)
    less[key] = data.draw(st.floats(0, usage[key]))
    assert fair_tree(accounts, members, less).factor(*key) >= before


@settings(max_examples=100, deadline=None)
@given(
    st.floats(0, 1e9),
    st.floats(0, 1e7),
    st.floats(0, 1e7),
    st.floats(1, 1e7),
)
def test_decaying_in_steps_equals_decaying_once(u, d1, d2, hl):
    stepped = decay(decay(u, 0.0, d1, hl), d1, d1 + d2, hl)
    assert stepped == pytest.approx(decay(u, 0.0, d1 + d2, hl), rel=1e-9, abs=1e-9)
