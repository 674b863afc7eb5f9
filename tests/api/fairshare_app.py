"""What the fair share and accounts API tests share: the `[fairshare]` they start from (two
accounts under phys, bio, users with limits, two QOS) and a plain job. The app over it is the
`fs_client` fixture of tests/api/conftest.py."""

from __future__ import annotations

from typing import Any

FAIRSHARE: dict[str, Any] = {
    "open": False,
    "accounts": [
        {"name": "phys", "shares": 2},
        {"name": "hep", "parent": "phys", "shares": 1, "max_submit_jobs": 3},
        {"name": "bio", "shares": 1},
    ],
    "users": [
        {"name": "alice", "account": "hep"},
        {"name": "alice", "account": "bio", "default": True},
        {"name": "bob", "account": "bio", "max_submit_jobs": 1},
    ],
    "qos": [{"name": "normal"}, {"name": "urgent", "priority": 100}],
}
JOB: dict[str, Any] = {"argv": ["/bin/true"]}
