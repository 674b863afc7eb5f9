"""The one schema, for SQLite and PostgreSQL (SQLAlchemy Core). Alembic migrations build it.

Times are float seconds since the epoch. Lease expiry uses the database's clock; everything
else is stamped by the controller that makes the change.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    false,
    true,
)

metadata = MetaData()

# SQLite: INTEGER PRIMARY KEY must be plain Integer to be the rowid alias.
IdType = BigInteger().with_variant(Integer(), "sqlite")

jobs = Table(
    "jobs",
    metadata,
    Column("id", IdType, primary_key=True, autoincrement=True),
    Column("array_job_id", IdType, nullable=True),
    Column("array_task_id", Integer, nullable=True),
    Column("array_limit", Integer, nullable=True),
    Column("name", String(256), nullable=False),
    Column("user", String(128), nullable=False),
    Column("partitions", String(512), nullable=False),  # comma list, in order of preference
    Column("partition", String(64), nullable=True),  # where it last ran
    Column("state", String(16), nullable=False),
    Column("reason", Text, nullable=True),
    Column("priority", Integer, nullable=False, default=0),
    Column("submit_time", Float, nullable=False),
    Column("eligible_time", Float, nullable=True),
    Column("start_time", Float, nullable=True),
    Column("end_time", Float, nullable=True),
    Column("time_limit_s", Integer, nullable=True),
    Column("nodes", Integer, nullable=False),
    Column("cpus_per_node", Integer, nullable=False),
    Column("mem_per_node_mb", Integer, nullable=False),
    Column("gpus_per_node", Integer, nullable=False),
    Column("gpu_type", String(64), nullable=True),
    Column("exclusive", Boolean, nullable=False, default=False),
    Column("constraint_expr", String(512), nullable=True),
    Column("nodelist", JSON, nullable=False),
    Column("exclude", JSON, nullable=False),
    Column("dependency", JSON, nullable=False),
    Column("requeue", Boolean, nullable=False),
    Column("spec", JSON, nullable=False),
    Column("exit_code", Integer, nullable=True),
    Column("exit_signal", Integer, nullable=True),
    Column("restart_count", Integer, nullable=False, default=0),
    Column("attempt_id", IdType, nullable=True),  # current or last attempt
    Column("nodelist_run", JSON, nullable=True),  # nodes of the current/last attempt
    Column("launch_failures", Integer, nullable=False, default=0, server_default="0"),
    Column("avoid_nodes", JSON, nullable=True),  # nodes it failed on: not used again (soft)
    # Failed attempts retried so far under the retry policy (planned requeues do not count).
    Column("retries", Integer, nullable=False, default=0, server_default="0"),
    # Nodes held for a fast restart after a node failure (elastic and spare jobs), rank order,
    # until `reserved_until`: the scheduler gives them to this job before anyone else.
    Column("reserved_nodes", JSON, nullable=True),
    Column("reserved_until", Float, nullable=True),
    Column("checkpoint", JSON, nullable=True),  # the latest reported checkpoint
    # Fair share and limits (docs/fairshare.md): the account charged, the QOS, the nice value
    Column("account", String(64), nullable=True),
    Column("qos", String(64), nullable=True),
    Column("nice", Integer, nullable=False, default=0, server_default="0"),
    # Who placed the job's hold and its kind, while it is HELD (migration 0013): 'admin' (an
    # operator's or admin's: only they release it) or 'user' (the owner may); NULL: a user hold
    Column("held_by", String(128), nullable=True),
    Column("hold_kind", String(8), nullable=True),
    # Set by the database on every insert and update of the row (triggers of migration 0010,
    # never by the code): SQLite a counter, PostgreSQL the writing transaction's id. The
    # scheduling loop reads only the rows changed since its last pass (store/pending.py).
    Column("change_seq", BigInteger, nullable=True),
    sqlite_autoincrement=True,
)
# (state, id): the scheduler's whole read of the pending queue walks it in id order, in
# chunks (store/pending.py); SQLite's index carries the rowid anyway, PostgreSQL's needs it
Index("ix_jobs_state", jobs.c.state, jobs.c.id)
Index("ix_jobs_change_seq", jobs.c.change_seq)
Index("ix_jobs_end_time", jobs.c.end_time)  # the accounting purge (purge_finished)
Index("ix_jobs_array", jobs.c.array_job_id)
Index("ix_jobs_name_user", jobs.c.name, jobs.c.user)
# /metrics (store/metrics.py): jobs by state, partition and user, counted from the index alone
Index("ix_jobs_state_partitions_user", jobs.c.state, jobs.c.partitions, jobs.c.user)

attempts = Table(
    "attempts",
    metadata,
    Column("id", IdType, primary_key=True, autoincrement=True),
    Column("job_id", IdType, ForeignKey("jobs.id"), nullable=False),
    Column("seq", Integer, nullable=False),  # 0 for the first attempt: PHX_RESTART_COUNT
    Column("token", String(64), nullable=False, unique=True),
    Column("state", String(16), nullable=False),
    Column("partition", String(64), nullable=False),
    Column("nodes", JSON, nullable=False),  # names in rank order
    Column("fence_term", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("start_time", Float, nullable=True),
    Column("end_time", Float, nullable=True),
    Column("expected_end", Float, nullable=True),
    Column("stop_reason", Text, nullable=True),  # why it was asked to stop
    Column("result", String(16), nullable=True),  # the job state this attempt produced
    Column("exit_code", Integer, nullable=True),
    Column("exit_signal", Integer, nullable=True),
    Column("progress", JSON, nullable=True),  # the job's latest progress report: step, time
    # Signals asked of this attempt (scancel --signal): [{"seq", "signum", "target"}, ...] in
    # order; agents deliver each seq once and report the highest they delivered.
    Column("signals", JSON, nullable=True),
    # Fair share usage: charged up to `charged_until`; `uncharged` until the attempt has ended
    # and every second it held is charged (an index finds the few still open)
    Column("charged_until", Float, nullable=True),
    Column("uncharged", Boolean, nullable=False, default=True, server_default=true()),
    # --no-kill: the attempt's node changes while it runs (docs/elastic.md), null until the
    # first: {"gen": n, "changes": [{"gen", "at", "left", "joined", "nodes", "reason"}, ...]};
    # agents write it to the job's control file and report the gen they wrote (migration 0022)
    Column("membership", JSON, nullable=True),
    sqlite_autoincrement=True,
)
Index("ix_attempts_job", attempts.c.job_id)
Index("ix_attempts_uncharged", attempts.c.uncharged)
Index("ix_attempts_state", attempts.c.state)

# One row per node of an attempt: the resources it holds there and what that node reported.
tasks = Table(
    "tasks",
    metadata,
    Column("attempt_id", IdType, ForeignKey("attempts.id"), primary_key=True),
    Column("node", String(128), primary_key=True),
    Column("rank", Integer, nullable=False),
    Column("cpus", Integer, nullable=False),
    Column("mem_mb", Integer, nullable=False),
    Column("gpu_ids", JSON, nullable=False),
    Column("exclusive", Boolean, nullable=False),
    Column("state", String(16), nullable=False),
    Column("started_at", Float, nullable=True),
    Column("ended_at", Float, nullable=True),
    Column("exit_code", Integer, nullable=True),
    Column("exit_signal", Integer, nullable=True),
    Column("detail", JSON, nullable=True),  # the shepherd's exit record
    # A hot spare held with the allocation: holds resources, runs nothing, has no rank (-1).
    Column("spare", Boolean, nullable=False, default=False, server_default=false()),
    # What the task used, from its exit report (None: not measured, e.g. an old agent):
    # user + system CPU seconds, memory high-water mark, and NVML samples of its GPUs
    # ({"samples", "util_mean", "mem_peak_bytes", "per_gpu": {...}}).
    Column("cpu_time_s", Float, nullable=True),
    Column("max_rss_bytes", BigInteger, nullable=True),
    Column("gpu_usage", JSON, nullable=True),
    # True until the task's attempt ends (the attempt no longer holds anything): what a
    # heartbeat reads of its node, by the (node, held) index, without walking every task the
    # node ever ran (migration 0011).
    Column("held", Boolean, nullable=False, default=True, server_default=true()),
)
Index("ix_tasks_node_state", tasks.c.node, tasks.c.state)
Index("ix_tasks_node_held", tasks.c.node, tasks.c.held)

nodes = Table(
    "nodes",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("registered", Boolean, nullable=False, default=False),
    Column("cpus", Integer, nullable=False, default=0),
    Column("mem_mb", Integer, nullable=False, default=0),
    Column("gpus", JSON, nullable=False),  # [[index, type], ...]
    Column("features", JSON, nullable=False),
    Column("addr", String(256), nullable=True),
    Column("boot_id", String(64), nullable=True),
    Column("agent_version", String(32), nullable=True),
    Column("down", Boolean, nullable=False, default=False),
    Column("down_reason", Text, nullable=True),
    Column("drain", Boolean, nullable=False, default=False),
    Column("drain_reason", Text, nullable=True),
    Column("drain_by", String(128), nullable=True),
    Column("drain_time", Float, nullable=True),
    Column("registered_at", Float, nullable=True),
    Column("last_heartbeat", Float, nullable=True),
    Column("work_gen", Integer, nullable=False, default=0),  # bumped when its desired work changes
    Column("health", JSON, nullable=True),  # the agent's last health summary
    Column("launch_failures", Integer, nullable=False, default=0, server_default="0"),  # in a row
    # {level: domain} the agent reported (phalanx agent --topology); config rules win over it
    Column("topology", JSON, nullable=True),
    # host:port of the agent's step listener, told at registration (migration 0016)
    Column("steps_at", String(300), nullable=True),
    # the cluster configuration version whose node settings its agent runs, as it last said
    # in a heartbeat (migration 0021)
    Column("config_version", Integer, nullable=True),
)

partitions = Table(
    "partitions",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("is_default", Boolean, nullable=False),
    Column("nodes", String(1024), nullable=False),
    Column("default_time_s", Integer, nullable=True),
    Column("max_time_s", Integer, nullable=True),
    Column("priority", Integer, nullable=False, default=0),
)

events = Table(
    "events",
    metadata,
    Column("id", IdType, primary_key=True, autoincrement=True),
    Column("ts", Float, nullable=False),
    Column("kind", String(64), nullable=False),
    Column("job_id", IdType, nullable=True),
    Column("node", String(128), nullable=True),
    Column("actor", String(128), nullable=False),
    Column("controller", String(128), nullable=True),
    Column("term", Integer, nullable=True),
    Column("message", Text, nullable=False),
    Column("data", JSON, nullable=True),
    sqlite_autoincrement=True,
)
Index("ix_events_job", events.c.job_id)
Index("ix_events_node", events.c.node)

# SQLite's source of `jobs.change_seq` (migration 0010's triggers): one row, a counter that only
# grows. A stamp taken as the largest stamp plus one would repeat one after the row holding the
# largest was purged, below a mark the scheduler already read past. PostgreSQL stamps with
# transaction ids and leaves this table empty.
job_change_counter = Table(
    "job_change_counter",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("seq", BigInteger, nullable=False),
)

leases = Table(
    "leases",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("holder", String(128), nullable=True),
    Column("term", Integer, nullable=False, default=0),
    Column("expires_at", Float, nullable=False, default=0.0),
)

controllers = Table(
    "controllers",
    metadata,
    Column("id", String(128), primary_key=True),
    Column("url", String(256), nullable=True),
    Column("started_at", Float, nullable=False),
    Column("last_seen", Float, nullable=False),
    # database time through which every heartbeat it answered is stored (migration 0014)
    Column("flushed_through", Float, nullable=True),
    # the cluster configuration version it runs, and why it cannot run the current one
    # (it then takes no duties; migration 0020, store/configs.py)
    Column("config_version", Integer, nullable=True),
    Column("config_problem", Text, nullable=True),
    # what its own file sets of the values the configuration's rules read across sections
    # (JSON; config/versioned.py local_part), written when it registers (migration 0023)
    Column("local_settings", Text, nullable=True),
)

# The cluster-wide configuration, one row per version (config/versioned.py): the document as
# JSON text, who made it and how (create: the first controller's file on an empty store;
# apply; rollback: an older version's document applied again, `source` naming it). The
# current version is the highest; rows are never changed or deleted (migration 0020).
cluster_config = Table(
    "cluster_config",
    metadata,
    Column("version", Integer, primary_key=True, autoincrement=False),
    Column("document", Text, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("actor", String(128), nullable=False),
    Column("action", String(16), nullable=False),  # create | apply | rollback
    Column("parent", Integer, nullable=True),  # the version it replaced
    Column("source", Integer, nullable=True),  # rollback: the version restored
    Column("comment", Text, nullable=True),
)

# The torchrun rendezvous the controllers host (docs/elastic.md, store/rendezvous.py): per job
# attempt and rendezvous id (torchrun's --rdzv-id), the state torch's DynamicRendezvousHandler
# keeps (key "state", compare-and-set on `version`), its members' nodes (key "members") and
# the key-value store torch's agents use for a round ("kv/..." keys). A new attempt starts
# afresh: its rows are its own (migration 0022).
rendezvous = Table(
    "rendezvous",
    metadata,
    Column("job_id", IdType, primary_key=True, autoincrement=False),
    Column("attempt_id", IdType, primary_key=True, autoincrement=False),
    Column("run_id", String(128), primary_key=True),
    Column("key", String(512), primary_key=True),
    Column("value", LargeBinary, nullable=False),
    Column("version", Integer, nullable=False),
    Column("updated_at", Float, nullable=False),
)

# Maintenance windows: the nodes are kept free of jobs that would cross the window, drained for
# it (drain_by "maint:<id>") and returned after it. state: scheduled | active | done | removed.
maintenance = Table(
    "maintenance",
    metadata,
    Column("id", IdType, primary_key=True, autoincrement=True),
    Column("nodes_expr", String(1024), nullable=False),  # as the operator wrote it
    Column("nodes", JSON, nullable=False),  # expanded names
    Column("start", Float, nullable=False),
    Column("end", Float, nullable=False),
    Column("reason", Text, nullable=True),
    Column("state", String(16), nullable=False),
    Column("created_by", String(128), nullable=False),
    Column("created_at", Float, nullable=False),
    sqlite_autoincrement=True,
)
Index("ix_maintenance_state", maintenance.c.state)

# Reservations (`scontrol create reservation`, domain/reservations.py): nodes set aside from
# start to end for some users or accounts; only jobs asking for one run there meanwhile. A
# deleted reservation's row is deleted (its events stay); an ended one is ignored and replaced
# by a new one of the same name (migration 0018).
reservations = Table(
    "reservations",
    metadata,
    Column("id", IdType, primary_key=True, autoincrement=True),
    Column("name", String(128), nullable=False, unique=True),
    Column("nodes_expr", String(1024), nullable=False),  # as the operator wrote it (or picked)
    Column("nodes", JSON, nullable=False),  # expanded names
    Column("start", Float, nullable=False),
    Column("end", Float, nullable=False),
    Column("users", JSON, nullable=False),  # names, sorted
    Column("accounts", JSON, nullable=False),
    Column("flags", JSON, nullable=False),  # MAINT, OVERLAP, IGNORE_JOBS, SPEC_NODES
    Column("partition", String(128), nullable=True),
    Column("created_by", String(128), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("updated_by", String(128), nullable=True),
    Column("updated_at", Float, nullable=True),
    # scheduled, active, ended, closed: how far the cluster duty took it (migration 0021;
    # domain/reservations.py, Phase)
    Column("phase", String(16), nullable=False, default="scheduled", server_default="scheduled"),
    sqlite_autoincrement=True,
)

# Job steps (`srun` inside an allocation): numbered per attempt (0, 1, ...), shown as JOBID.N.
# state: RUNNING (asked to start or started), then COMPLETED / FAILED / CANCELLED / NODE_FAIL /
# TIMEOUT / OUT_OF_MEMORY. `spec` is what the nodes need to start its tasks (argv, env, layout,
# where its srun listens, with the step's cookie); `signals`: requests for its tasks, in order.
steps = Table(
    "steps",
    metadata,
    Column("attempt_id", IdType, ForeignKey("attempts.id"), primary_key=True),
    Column("step_id", Integer, primary_key=True, autoincrement=False),
    Column("job_id", IdType, ForeignKey("jobs.id"), nullable=False),
    Column("name", String(256), nullable=False),
    Column("state", String(16), nullable=False),
    Column("nodes", JSON, nullable=False),  # names, in node order
    Column("tasks", JSON, nullable=False),  # tasks per node, same order
    Column("spec", JSON, nullable=False),
    Column("signals", JSON, nullable=False),  # [{"seq": n, "signum": s}]
    Column("stop_reason", Text, nullable=True),
    Column("created_at", Float, nullable=False),
    Column("start_time", Float, nullable=True),
    Column("end_time", Float, nullable=True),
    Column("exit_code", Integer, nullable=True),
    Column("exit_signal", Integer, nullable=True),
    Column("usage", JSON, nullable=True),  # its tasks' CPU time and largest RSS (0017)
)
Index("ix_steps_job", steps.c.job_id)

# One row per node of a step: what that node's agent reported about its tasks there.
step_nodes = Table(
    "step_nodes",
    metadata,
    Column("attempt_id", IdType, primary_key=True),
    Column("step_id", Integer, primary_key=True, autoincrement=False),
    Column("node", String(128), primary_key=True),
    Column("state", String(16), nullable=False),  # STARTING RUNNING EXITED LOST
    Column("started_at", Float, nullable=True),
    Column("ended_at", Float, nullable=True),
    Column("exits", JSON, nullable=True),  # per task: the shepherd's exit record
)
Index("ix_step_nodes_node_state", step_nodes.c.node, step_nodes.c.state)

# Fair share usage per user association (account, user), decayed with the half-life: `usage`
# is the decayed charge as of `decayed_at`; each charging pass decays it to its own time and
# adds what running and ended attempts held since (docs/fairshare.md).
assoc_usage = Table(
    "assoc_usage",
    metadata,
    Column("account", String(64), primary_key=True),
    Column("user", String(128), primary_key=True),
    Column("usage", Float, nullable=False),
    Column("decayed_at", Float, nullable=False),
)

# Accounts, user associations and QOS (`sacctmgr`; domain/accounts.py, store/accounts.py): the
# fair share tree and the limits, changed at run time. `seq` keeps the order they were added
# (the configuration's order for the first import). Limits: NULL is none.
acct_accounts = Table(
    "acct_accounts",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("seq", Integer, nullable=False),
    Column("parent", String(64), nullable=False),  # "root": top level
    Column("shares", Integer, nullable=False),
    Column("description", String(256), nullable=False),
    Column("organization", String(256), nullable=False),
    Column("max_running_jobs", Integer, nullable=True),
    Column("max_submit_jobs", Integer, nullable=True),
    Column("max_gpus", Integer, nullable=True),
    Column("max_wall_s", Integer, nullable=True),
    Column("updated_by", String(128), nullable=False),
    Column("updated_at", Float, nullable=False),
)
acct_users = Table(
    "acct_users",
    metadata,
    Column("account", String(64), primary_key=True),
    Column("user", String(128), primary_key=True),
    Column("seq", Integer, nullable=False),
    Column("shares", Integer, nullable=False),
    Column("default", Boolean, nullable=False),  # the user's default account (one per user)
    Column("max_running_jobs", Integer, nullable=True),
    Column("max_submit_jobs", Integer, nullable=True),
    Column("max_gpus", Integer, nullable=True),
    Column("max_wall_s", Integer, nullable=True),
    Column("updated_by", String(128), nullable=False),
    Column("updated_at", Float, nullable=False),
)
acct_qos = Table(
    "acct_qos",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("seq", Integer, nullable=False),
    Column("description", String(256), nullable=False),
    Column("priority", Integer, nullable=False),
    Column("priority_tier", Integer, nullable=True),
    Column("preempt_mode", String(16), nullable=True),  # requeue | cancel | off
    Column("max_running_jobs", Integer, nullable=True),
    Column("max_submit_jobs", Integer, nullable=True),
    Column("max_gpus", Integer, nullable=True),
    Column("max_wall_s", Integer, nullable=True),
    Column("updated_by", String(128), nullable=False),
    Column("updated_at", Float, nullable=False),
)
# One row (id 1) once the first tree was imported: `version` goes up with every change, so a
# controller re-reads the tables only when it moved; `declared`: a tree was declared (else any
# --account is accepted); `digest`: the imported file's tree, to warn when the file changed.
acct_meta = Table(
    "acct_meta",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("version", BigInteger, nullable=False),
    Column("declared", Boolean, nullable=False),
    Column("digest", String(64), nullable=False),
    Column("imported_by", String(128), nullable=False),
    Column("imported_at", Float, nullable=False),
)
