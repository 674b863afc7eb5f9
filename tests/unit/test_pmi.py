"""srun's PMI-1 server (slurm/srun/pmi.py): the protocol's decisions, then over real sockets.

The real client (Debian's MPICH) is driven end to end in tests/system/test_mpi.py; here each
rule is checked on its own: who may connect, what each command answers, when a barrier opens.
"""

from __future__ import annotations

import socket
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.slurm.srun.pmi import (
    Conn,
    PmiServer,
    PmiState,
    format_reply,
    parse_line,
    process_mapping,
)

BASE = 1000


def ready(size: int = 3) -> PmiState:
    state = PmiState(id_base=BASE, kvsname="kvs_1")
    per_node = [list(range(i, min(i + 2, size))) for i in range(0, size, 2)]
    state.set_layout(per_node)
    return state


def joined(state: PmiState, rank: int) -> Conn:
    conn = Conn()
    replies = state.handle(conn, parse_line(f"cmd=initack pmiid={BASE + rank}"))
    assert replies == [
        (
            conn,
            f"cmd=initack rc=0\ncmd=set size={state.size}\ncmd=set rank={rank}\ncmd=set debug=0\n",
        )
    ]
    return conn


def ask(state: PmiState, conn: Conn, line: str) -> dict[str, str]:
    replies = state.handle(conn, parse_line(line))
    assert replies is not None and len(replies) == 1 and replies[0][0] is conn, replies
    return parse_line(replies[0][1])


@pytest.mark.parametrize(
    "first",
    [
        "cmd=init pmi_version=1 pmi_subversion=1",  # no initack: not one of the step's tasks
        f"cmd=initack pmiid={BASE + 3}",  # a rank past the step's size
        f"cmd=initack pmiid={BASE - 1}",
        "cmd=initack pmiid=abc",
        "cmd=initack",
    ],
)
def test_a_connection_that_does_not_name_a_task_of_the_step_is_closed(first: str) -> None:
    state = ready(3)
    assert state.handle(Conn(), parse_line(first)) is None


def test_init_maxes_names_and_keys() -> None:
    state = ready(3)
    conn = joined(state, 2)
    assert ask(state, conn, "cmd=init pmi_version=1 pmi_subversion=1") == {
        "cmd": "response_to_init", "pmi_version": "1", "pmi_subversion": "1", "rc": "0",
    }  # fmt: skip
    maxes = ask(state, conn, "cmd=get_maxes")
    assert (maxes["cmd"], maxes["rc"], int(maxes["vallen_max"]) > 256) == ("maxes", "0", True)
    assert ask(state, conn, "cmd=get_my_kvsname")["kvsname"] == "kvs_1"
    assert ask(state, conn, "cmd=get_universe_size")["size"] == "3"
    assert ask(state, conn, "cmd=get_appnum")["appnum"] == "0"
    assert ask(state, conn, "cmd=put kvsname=kvs_1 key=bc-2 value=tcp#1.2.3.4$")["rc"] == "0"
    other = joined(state, 0)
    got = ask(state, other, "cmd=get kvsname=kvs_1 key=bc-2")
    assert (got["rc"], got["value"]) == ("0", "tcp#1.2.3.4$")
    missing = ask(state, other, "cmd=get kvsname=kvs_1 key=nope")
    assert missing["rc"] == "-1"
    # the layout of the step, in MPICH's vector form: ranks 0,1 on node 0 and 2 on node 1
    assert ask(state, other, "cmd=get kvsname=kvs_1 key=PMI_process_mapping")["value"] == (
        "(vector,(0,1,2),(1,1,1))"
    )
    assert ask(state, conn, "cmd=finalize")["cmd"] == "finalize_ack"


def test_a_pmi2_client_is_told_this_server_speaks_pmi1() -> None:
    state = ready(1)
    conn = joined(state, 0)
    reply = ask(state, conn, "cmd=init pmi_version=2 pmi_subversion=0")
    assert reply["rc"] == "-1" and "PMI-1" in reply["msg"]


def test_a_value_too_long_or_an_unknown_command_is_an_error_not_a_crash() -> None:
    state = ready(1)
    conn = joined(state, 0)
    assert ask(state, conn, "cmd=put kvsname=k key=a value=" + "x" * 5000)["rc"] == "-1"
    assert ask(state, conn, "cmd=frobnicate")["rc"] == "-1"
    assert ask(state, conn, "mcmd=spawn")["rc"] == "-1"


def test_the_barrier_opens_when_every_rank_is_in_and_answers_all_of_them() -> None:
    state = ready(3)
    conns = [joined(state, r) for r in range(3)]
    assert state.handle(conns[0], parse_line("cmd=barrier_in")) == []
    assert state.handle(conns[2], parse_line("cmd=barrier_in")) == []
    out = state.handle(conns[1], parse_line("cmd=barrier_in"))
    assert out is not None
    assert sorted(id(c) for c, _ in out) == sorted(id(c) for c in conns)
    assert {text for _, text in out} == {"cmd=barrier_out rc=0\n"}
    # and the next barrier counts from zero again
    assert state.handle(conns[0], parse_line("cmd=barrier_in")) == []


