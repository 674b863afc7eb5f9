"""The thin ``srun``: hand the step to the job's resident helper (srun/helper.py) when there is one.

A loop of ``srun true`` pays srun's start-up on every step, and most of it is imports (the
HTTP client, ``json``, ``argparse``, ``ssl`` through ``http.client``: ~100 ms of CPU a step on
a 2-core node, more than the step itself).  So inside a job, srun first tries the job's helper,
a long-lived process on this node (started by the job's first full srun) listening on
``$TMPDIR/.phx-srun-JOBID.sock``: this module sends it srun's arguments, environment and
directory, and passes it srun's own stdin, stdout and stderr (``SCM_RIGHTS``), so the helper
writes the tasks' output straight where srun's would go (and forwards that stdin to them).  Before sending anything it asks the kernel
who listens there (``SO_PEERCRED``): a helper of another uid than the caller's or root's (a
socket planted in a TMPDIR shared with others) gets nothing, and the full srun runs.  It then waits for one line, ``exit N``,
forwarding SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 to the helper as they come.

Only built-in modules are imported here (``_socket``, ``_signal``), none of them pulling in
``re`` or ``enum``.  Whenever the helper cannot run the step as the full srun would (no helper,
an option it refuses, a different controller or credential in the environment), it answers
``fallback`` before doing anything, and the caller runs the full srun (srun.py) in-process.
"""

from __future__ import annotations

import os
import sys

SOCKET_NAME = ".phx-srun-{job}.sock"
FORWARDED = (2, 15, 10, 12)  # SIGINT, SIGTERM, SIGUSR1, SIGUSR2 (Linux numbers)
PROTOCOL = b"srun1"
# the environment the helper was started with must match the caller's in these, else the
# full srun runs (another controller, another identity, another address for the tasks)
SAME_ENV = (
    "SLURM_JOB_ID",
    "PHX_JOB_ID",
    "PHALANX_URL",
    "PHALANX_TOKEN",
    "PHALANX_TOKEN_FILE",
    "PHALANX_AUTH_SOCKET",
    "PHALANX_CA_FILE",
    "PHX_SRUN_HOST",
    "TMPDIR",
)
NO_HELPER_ENV = "PHX_SRUN_NO_HELPER"  # set (to anything) to always run the full srun
ATTACH_ENV = "PHX_SRUN_ATTACH"  # srun.ATTACH_ENV: the batch step of an outer srun's job


def socket_path(env: dict[str, str] | os._Environ[str] | None = None) -> str | None:
    """Where this job's helper listens on this node, or None where srun runs without one."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID") or env.get("PHX_JOB_ID")
    tmp = env.get("TMPDIR")
    if not job or not tmp or env.get(ATTACH_ENV) or env.get(NO_HELPER_ENV):
        return None
    if not job.isdecimal():
        return None
    return f"{tmp}/{SOCKET_NAME.format(job=job)}"


def main(argv: list[str]) -> int | None:
    """Run srun through the job's helper: its exit status, or None when the caller must run
    the full srun (nothing has been started then)."""
    path = socket_path()
    if path is None:
        return None
    import _socket

    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    try:
        if not _helper_is_ours(sock, path):
            return None
        return _talk(sock, argv)
    finally:
        sock.close()


def peer_uid(sock: object) -> int:
    """The uid of the process on the other end of a Unix socket, from the kernel
    (SO_PEERCRED: for a listening socket, whoever called listen)."""
    import _socket

    raw = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)  # type: ignore[attr-defined]
    return int.from_bytes(raw[4:8], sys.byteorder)  # struct ucred {pid, uid, gid}


def _helper_is_ours(sock: object, path: str) -> bool:
    """Whether the helper listening at `path` is this user's (or root's): srun hands it its
    environment and its stdout and stderr, so a socket another user planted there (a TMPDIR
    shared with others) must get nothing.  Says so when it is not."""
    try:
        uid = peer_uid(sock)
    except OSError as e:
        os.write(2, f"srun: error: cannot tell who serves {path} ({e}): not using it\n".encode())
        return False
    me = os.getuid()
    if uid in (me, 0):
        return True
    os.write(
        2,
        f"srun: error: {path} is served by uid {uid}, not by you (uid {me}) or root: not "
        f"handing it the step (a socket planted in a shared TMPDIR?); running srun without "
        f"the job's helper\n".encode(),
    )
    return False


def _talk(sock: object, argv: list[str]) -> int | None:
    import _signal

    fields = [PROTOCOL, os.getcwd().encode(), str(len(argv)).encode()]
    fields += [os.fsencode(a) for a in argv]
    fields += [k + b"=" + v for k, v in os.environb.items()]
    payload = b"\0".join(fields)
    try:
        os.fstat(0)
        fds: tuple[int, ...] = (0, 1, 2)
    except OSError:  # no stdin: the helper takes that as /dev/null
        fds = (1, 2)
    rights = b"".join(fd.to_bytes(4, sys.byteorder) for fd in fds)
    head = PROTOCOL + b" " + str(len(payload)).encode() + b"\n"
    try:
        sock.sendmsg([head], [(1, 1, rights)])  # type: ignore[attr-defined]  # SCM_RIGHTS
        sock.sendall(payload)  # type: ignore[attr-defined]
    except OSError:  # the helper closed: refused us (srun/helper.py), or is going away
        try:
            line = sock.recv(4096).split(b"\n", 1)[0]  # type: ignore[attr-defined]
        except OSError:
            line = b""
        if line.startswith(b"refused "):
            os.write(2, b"srun: error: the job's srun helper " + line + b"\n")
        return None  # it took nothing: the full srun runs the step

    def forward(signum: int, _frame: object) -> None:
        try:  # noqa: SIM105  (no contextlib: this module imports built-ins only)
            sock.sendall(b"sig " + str(signum).encode() + b"\n")  # type: ignore[attr-defined]
        except OSError:
            pass

    old = {s: _signal.signal(s, forward) for s in FORWARDED}
    accepted = False
    data = b""
    try:
        while True:
            chunk = sock.recv(4096)  # type: ignore[attr-defined]
            if not chunk:
                break
            data += chunk
            while b"\n" in data:
                line, data = data.split(b"\n", 1)
                if line == b"ok":
                    accepted = True
                elif line == b"fallback":
                    return None
                elif line.startswith(b"refused "):  # not this user's helper (srun/helper.py)
                    os.write(2, b"srun: error: the job's srun helper " + line + b"\n")
                    return None
                elif line.startswith(b"exit "):
                    return int(line[5:])
    finally:
        for s, h in old.items():
            _signal.signal(s, h)
    if not accepted:
        return None  # the helper went away before it took the step: run it ourselves
    os.write(2, b"srun: error: lost the job's srun helper while the step ran\n")
    return 1


def start_helper() -> None:
    """Start this job's helper on this node (no-op where srun runs without one): a detached
    ``python -m phalanx.slurm.srun.helper``, in the job's process group so it ends with the job,
    with none of this srun's descriptors (a caller's pipe would never see its end)."""
    path = socket_path()
    if path is None:
        return
    import subprocess

    try:  # noqa: SIM105
        subprocess.Popen(
            [sys.executable, "-m", "phalanx.slurm.srun.helper", path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            cwd="/",
        )
    except OSError:
        pass  # srun works without it, only slower
