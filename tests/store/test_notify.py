"""Cross-controller wakeups: a work_gen bump NOTIFYs, and `WorkListener` hears it.

On PostgreSQL every write that gives nodes new work (starting an attempt, a cancel, a drain
--now) bumps their `work_gen` and sends `NOTIFY phalanx_work` with their names in the same
transaction. These tests use a real server and real store methods: the notification arrives
after the commit and never for a rolled-back change, the listener survives its connection
being killed or the server freezing, and it stops at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import text

from phalanx.config import Config
from phalanx.controller.runtime import Controller, partition_rows
from phalanx.domain.spec import JobSpec, normalize
from phalanx.store.notify import ALL_NODES, MAX_PAYLOAD, WorkListener, decode_nodes, encode_nodes
from phalanx.store.store import Store

LIMIT = 10.0  # generous: a loaded machine; a notification normally takes milliseconds


# --------------------------------------------------------------------------------------------
# payloads (pure)
# --------------------------------------------------------------------------------------------


def test_payload_round_trip() -> None:
    payload = encode_nodes(["n2", "n1", "n2"])
    assert payload == '["n1","n2"]'
    assert decode_nodes(payload) == ["n1", "n2"]


def test_payload_too_long_means_every_node() -> None:
    many = [f"node{i:05d}" for i in range(2000)]
    payload = encode_nodes(many)
    assert payload == ALL_NODES
    assert len(encode_nodes(many[:100]).encode()) <= MAX_PAYLOAD
    assert decode_nodes(payload) is None


@pytest.mark.parametrize("junk", ["", "not json", "{}", "[1, 2]", '"n1"'])
def test_unreadable_payload_wakes_everyone(junk: str) -> None:
    assert decode_nodes(junk) is None


# --------------------------------------------------------------------------------------------
# a real server
# --------------------------------------------------------------------------------------------


class Heard:
    """What a listener delivered, with a condition to wait on."""

    def __init__(self) -> None:
        self.items: list[list[str] | None] = []
        self.cond = threading.Condition()

    def __call__(self, nodes: list[str] | None) -> None:
        with self.cond:
            self.items.append(nodes)
            self.cond.notify_all()

    def wait(self, pred: Callable[[list[list[str] | None]], bool], timeout: float = LIMIT) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: pred(self.items), timeout)

    def names(self) -> set[str]:
        with self.cond:
            return {n for item in self.items if item for n in item}


@pytest.fixture
def pg_store(migrated_pg_url: str) -> Iterator[Store]:
    st = Store(migrated_pg_url, connect_timeout=2, op_timeout=0.5)
    st.sync_partitions(partition_rows(Config()))
    yield st
    st.close()


@pytest.fixture
def listen(pg_store: Store) -> Iterator[Callable[..., tuple[WorkListener, Heard]]]:
    made: list[WorkListener] = []

    def make(**kw: Any) -> tuple[WorkListener, Heard]:
        heard = Heard()
        lst = WorkListener(pg_store.db.connect_args(), heard, op_timeout=0.5, **kw)
        made.append(lst)
        lst.start()
        assert lst.wait_healthy(LIMIT), "the listener did not connect"
        assert heard.wait(lambda items: None in items), "no re-check after connecting"
        return lst, heard

    yield make
    for lst in made:
        lst.stop()


def add_node(store: Store, name: str) -> None:
    store.register_node(
        name,
        cpus=4,
        mem_mb=4096,
        gpus=[],
        features=[],
        addr="127.0.0.1",
        boot_id="b1",
        version="test",
    )


def submit(store: Store) -> int:
    spec = JobSpec(argv=["/bin/true"])
    resolved = normalize(
        spec, store.partition_infos(), default_mem_per_cpu_mb=512, default_requeue=True
    )
    ((jid,),) = store.submit([(resolved, spec.model_dump(exclude={"ignored"}))], "alice")
    return jid


def start_on(store: Store, jid: int, node: str) -> None:
    job = store.get_job(jid)
    started = store.start_attempts(
        [
            {
                "job_id": jid,
                "partition": job["partition"],
                "nodes": [node],
                "cpus_per_node": job["cpus_per_node"],
                "mem_per_node_mb": [job["mem_per_node_mb"]],
                "gpu_ids": [[]],
                "exclusive": False,
            }
        ],
        None,
    )
    assert started == [jid]


@pytest.mark.postgres
def test_starting_an_attempt_notifies_its_node(
    pg_store: Store, listen: Callable[..., tuple[WorkListener, Heard]]
) -> None:
    lst, heard = listen()
    add_node(pg_store, "n1")
    add_node(pg_store, "n2")
    jid = submit(pg_store)
    before = pg_store.node_gens()
    t0 = time.monotonic()
    start_on(pg_store, jid, "n2")
    assert heard.wait(lambda items: ["n2"] in items), heard.items
    latency = time.monotonic() - t0
    assert pg_store.node_gens()["n2"] == before["n2"] + 1  # the same write bumped the gen
    assert "n1" not in heard.names()  # only the nodes with new work
    assert latency < LIMIT
    assert lst.received >= 1
    # cancelling the running job gives its node work (stop it): another notification
    pg_store.cancel([jid], "alice")
    assert heard.wait(lambda items: items.count(["n2"]) >= 2), heard.items


@pytest.mark.postgres
def test_a_rolled_back_bump_sends_nothing(
    pg_store: Store, listen: Callable[..., tuple[WorkListener, Heard]]
) -> None:
    _, heard = listen()
    add_node(pg_store, "n1")
    add_node(pg_store, "n2")

    class Boom(Exception):
        pass

    with pytest.raises(Boom), pg_store.db.begin() as conn:
        pg_store._bump_gen(conn, ["n1"])
        raise Boom
    with pg_store.db.begin() as conn:  # a marker that does commit, sent after the one above
        pg_store._bump_gen(conn, ["n2"])
    assert heard.wait(lambda items: ["n2"] in items)
    assert "n1" not in heard.names()


@pytest.mark.postgres
def test_listener_reconnects_after_its_connection_is_killed(
    pg_store: Store, listen: Callable[..., tuple[WorkListener, Heard]]
) -> None:
    lst, heard = listen()
    add_node(pg_store, "n1")
    with pg_store.db.begin() as conn:  # what a database restart does to every session
        conn.execute(
            text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND query ILIKE 'LISTEN%'"
            )
        )
    deadline = time.monotonic() + LIMIT
    while lst.connects < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lst.connects >= 2, "the listener did not reconnect"
    assert heard.wait(lambda items: items.count(None) >= 2)  # re-check after reconnecting
    with pg_store.db.begin() as conn:
        pg_store._bump_gen(conn, ["n1"])
    assert heard.wait(lambda items: ["n1"] in items)


@pytest.mark.postgres
def test_listener_survives_a_frozen_server(
    pg_store: Store, pg_server: Any, listen: Callable[..., tuple[WorkListener, Heard]]
) -> None:
    """A hung host: the ping is cut after op_timeout, the listener reports itself unhealthy
    (controllers poll fast again), and it listens again once the server is back."""
    lst, heard = listen(ping_every=0.3)
    add_node(pg_store, "n1")
    with pg_server.paused():
        deadline = time.monotonic() + LIMIT
        while lst.healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not lst.healthy, "a frozen server was not noticed"
    deadline = time.monotonic() + 3 * LIMIT
    while not (lst.healthy and lst.connects >= 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lst.healthy and lst.connects >= 2, "the listener did not come back"
    with pg_store.db.begin() as conn:
        pg_store._bump_gen(conn, ["n1"])
    assert heard.wait(lambda items: ["n1"] in items)


@pytest.mark.postgres
def test_stop_is_prompt_even_while_the_server_is_frozen(
    pg_store: Store, pg_server: Any, listen: Callable[..., tuple[WorkListener, Heard]]
) -> None:
    lst, _ = listen()
    t0 = time.monotonic()
    lst.stop()
    assert time.monotonic() - t0 < 2.0
    assert lst._thread is not None and not lst._thread.is_alive()

    frozen, _ = listen(ping_every=0.3)
    with pg_server.paused():
        time.sleep(0.5)  # the listener is now waiting on a server that does not answer
        t0 = time.monotonic()
        frozen.stop(timeout=1.0)
        assert time.monotonic() - t0 < 2.0  # stop() never hangs; the thread is a daemon
        assert frozen._thread is not None and frozen._thread.daemon


@pytest.mark.postgres
def test_notify_payloads_use_the_real_channel(pg_url: str, pg_store: Store) -> None:
    """The wire format, seen by a plain psycopg session (what another version would see)."""
    add_node(pg_store, "n1")
    cargs, cparams = pg_store.db.connect_args()
    with psycopg.connect(*cargs, **{**cparams, "autocommit": True}) as conn:
        conn.execute("LISTEN phalanx_work")
        with pg_store.db.begin() as c:
            pg_store._bump_gen(c, ["n1"])
        got = next(iter(conn.notifies(timeout=LIMIT)), None)
    assert got is not None and got.channel == "phalanx_work"
    assert decode_nodes(got.payload) == ["n1"]


@pytest.mark.postgres
def test_a_submission_to_a_peer_wakes_the_scheduling_lease_holder(pg_store: Store) -> None:
    """Two controllers on one store: c1 holds every lease, c2 none. A job submitted through
    c2 is news for c1's scheduler: c2's next tick sends one notification and c1's scheduler
    wakes for it (instead of finding the job at its next interval), and its pass starts the
    job. Both controllers are real; their loops are driven by hand."""
    config = Config()
    holder = Controller(pg_store, config, cid="c1")
    peer = Controller(pg_store, config, cid="c2")
    try:
        assert "took term" in holder.leases.tick()
        peer.leases.tick()
        assert not peer.scheduler._sched_fences(), "the peer must hold no scheduling lease"
        holder.start_listener()
        listener = holder.wakeups.listener
        assert listener is not None and listener.wait_healthy(LIMIT)
        add_node(pg_store, "n1")
        holder.loops._kick.clear()  # what connecting and registering kicked

        ((jid,),) = peer.submit([JobSpec(argv=["/bin/true"])], "alice")
        peer.scheduler.tick()
        peer.scheduler.tick()
        assert peer.scheduler.notices == 1  # one notification per burst of news
        assert holder.loops._kick.wait(LIMIT), "the holder's scheduler was not woken"
        holder.schedule_tick()
        assert pg_store.get_job(jid)["state"] in ("STARTING", "RUNNING")

        holder.loops._kick.clear()
        holder.kick()  # the holder's own news: nothing to tell, it holds every lease
        holder.scheduler.tick()
        assert holder.scheduler.notices == 0
    finally:
        holder.wakeups.stop()