def test_abort_is_kept_with_its_rank_and_code_and_gets_no_reply() -> None:
    state = ready(2)
    conn = joined(state, 1)
    assert state.handle(conn, parse_line("cmd=abort exitcode=3")) == []
    assert state.aborted == (1, 3, "")


def test_names_are_published_looked_up_and_withdrawn() -> None:
    state = ready(1)
    conn = joined(state, 0)
    assert ask(state, conn, "cmd=lookup_name service=s")["rc"] == "-1"
    assert ask(state, conn, "cmd=publish_name service=s port=p1")["rc"] == "0"
    assert ask(state, conn, "cmd=lookup_name service=s")["port"] == "p1"
    assert ask(state, conn, "cmd=unpublish_name service=s")["rc"] == "0"
    assert ask(state, conn, "cmd=lookup_name service=s")["rc"] == "-1"


@given(st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=12))
def test_process_mapping_names_every_rank_on_its_node(counts: list[int]) -> None:
    """Expanding the vector gives back each node's count, in order (block layout)."""
    task_ids, at = [], 0
    for c in counts:
        task_ids.append(list(range(at, at + c)))
        at += c
    text = process_mapping(task_ids)
    assert text.startswith("(vector,") and text.endswith(")")
    expanded: list[int] = []
    for triple in text[len("(vector,(") : -2].split("),("):
        first, nodes, per = (int(x) for x in triple.split(","))
        assert first == len(expanded)
        expanded.extend([per] * nodes)
    assert expanded == counts


def test_format_and_parse_round_trip() -> None:
    line = format_reply("get_result", rc=0, msg="success", value="a=b")
    assert line.endswith("\n")
    assert parse_line(line) == {"cmd": "get_result", "rc": "0", "msg": "success", "value": "a=b"}


# ----------------------------------------------------------------------------- over sockets
class Rank:
    """A PMI-1 client as MPICH's simple client talks: lines over TCP."""

    def __init__(self, port: int, pmiid: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.file = self.sock.makefile("rb")
        self.send(f"cmd=initack pmiid={pmiid}")

    def send(self, line: str) -> None:
        self.sock.sendall(line.encode() + b"\n")

    def line(self) -> dict[str, str]:
        return parse_line(self.file.readline().decode())

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def test_two_ranks_exchange_cards_through_a_barrier_over_tcp() -> None:
    aborts: list[tuple[int | None, int, str]] = []
    server = PmiServer(on_abort=lambda *a: aborts.append(a))
    ranks: list[Rank] = []
    try:
        # the ranks may connect before srun has the step's layout: they wait for it
        ranks = [Rank(server.port, server.id_base + r) for r in range(2)]
        threading.Timer(0.2, server.start, args=(7, [[0], [1]])).start()
        for r, rank in enumerate(ranks):
            assert [rank.line()["cmd"] for _ in range(4)] == ["initack", "set", "set", "set"]
            rank.send(f"cmd=put kvsname=k key=card-{r} value=addr{r}")
            assert rank.line()["rc"] == "0"
        for rank in ranks:
            rank.send("cmd=barrier_in")
        assert [rank.line()["cmd"] for rank in ranks] == ["barrier_out", "barrier_out"]
        ranks[0].send("cmd=get kvsname=k key=card-1")
        assert ranks[0].line()["value"] == "addr1"
        ranks[1].send("cmd=abort exitcode=5")
        ranks[1].send("cmd=get kvsname=k key=card-0")  # the connection is still served
        assert ranks[1].line()["value"] == "addr0"
        assert aborts == [(1, 5, "")] and server.step_id == 7
    finally:
        for rank in ranks:
            rank.close()
        server.close()


def test_a_stranger_learns_nothing_and_a_pmi2_client_is_hung_up_on() -> None:
    server = PmiServer()
    try:
        server.start(1, [[0]])
        stranger = Rank(server.port, server.id_base + 5)  # not a rank of this step
        assert stranger.file.readline() == b""  # closed, nothing said
        stranger.close()
        pmi2 = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        pmi2.sendall(b"000034cmd=fullinit;pmijobid=1;pmirank=0;")
        assert pmi2.recv(100) == b""
        pmi2.close()
    finally:
        server.close()


def test_a_step_request_names_its_pmi_server_whole() -> None:
    """The API takes pmi_port with pmi_id_base or neither, and an id base that keeps every
    PMI_ID an int (MPICH reads it with atoi)."""
    from pydantic import ValidationError

    from phalanx.controller.api_models import StepIn

    base = {"argv": ["./app"], "host": "10.0.0.5", "port": 4000, "cookie": "c" * 32}
    with pytest.raises(ValidationError, match="go together"):
        StepIn(**base, pmi_port=5000)
    with pytest.raises(ValidationError):
        StepIn(**base, pmi_port=5000, pmi_id_base=2**31)
    assert StepIn(**base, pmi_port=5000, pmi_id_base=77).pmi_id_base == 77
