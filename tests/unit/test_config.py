"""Configuration loading: defaults < TOML < PHALANX_TIMING_* environment < overrides; rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.config import Config, Timing, load_config
from phalanx.errors import ConfigError

FENCE_RULE = "fence_timeout + fence_kill_grace + fence_margin < node_down_timeout"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHALANX_CONFIG", raising=False)
    for key in Timing.model_fields:
        monkeypatch.delenv(f"PHALANX_TIMING_{key.upper()}", raising=False)


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "phalanx.toml"
    p.write_text(text)
    return p


def test_defaults_are_valid() -> None:
    cfg = load_config()
    assert isinstance(cfg, Config)
    t = cfg.timing
    assert t.fence_timeout + t.fence_kill_grace + t.fence_margin < t.node_down_timeout
    assert [p.name for p in cfg.cluster.partitions] == ["batch"]
    assert cfg.cluster.default_requeue is True and cfg.cluster.default_mem_per_cpu_mb == 512


def test_toml_breaking_the_fence_rule_is_refused(tmp_path: Path) -> None:
    p = write(tmp_path, "[timing]\nnode_down_timeout = 8.0\nfence_timeout = 5.0\n")  # 5+2+1 = 8
    with pytest.raises(ConfigError) as err:
        load_config(p)
    msg = err.value.message
    assert FENCE_RULE in msg
    assert str(p) in msg
    assert "node_down_timeout=8.0" in msg  # the values are shown


def test_fence_rule_holds_when_satisfied(tmp_path: Path) -> None:
    p = write(tmp_path, "[timing]\nnode_down_timeout = 9.5\nfence_timeout = 5.0\n")
    assert load_config(p).timing.node_down_timeout == 9.5


@pytest.mark.parametrize(
    ("timing", "rule"),
    [
        ("renew_interval = 3.0\nlease_ttl = 6.0", "renew_interval * 3 <= lease_ttl"),
        (
            "heartbeat_interval = 3.0",
            "heartbeat_interval * 2 + max(0.5, heartbeat_interval) < fence_timeout",
        ),
        ("heartbeat_flush_interval = 5.0", "heartbeat_flush_interval < node_down_timeout / 2"),
        (
            # passes fence_timeout + fence_kill_grace + fence_margin (8 < 8.5), but a reply
            # read a long-poll after the controller heard the node leaves the fence ahead
            "node_down_timeout = 8.5",
            "fence_timeout + fence_kill_grace + heartbeat_interval + "
            "max(0.5, heartbeat_interval) < node_down_timeout",
        ),
    ],
)
def test_other_timing_rules(tmp_path: Path, timing: str, rule: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, f"[timing]\n{timing}\n"))
    assert rule in err.value.message


def test_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = write(tmp_path, "[timing]\nnode_down_timeout = 20.0\nkill_wait = 3\n")
    monkeypatch.setenv("PHALANX_TIMING_NODE_DOWN_TIMEOUT", "30")
    cfg = load_config(p)
    assert cfg.timing.node_down_timeout == 30.0  # env beats the file
    assert cfg.timing.kill_wait == 3.0  # the file beats the default


def test_env_override_breaking_a_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_TIMING_FENCE_TIMEOUT", "9")
    with pytest.raises(ConfigError) as err:
        load_config()
    assert FENCE_RULE in err.value.message


def test_env_override_not_a_number(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_TIMING_KILL_WAIT", "soon")
    with pytest.raises(ConfigError) as err:
        load_config()
    assert "PHALANX_TIMING_KILL_WAIT" in err.value.message


def test_reservation_overrun_takes_seconds_or_unlimited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slurm's ResvOverRun: 0 by default (a job is stopped at its reservation's end), seconds
    here, or UNLIMITED in any case (also from the environment); anything else is refused
    naming the key and what it takes."""
    assert Timing().reservation_overrun == 0.0 and Timing().overrun_s() == 0.0
    cfg = load_config(write(tmp_path, '[timing]\nreservation_overrun = "unlimited"\n'))
    assert cfg.timing.reservation_overrun == "UNLIMITED" and cfg.timing.overrun_s() is None
    assert (
        load_config(write(tmp_path, "[timing]\nreservation_overrun = 600\n")).timing.overrun_s()
        == 600.0
    )
    monkeypatch.setenv("PHALANX_TIMING_RESERVATION_OVERRUN", "INFINITE")
    assert load_config().timing.overrun_s() is None
    monkeypatch.setenv("PHALANX_TIMING_RESERVATION_OVERRUN", "90")
    assert load_config().timing.overrun_s() == 90.0
    for bad, said in (("-1", "seconds from 0 to"), ("soon", "give seconds (0 stops a job")):
        monkeypatch.setenv("PHALANX_TIMING_RESERVATION_OVERRUN", bad)
        with pytest.raises(ConfigError, match="reservation_overrun") as err:
            load_config()
        assert said in err.value.message, err.value.message
    monkeypatch.delenv("PHALANX_TIMING_RESERVATION_OVERRUN")
    with pytest.raises(ConfigError, match='or "UNLIMITED"'):
        load_config(write(tmp_path, "[timing]\nreservation_overrun = true\n"))


