"""The torchrun rendezvous rows (store/rendezvous.py) on SQLite and PostgreSQL: the state's
compare-and-set (create once, then only on the current token), the members it records, the
key-value store with an atomic add under concurrent writers, and rows that are one attempt's
(a requeued job starts afresh) and one running job's."""

from __future__ import annotations

import threading

import pytest
from test_elastic_store import run_everywhere, schedule
from test_store_contract import add_node, exited, store, submit1

from phalanx.errors import InvalidTransition
from phalanx.store.store import Store

__all__ = ["store"]


def running_job(store: Store, **spec: object) -> int:
    add_node(store, "n1")
    jid = submit1(store, requeue=True, **spec)
    assert schedule(store) == [jid]
    run_everywhere(store, store.attempts_of(jid)[-1])
    return jid


def test_compare_and_set_of_the_state(store: Store) -> None:
    jid = running_job(store)
    assert store.rdzv_get(jid, "r", ["state"]).values == {}
    value, token, done, _ = store.rdzv_cas(jid, "r", "state", b"a", None, member=("d1", "n1"))
    assert (value, done) == (b"a", True)
    # a second create loses and gets the state
    assert store.rdzv_cas(jid, "r", "state", b"b", None)[:3] == (b"a", token, False)
    # a stale token loses; the current one wins and moves the token on
    assert store.rdzv_cas(jid, "r", "state", b"b", token + 7)[:3] == (b"a", token, False)
    value, new, done, _ = store.rdzv_cas(jid, "r", "state", b"b", token)
    assert (value, done) == (b"b", True) and new != token
    # the same set again (a repeat after a lost answer): nothing changes
    assert store.rdzv_cas(jid, "r", "state", b"b", token)[:3] == (b"b", new, False)
    assert store.rdzv_get(jid, "r", ["state", "member/d1"]).values == {
        "state": (b"b", new),
        "member/d1": (b"n1", 1),
    }


def test_key_values_and_a_concurrent_add(store: Store) -> None:
    jid = running_job(store)
    store.rdzv_set(jid, "r", {"kv/a": b"1", "kv/b": b"\x00"})
    store.rdzv_set(jid, "r", {"kv/a": b"2"})
    got = store.rdzv_get(jid, "r", ["kv/a", "kv/b", "kv/c"]).values
    assert {k: v for k, (v, _) in got.items()} == {"kv/a": b"2", "kv/b": b"\x00"}
    errors: list[BaseException] = []

    def adds() -> None:
        try:
            for _ in range(10):
                store.rdzv_add(jid, "r", "kv/n", 1)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=adds) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.rdzv_add(jid, "r", "kv/n", 0) == 40
    assert store.rdzv_count(jid, "r", "kv/") == 3
    assert store.rdzv_delete(jid, "r", "kv/a") and not store.rdzv_delete(jid, "r", "kv/a")
    with pytest.raises(InvalidTransition):
        store.rdzv_add(jid, "r", "kv/b", 1)  # not an integer


def test_rows_are_a_running_attempts(store: Store) -> None:
    jid = running_job(store)
    store.rdzv_cas(jid, "r", "state", b"a", None)
    att = store.attempts_of(jid)[-1]
    store.requeue([jid], "test")
    with pytest.raises(InvalidTransition):
        store.rdzv_get(jid, "r", ["state"])  # the job is being stopped: no rendezvous
    store.apply_reports("n1", [exited(att, None, signal=15, stop_requested=True)], None)
    assert schedule(store) == [jid]
    run_everywhere(store, store.attempts_of(jid)[-1])
    # the new attempt's rendezvous starts afresh (its rows are its own)
    assert store.rdzv_get(jid, "r", ["state"]).values == {}
