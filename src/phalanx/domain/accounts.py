"""Accounts, user associations and QOS as data (`sacctmgr`): the tree the store holds, the
changes an administrator makes to it, and the rules every change is checked against.

Pure: the store reads the rows into a `Tree`, asks `add`/`modify`/`delete` for the new tree
and the changes in words, and writes the difference (store/accounts.py); the controller reads
the tree for fair share, limits and submit checks (controller/fairshare.py). The first tree
is the configuration file's `[fairshare]` (`from_config`).

Every refusal is an `AcctError` whose message says what was wrong and what to do; `conflict`
marks those about the cluster's state (something exists, something is in use) rather than a
bad value.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from phalanx.domain import fairshare as fs
from phalanx.domain import limits as lim

ROOT = fs.ROOT
KINDS = ("account", "user", "qos")
LIMITS = ("max_running_jobs", "max_submit_jobs", "max_gpus", "max_wall_s")
PREEMPT_MODES = ("requeue", "cancel", "off")
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
USER_RE = re.compile(r"^[A-Za-z0-9_.@-]{1,128}$")
MAX_SHARES = 1_000_000_000
MAX_COUNT = 2**31 - 1
MAX_WALL_S = 68 * 365 * 86400
TEXT_MAX = 256

# what each kind may set (add and modify alike)
SETTINGS = {
    "account": ("parent", "shares", "description", "organization", *LIMITS),
    "user": ("shares", "default_account", *LIMITS),
    "qos": ("description", "priority", "priority_tier", "preempt_mode", *LIMITS),
}
# what a `where` may name, per kind
WHERE = {
    "account": ("names", "parents"),
    "user": ("names", "accounts"),
    "qos": ("names",),
}


class AcctError(ValueError):
    """A change refused; `conflict`: because of what exists or runs (409), else a bad value
    (422); `missing`: nothing matched (404)."""

    def __init__(self, message: str, *, conflict: bool = False, missing: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.conflict = conflict
        self.missing = missing


@dataclass(frozen=True, kw_only=True)
class Limited:
    """The limits an account, a user association or a QOS may carry (docs/fairshare.md)."""

    max_running_jobs: int | None = None
    max_submit_jobs: int | None = None
    max_gpus: int | None = None
    max_wall_s: int | None = None

    def limit(self) -> lim.Limit:
        return lim.Limit(
            max_running_jobs=self.max_running_jobs,
            max_submit_jobs=self.max_submit_jobs,
            max_gpus=self.max_gpus,
            max_wall_s=self.max_wall_s,
        )

    def has_limit(self) -> bool:
        return any(getattr(self, k) is not None for k in LIMITS)


@dataclass(frozen=True, kw_only=True)
class Account(Limited):
    name: str
    parent: str = ROOT
    shares: int = 1
    description: str = ""
    organization: str = ""


@dataclass(frozen=True, kw_only=True)
class Assoc(Limited):
    """A user association: `user` may charge `account`; `default`: the account of the user's
    jobs that name none (each user with an association has exactly one)."""

    user: str
    account: str
    shares: int = 1
    default: bool = False


@dataclass(frozen=True, kw_only=True)
class Qos(Limited):
    name: str
    description: str = ""
    priority: int = 0
    priority_tier: int | None = None
    preempt_mode: str | None = None


def row_of(x: Account | Assoc | Qos) -> dict[str, Any]:
    return asdict(x)


def _from_row(cls: Any, row: Mapping[str, Any]) -> Any:
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in row.items() if k in names})


@dataclass(frozen=True)
class Tree:
    """The accounts (in the order they were added), user associations keyed (account, user),
    QOS; `declared`: a tree was declared (else any `--account` a job names is accepted, as a
    top-level account: the default configuration's behaviour); `version`: the store's change
    counter it was read at."""

    accounts: Mapping[str, Account] = field(default_factory=dict)
    assocs: Mapping[tuple[str, str], Assoc] = field(default_factory=dict)
    qos: Mapping[str, Qos] = field(default_factory=dict)
    declared: bool = True
    version: int = 0

    @classmethod
    def from_rows(
        cls,
        accounts: Iterable[Mapping[str, Any]],
        users: Iterable[Mapping[str, Any]],
        qos: Iterable[Mapping[str, Any]],
        *,
        declared: bool,
        version: int,
    ) -> Tree:
        a = [_from_row(Account, r) for r in accounts]
        u = [_from_row(Assoc, r) for r in users]
        q = [_from_row(Qos, r) for r in qos]
        return cls(
            {x.name: x for x in a},
            {(x.account, x.user): x for x in u},
            {x.name: x for x in q},
            declared,
            version,
        )

    # ------------------------------------------------------------------ reading
    def users(self) -> list[str]:
        return list(dict.fromkeys(a.user for a in self.assocs.values()))

    def accounts_of(self, user: str) -> list[str]:
        """The user's accounts, default first; [] if the user is in none."""
        mine = [a for a in self.assocs.values() if a.user == user]
        mine.sort(key=lambda a: not a.default)
        return [a.account for a in mine]

    def default_of(self, user: str) -> str | None:
        mine = self.accounts_of(user)
        return mine[0] if mine else None

    def tree_accounts(self) -> list[fs.Account]:
        return [fs.Account(a.name, a.parent, a.shares) for a in self.accounts.values()]

    def members(self) -> list[fs.Member]:
        return [fs.Member(a.user, a.account, a.shares) for a in self.assocs.values()]

    def limits(self) -> lim.Limits:
        return lim.Limits(
            accounts={a.name: a.limit() for a in self.accounts.values() if a.has_limit()},
            assocs={k: a.limit() for k, a in self.assocs.items() if a.has_limit()},
            qos={q.name: q.limit() for q in self.qos.values() if q.has_limit()},
            parents={a.name: a.parent for a in self.accounts.values()},
        )

    def submit_limited(self) -> bool:
        return any(
            x.max_submit_jobs is not None
            for x in [*self.accounts.values(), *self.assocs.values(), *self.qos.values()]
        )

    def children(self, account: str) -> list[str]:
        return [a.name for a in self.accounts.values() if a.parent == account]

    def lineage(self, account: str) -> list[str]:
        """The account's parents up to root, nearest first (root included)."""
        out = []
        a = self.accounts.get(account)
        while a is not None and a.parent not in out:
            out.append(a.parent)
            a = self.accounts.get(a.parent)
        return out

    def digest(self) -> str:
        """A fingerprint of the tree's content (not its version): to tell whether the
        configuration file's tree is the one imported."""
        body = {
            "accounts": [row_of(a) for a in self.accounts.values()],
            "users": [row_of(a) for a in self.assocs.values()],
            "qos": [row_of(q) for q in self.qos.values()],
            "declared": self.declared,
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ checking
    def validate(self) -> None:
        """Raise AcctError naming the first rule broken (the configuration's rules: no
        duplicate, a parent that is an account, no cycle, users in declared accounts, shares
        of at least 1, each user with one default account)."""
        try:
            fs.validate_tree(self.tree_accounts(), self.members())
        except ValueError as e:
            raise AcctError(str(e)) from None
        defaults: dict[str, int] = {}
        for a in self.assocs.values():
            defaults[a.user] = defaults.get(a.user, 0) + int(a.default)
        for user, n in defaults.items():
            if n != 1:
                raise AcctError(f"user {user!r} has {n} default accounts: exactly one is needed")


# ---------------------------------------------------------------------- the first import
def from_config(cfg: Any) -> Tree:
    """The tree of a configuration's `[fairshare]` (config/policy.FairShareConfig): its
    accounts (the default account added when not declared), users (a user's first listed
    association is their default unless one says `default = true`) and QOS (the default QOS
    added when not declared)."""
    accounts = {}
    for a in cfg.all_accounts():
        accounts[a.name] = Account(
            name=a.name,
            parent=a.parent,
            shares=a.shares,
            description=a.name,
            organization=a.name if a.parent == ROOT else "",
            **_limits_of(a),
        )
    for name, a in accounts.items():  # Slurm: an account's organization is its parent's
        if not a.organization:
            accounts[name] = replace(a, organization=_org(accounts, a.parent))
    explicit = {u.name for u in cfg.users if u.default}
    seen: set[str] = set()
    assocs = {}
    for u in cfg.users:
        default = u.default if u.name in explicit else u.name not in seen
        seen.add(u.name)
        assocs[(u.account, u.name)] = Assoc(
            user=u.name, account=u.account, shares=u.shares, default=default, **_limits_of(u)
        )
    qos = {}
    for q in cfg.all_qos():
        qos[q.name] = Qos(
            name=q.name,
            description=q.name,
            priority=q.priority,
            priority_tier=q.priority_tier,
            preempt_mode=q.preempt_mode,
            **_limits_of(q),
        )
    return Tree(accounts, assocs, qos, declared=bool(cfg.accounts))


def _limits_of(c: Any) -> dict[str, Any]:
    return {
        "max_running_jobs": c.max_running_jobs,
        "max_submit_jobs": c.max_submit_jobs,
        "max_gpus": c.max_gpus,
        "max_wall_s": c.max_wall_s(),
    }


def _org(accounts: Mapping[str, Account], parent: str) -> str:
    seen = set()
    while parent != ROOT and parent in accounts and parent not in seen:
        seen.add(parent)
        a = accounts[parent]
        if a.organization:
            return a.organization
        parent = a.parent
    return parent


# ---------------------------------------------------------------------- values
def check_settings(kind: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings checked and typed (None clears a limit); AcctError names a key this kind
    does not have or a value that is not what the key takes."""
    if kind not in KINDS:
        raise AcctError(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")
    out: dict[str, Any] = {}
    for key, value in settings.items():
        if key not in SETTINGS[kind]:
            raise AcctError(
                f"a {kind} has no setting {key!r} (a {kind} takes: {', '.join(SETTINGS[kind])})"
            )
        out[key] = _value(key, value)
    return out


def _int(key: str, value: Any, lo: int, hi: int, *, clearable: bool) -> int | None:
    if value is None and clearable:
        return None
    if isinstance(value, str):
        text = value.strip()
        if clearable and text in ("-1", ""):
            return None
        try:
            value = int(text)
        except ValueError:
            raise AcctError(f"{key}={value!r}: not a number") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise AcctError(f"{key}={value!r}: not a whole number")
    if clearable and value == -1:
        return None
    if not lo <= value <= hi:
        raise AcctError(
            f"{key}={value}: must be from {lo} to {hi}" + (" (-1: no limit)" if clearable else "")
        )
    return value


def _value(key: str, value: Any) -> Any:
    if key == "shares":
        return _int(key, value, 1, MAX_SHARES, clearable=False)
    if key in ("max_running_jobs", "max_submit_jobs", "max_gpus"):
        return _int(key, value, 0, MAX_COUNT, clearable=True)
    if key == "max_wall_s":
        return _int(key, value, 1, MAX_WALL_S, clearable=True)
    if key == "priority":
        return _int(key, value, 0, MAX_SHARES, clearable=False)
    if key == "priority_tier":
        return _int(key, value, 0, 65533, clearable=True)
    if key == "preempt_mode":
        if value is None or str(value).strip().lower() in ("", "cluster", "-1"):
            return None
        mode = str(value).strip().lower()
        if mode not in PREEMPT_MODES:
            raise AcctError(f"preempt_mode={value!r}: one of {', '.join(PREEMPT_MODES)}")
        return mode
    if key in ("parent", "default_account"):
        text = str(value).strip() if value is not None else ""
        if key == "parent" and text == ROOT:
            return ROOT
        if not NAME_RE.fullmatch(text):
            raise AcctError(f"{key}={value!r}: an account name (letters, digits, _ . -)")
        return text
    # description, organization
    text = "" if value is None else str(value)
    if len(text) > TEXT_MAX or any(ord(c) < 32 for c in text):
        raise AcctError(f"{key}: at most {TEXT_MAX} characters, no control characters")
    return text


def check_name(kind: str, name: str) -> str:
    pattern = USER_RE if kind == "user" else NAME_RE
    if not pattern.fullmatch(name or ""):
        what = "user name" if kind == "user" else f"{kind} name"
        raise AcctError(f"{name!r} is not a valid {what} (letters, digits, _ . - only)")
    if kind == "account" and name == ROOT:
        raise AcctError(f"'{ROOT}' is the account tree's root; it always exists")
    return name


# ---------------------------------------------------------------------- changes
@dataclass(frozen=True)
class Change:
    """One record changed, in words: what (add, modify, delete), its kind, its key and, for
    add and modify, the settings given."""

    what: str
    kind: str
    key: tuple[str, ...]
    settings: Mapping[str, Any] = field(default_factory=dict)

    def name(self) -> str:
        if self.kind == "user":
            return f"user {self.key[1]} in account {self.key[0]}"
        return f"{'QOS' if self.kind == 'qos' else 'account'} {self.key[0]}"

    def text(self) -> str:
        verb = {"add": "added", "modify": "changed", "delete": "deleted"}[self.what]
        said = ", ".join(f"{k}={_say(v)}" for k, v in self.settings.items())
        return f"{self.name()} {verb}" + (f" ({said})" if said else "")

    def as_dict(self) -> dict[str, Any]:
        return {"what": self.what, "kind": self.kind, "key": list(self.key),
                "settings": dict(self.settings), "text": self.text()}  # fmt: skip


def _say(v: Any) -> str:
    return "none" if v is None else str(v)


@dataclass(frozen=True)
class Result:
    tree: Tree
    changes: list[Change]
    skipped: list[str] = field(default_factory=list)  # what `add` found already there


def add(
    tree: Tree,
    kind: str,
    names: Sequence[str],
    settings: Mapping[str, Any],
    *,
    accounts: Sequence[str] = (),
) -> Result:
    """Add accounts, QOS, or users to `accounts` (a user's first association becomes their
    default, or the one `default_account` names). What exists is skipped; nothing new at all
    is refused (`sacctmgr`'s "Nothing new added")."""
    settings = check_settings(kind, settings)
    if not names:
        raise AcctError(f"give the name of the {kind} to add")
    for n in names:
        check_name(kind, n)
    if kind == "account":
        return _add_accounts(tree, names, settings)
    if kind == "qos":
        return _add_qos(tree, names, settings)
    return _add_users(tree, names, accounts, settings)


def _add_accounts(tree: Tree, names: Sequence[str], settings: dict[str, Any]) -> Result:
    new = dict(tree.accounts)
    changes, skipped = [], []
    parent = settings.get("parent", ROOT)
    if parent != ROOT and parent not in new:
        raise AcctError(
            f"Parent account {parent!r} doesn't exist: add it first (`sacctmgr add account "
            f"{parent}`), or give an existing one (`sacctmgr show account` lists them)"
        )
    for n in dict.fromkeys(names):
        if n in new:
            skipped.append(f"account {n} already exists")
            continue
        s = {"parent": parent, **settings}
        s.setdefault("description", n)
        s.setdefault("organization", n if parent == ROOT else _org(new, parent))
        new[n] = Account(name=n, **s)
        changes.append(Change("add", "account", (n,), s))
    return _done(tree, replace(tree, accounts=new, declared=True), changes, skipped)


def _add_qos(tree: Tree, names: Sequence[str], settings: dict[str, Any]) -> Result:
    new = dict(tree.qos)
    changes, skipped = [], []
    for n in dict.fromkeys(names):
        if n in new:
            skipped.append(f"QOS {n} already exists")
            continue
        s = dict(settings)
        s.setdefault("description", n)
        new[n] = Qos(name=n, **s)
        changes.append(Change("add", "qos", (n,), s))
    return _done(tree, replace(tree, qos=new), changes, skipped)


def _add_users(
    tree: Tree, names: Sequence[str], accounts: Sequence[str], settings: dict[str, Any]
) -> Result:
    default = settings.pop("default_account", None)
    accounts = list(dict.fromkeys(accounts or ([default] if default else [])))
    if not accounts:
        raise AcctError(
            "give the user's account: `sacctmgr add user NAME account=ACCOUNT` "
            "(or DefaultAccount=ACCOUNT)"
        )
    if default is not None and default not in accounts:
        accounts.append(default)
    unknown = [a for a in accounts if a not in tree.accounts]
    if unknown:
        raise AcctError(
            f"Account {unknown[0]!r} doesn't exist: add it first (`sacctmgr add account "
            f"{unknown[0]}`) or give an existing one (`sacctmgr show account` lists them)"
        )
    new = dict(tree.assocs)
    changes, skipped = [], []
    for user in dict.fromkeys(names):
        had = [a for (a, u) in new if u == user]
        for acct in accounts:
            if (acct, user) in new:
                skipped.append(f"user {user} is already in account {acct}")
                continue
            first = not had and acct == (default or accounts[0])
            new[(acct, user)] = Assoc(user=user, account=acct, default=first, **settings)
            changes.append(Change("add", "user", (acct, user), settings))
        if default is not None and had:
            new = _set_default(new, user, default)
    return _done(tree, replace(tree, assocs=new), changes, skipped)


def _set_default(
    assocs: Mapping[tuple[str, str], Assoc], user: str, account: str
) -> dict[tuple[str, str], Assoc]:
    out = dict(assocs)
    if (account, user) not in out:
        raise AcctError(
            f"user {user} is not in account {account}: add them first (`sacctmgr add user "
            f"{user} account={account}`)"
        )
    for key, a in out.items():
        if a.user == user and a.default != (a.account == account):
            out[key] = replace(a, default=a.account == account)
    return out


def _done(old: Tree, new: Tree, changes: list[Change], skipped: list[str]) -> Result:
    if not changes:
        raise AcctError("Nothing new added: " + "; ".join(skipped), conflict=True)
    new.validate()
    return Result(new, changes, skipped)


def select(tree: Tree, kind: str, where: Mapping[str, Sequence[str]]) -> list[tuple[str, ...]]:
    """The keys of the records `where` matches (every condition given must hold; a list
    matches any of its values). An empty `where` matches everything."""
    for k in where:
        if k not in WHERE.get(kind, ()):
            raise AcctError(
                f"a {kind} cannot be selected by {k!r} (by: {', '.join(WHERE.get(kind, ()))})"
            )
    names = set(where.get("names") or ())
    if kind == "account":
        parents = set(where.get("parents") or ())
        return [
            (a.name,)
            for a in tree.accounts.values()
            if (not names or a.name in names) and (not parents or a.parent in parents)
        ]
    if kind == "qos":
        return [(q.name,) for q in tree.qos.values() if not names or q.name in names]
    accts = set(where.get("accounts") or ())
    return [
        key
        for key, a in tree.assocs.items()
        if (not names or a.user in names) and (not accts or a.account in accts)
    ]


def _nothing(kind: str, where: Mapping[str, Sequence[str]], verb: str) -> AcctError:
    said = " ".join(f"{k}={','.join(v)}" for k, v in where.items() if v) or "(everything)"
    listing = {"account": "account", "user": "assoc", "qos": "qos"}[kind]
    return AcctError(
        f"Nothing {verb}: no {kind} matches {said} (`sacctmgr show {listing}` lists them)",
        missing=True,
    )


def modify(
    tree: Tree, kind: str, where: Mapping[str, Sequence[str]], settings: Mapping[str, Any]
) -> Result:
    """Set `settings` on every record `where` matches."""
    settings = check_settings(kind, settings)
    if not settings:
        raise AcctError(f"nothing to set: `sacctmgr modify {kind} where ... set KEY=VALUE`")
    keys = select(tree, kind, where)
    if not keys:
        raise _nothing(kind, where, "modified")
    changes = [Change("modify", kind, k, settings) for k in keys]
    if kind == "account":
        parent = settings.get("parent")
        if parent is not None and parent != ROOT and parent not in tree.accounts:
            raise AcctError(
                f"Parent account {parent!r} doesn't exist (`sacctmgr show account` lists them)"
            )
        accts = dict(tree.accounts)
        for (n,) in keys:
            accts[n] = replace(accts[n], **settings)
        return _checked(replace(tree, accounts=accts), changes)
    if kind == "qos":
        qos = dict(tree.qos)
        for (n,) in keys:
            qos[n] = replace(qos[n], **settings)
        return _checked(replace(tree, qos=qos), changes)
    plain = {k: v for k, v in settings.items() if k != "default_account"}
    assocs = dict(tree.assocs)
    for account, user in keys:
        assocs[(account, user)] = replace(assocs[(account, user)], **plain)
    if "default_account" in settings:
        for user in dict.fromkeys(k[1] for k in keys):
            assocs = _set_default(assocs, user, settings["default_account"])
    return _checked(replace(tree, assocs=assocs), changes)


def _checked(tree: Tree, changes: list[Change]) -> Result:
    tree.validate()
    return Result(tree, changes)


def delete(
    tree: Tree,
    kind: str,
    where: Mapping[str, Sequence[str]],
    *,
    keep: Mapping[str, str] | None = None,
) -> Result:
    """Delete what `where` matches. Refused: an account with users or sub-accounts left, the
    configuration's default account or QOS (`keep`: kind -> name). A user's default account
    deleted, their next account becomes the default. (Jobs still charging what is deleted
    are checked by the store, which sees them.)"""
    keep = keep or {}
    keys = select(tree, kind, where)
    if not keys:
        raise _nothing(kind, where, "deleted")
    changes = [Change("delete", kind, k) for k in keys]
    if kind in ("account", "qos") and keep.get(kind) in {k[0] for k in keys}:
        name = keep[kind]
        what = "default_account" if kind == "account" else "default_qos"
        raise AcctError(
            f"{'account' if kind == 'account' else 'QOS'} {name} is the configuration's "
            f"fairshare.{what}, which jobs that name none are charged to: it cannot be deleted",
            conflict=True,
        )
    if kind == "account":
        gone = {k[0] for k in keys}
        for name in sorted(gone):
            users = [a.user for a in tree.assocs.values() if a.account == name]
            subs = [c for c in tree.children(name) if c not in gone]
            if users or subs:
                parts = []
                if users:
                    parts.append(f"users {', '.join(users)}")
                if subs:
                    parts.append(f"sub-accounts {', '.join(subs)}")
                todo = []
                if users:
                    todo.append(f"`sacctmgr delete user where account={name}`")
                if subs:
                    todo.append(f"`sacctmgr delete account {','.join(subs)}`")
                raise AcctError(
                    f"account {name} still has {' and '.join(parts)}: delete or move them "
                    f"first ({', then '.join(todo)})",
                    conflict=True,
                )
        accts = {n: a for n, a in tree.accounts.items() if n not in gone}
        return _checked(replace(tree, accounts=accts), changes)
    if kind == "qos":
        gone = {k[0] for k in keys}
        return _checked(
            replace(tree, qos={n: q for n, q in tree.qos.items() if n not in gone}), changes
        )
    assocs = {k: a for k, a in tree.assocs.items() if k not in set(keys)}
    for user in dict.fromkeys(k[1] for k in keys):
        left = [a for a in assocs.values() if a.user == user]
        if left and not any(a.default for a in left):
            assocs = _set_default(assocs, user, left[0].account)
    return _checked(replace(tree, assocs=assocs), changes)
