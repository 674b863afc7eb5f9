"""The [priority] and [fairshare] sections: defaults, and refusals that name the rule."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.config import load_config
from phalanx.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHALANX_CONFIG", raising=False)


def test_defaults_are_slurms_habits() -> None:
    c = load_config()
    assert c.priority.half_life_s() == 7 * 86400
    assert c.priority.max_age_s() == 7 * 86400
    assert c.priority.weight_fairshare == 10000
    names = [a.name for a in c.fairshare.all_accounts()]
    assert names == ["default"]
    assert [q.name for q in c.fairshare.all_qos()] == ["normal"]
    assert c.fairshare.accounts_of("anyone") == []


def test_a_half_life_of_0_means_no_decay() -> None:
    assert load_config(overrides={"priority": {"usage_half_life": "0"}}).priority.half_life_s() == 0


def test_a_users_default_account_comes_first() -> None:
    c = load_config(
        overrides={
            "fairshare": {
                "accounts": [{"name": "a"}, {"name": "b"}],
                "users": [
                    {"name": "u", "account": "a"},
                    {"name": "u", "account": "b", "default": True},
                ],
            }
        }
    )
    assert c.fairshare.accounts_of("u") == ["b", "a"]


@pytest.mark.parametrize(
    ("section", "value", "words"),
    [
        ("fairshare", {"accounts": [{"name": "a", "parent": "zz"}]}, "parent 'zz' is not an"),
        ("fairshare", {"accounts": [{"name": "a"}, {"name": "a"}]}, "declared twice"),
        ("fairshare", {"users": [{"name": "u", "account": "nope"}]}, "'nope' is not declared"),
        ("fairshare", {"accounts": [{"name": "root"}]}, "root"),
        ("fairshare", {"qos": [{"name": "q"}, {"name": "q"}]}, "QOS names must be unique"),
        ("fairshare", {"accounts": [{"name": "a", "max_wall": "soon"}]}, "max_wall"),
        ("priority", {"usage_half_life": "a week"}, "usage_half_life"),
        ("priority", {"max_age": "0"}, "max_age: invalid time '0'"),
        ("priority", {"max_age": "UNLIMITED"}, "max_age: 'UNLIMITED' must be a duration"),
        ("priority", {"weight_age": -1}, "weight_age"),
    ],
)
def test_bad_sections_are_refused_naming_the_rule(
    section: str, value: dict[str, Any], words: str
) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(overrides={section: value})