def test_config_path_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = write(tmp_path, '[cluster]\nname = "lab"\n')
    monkeypatch.setenv("PHALANX_CONFIG", str(p))
    assert load_config().cluster.name == "lab"


def test_overrides_beat_everything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_TIMING_KILL_WAIT", "4")
    cfg = load_config(overrides={"timing": {"kill_wait": 7.0}})
    assert cfg.timing.kill_wait == 7.0


def test_missing_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[timing\n"))
    with pytest.raises(ConfigError, match=r"timing\.bogus"):
        load_config(write(tmp_path, "[timing]\nbogus = 1\n"))
    with pytest.raises(ConfigError, match="heartbeat_interval"):
        load_config(write(tmp_path, "[timing]\nheartbeat_interval = -1\n"))


def test_partitions(tmp_path: Path) -> None:
    cfg = load_config(
        write(
            tmp_path,
            """
[[cluster.partitions]]
name = "cpu"
nodes = "c*"
default = true
max_time = "1-00:00:00"

[[cluster.partitions]]
name = "gpu"
nodes = "g[0-9]*"
""",
        )
    )
    assert [(p.name, p.default) for p in cfg.cluster.partitions] == [("cpu", True), ("gpu", False)]
    with pytest.raises(ConfigError, match="unique"):
        load_config(
            write(
                tmp_path, '[[cluster.partitions]]\nname = "a"\n[[cluster.partitions]]\nname = "a"\n'
            )
        )
    with pytest.raises(ConfigError, match="only one partition may be the default"):
        load_config(
            write(
                tmp_path,
                '[[cluster.partitions]]\nname = "a"\ndefault = true\n'
                '[[cluster.partitions]]\nname = "b"\ndefault = true\n',
            )
        )
    with pytest.raises(ConfigError, match="partition a: max_time"):
        load_config(write(tmp_path, '[[cluster.partitions]]\nname = "a"\nmax_time = "forever"\n'))
    with pytest.raises(ConfigError, match="name"):
        load_config(write(tmp_path, '[[cluster.partitions]]\nname = "bad name!"\n'))


def test_accounting_retention(tmp_path: Path) -> None:
    assert load_config().accounting.keep_seconds() == 30 * 86400  # the default: 30 days
    p = write(tmp_path, '[accounting]\nkeep_finished = "7-00:00:00"\npurge_batch = 200\n')
    cfg = load_config(p)
    assert cfg.accounting.keep_seconds() == 7 * 86400 and cfg.accounting.purge_batch == 200
    assert (
        load_config(
            write(tmp_path, '[accounting]\nkeep_finished = "UNLIMITED"\n')
        ).accounting.keep_seconds()
        is None
    )
    for bad, words in (("30 days", "invalid time"), ("0:30", "under a minute")):
        with pytest.raises(ConfigError) as err:
            load_config(write(tmp_path, f'[accounting]\nkeep_finished = "{bad}"\n'))
        assert "keep_finished" in err.value.message and words in err.value.message


def test_preemption_defaults_tiers_and_checks(tmp_path: Path) -> None:
    from phalanx.domain.preemption import Mode

    cfg = load_config()
    pre = cfg.preemption
    assert (pre.exempt_time, pre.reserve_margin, pre.max_per_pass) == (0.0, 60.0, 16)
    assert not pre.tiers(cfg.cluster, cfg.fairshare).active  # off until tiers differ
    cfg = load_config(
        write(
            tmp_path,
            """
[preemption]
exempt_time = 300

[[cluster.partitions]]
name = "low"
default = true
preempt_mode = "cancel"

[[cluster.partitions]]
name = "high"
priority_tier = 2

[[fairshare.qos]]
name = "urgent"
priority_tier = 5
preempt_mode = "off"
""",
        )
    )
    tiers = cfg.preemption.tiers(cfg.cluster, cfg.fairshare)
    assert tiers.active and cfg.preemption.exempt_time == 300
    assert (tiers.tier("low", None), tiers.tier("high", None), tiers.tier("low", "urgent")) == (
        0,
        2,
        5,
    )
    assert tiers.mode("low", None) is Mode.CANCEL and tiers.mode("low", "urgent") is Mode.OFF
    assert tiers.mode("high", "normal") is Mode.REQUEUE
    for bad, where in [
        ("[preemption]\nexempt_time = -1\n", "preemption.exempt_time"),
        ("[preemption]\nreserve_margin = 0\n", "preemption.reserve_margin"),
        ("[preemption]\nmax_per_pass = 0\n", "preemption.max_per_pass"),
        ("[preemption]\nsometime = 1\n", "preemption.sometime"),
        ('[[cluster.partitions]]\nname = "a"\npreempt_mode = "suspend"\n', "preempt_mode"),
        ('[[cluster.partitions]]\nname = "a"\npriority_tier = -1\n', "priority_tier"),
    ]:
        with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
            load_config(write(tmp_path, bad))
