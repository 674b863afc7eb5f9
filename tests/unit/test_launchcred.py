"""Step launch credentials (auth/launchcred.py): what a node's agent accepts from srun.

The agent starts a directly handed-over step only on a controller's signature made with that
node's derived key; srun relays the credential and must not be able to alter it or aim it at
another node.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.auth import launchcred
from phalanx.auth.keys import KeySet, derive, new_key

CLUSTER = new_key("k1")
NODE01 = KeySet([derive(CLUSTER, "node", "node01")])
NODE02 = KeySet([derive(CLUSTER, "node", "node02")])
ITEM = {"attempt_id": 7, "step_id": 3, "node": "node01", "argv": ["/bin/true"], "env": {"A": "1"}}


def signed(item: dict[str, object] = ITEM, now: float = 1000.0, ttl: float = 60.0) -> dict:
    return launchcred.sign(NODE01.signing, dict(item), now=now, ttl=ttl)


def test_a_signed_launch_verifies_for_its_node_until_it_expires() -> None:
    cred = signed()
    item = launchcred.verify(NODE01, "node01", cred, now=1059.0)
    assert {k: item[k] for k in ITEM} == ITEM
    assert item[launchcred.EXPIRES] == 1060.0
    with pytest.raises(launchcred.LaunchRefused, match="expired"):
        launchcred.verify(NODE01, "node01", cred, now=1060.5)


@pytest.mark.parametrize(
    "change",
    [
        {"argv": ["/bin/sh", "-c", "evil"]},
        {"env": {"A": "2"}},
        {"step_id": 4},
        {launchcred.EXPIRES: 10**12},  # srun may not extend its life either
    ],
)
def test_an_altered_launch_is_refused(change: dict[str, object]) -> None:
    cred = signed()
    cred["item"] = {**cred["item"], **change}
    with pytest.raises(launchcred.LaunchRefused, match="bad signature"):
        launchcred.verify(NODE01, "node01", cred, now=1001.0)


def test_a_launch_for_one_node_is_worthless_to_another() -> None:
    cred = signed()
    with pytest.raises(launchcred.LaunchRefused, match="does not hold"):
        launchcred.verify(NODE02, "node02", cred, now=1001.0)
    # node01's own key, but an item naming another node (never signed so by a controller)
    other = launchcred.sign(NODE01.signing, {**ITEM, "node": "node02"}, now=1000.0, ttl=60.0)
    with pytest.raises(launchcred.LaunchRefused, match="addressed to node 'node02'"):
        launchcred.verify(NODE01, "node01", other, now=1001.0)


@pytest.mark.parametrize(
    "cred",
    [None, "x", [], {}, {"item": {}, "kid": 1, "sig": "s"}, {"item": [], "kid": "k", "sig": "s"}],
)
def test_what_is_not_a_credential_is_refused(cred: object) -> None:
    with pytest.raises(launchcred.LaunchRefused):
        launchcred.verify(NODE01, "node01", cred, now=1001.0)


@given(st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=16), max_size=8))
def test_any_item_round_trips_and_any_one_character_change_breaks_it(
    env: dict[str, str],
) -> None:
    cred = signed({**ITEM, "env": env})
    assert launchcred.verify(NODE01, "node01", cred, now=1000.0)["env"] == env
    forged = {**cred, "item": {**cred["item"], "env": {**env, "PHX_X": "1"}}}
    with pytest.raises(launchcred.LaunchRefused):
        launchcred.verify(NODE01, "node01", forged, now=1000.0)
