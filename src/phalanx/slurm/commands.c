/*
 * The compiled Slurm commands (sbatch, squeue, scancel, sinfo, scontrol, sacct, sshare, sprio,
 * sdiag, sstat, sreport, sacctmgr):
 * one multi-call program, told apart by the name it runs as, that runs the command in the
 * host's command server (slurm/cmdserver.py) instead of starting an interpreter.
 *
 * Workflow engines and shell loops call these commands one process at a time, and a Python
 * command's start-up (the interpreter, its imports) is 50-70 ms of a call whose work is a
 * millisecond or two (docs/slurm.md, "What a call costs").  The command server is a Python
 * process that has imported the commands once; for each call it forks a worker that takes
 * this program's identity (SO_PEERCRED: its uid, never what it says), its directory, umask,
 * environment, arguments and its stdin, stdout and stderr (SCM_RIGHTS), and runs the same
 * Python code the interpreter would, so what a command prints and returns is the same either
 * way.
 *
 * Protocol (one request a connection): this program sends "cmd1 LEN\n" carrying fds 0, 1 and
 * 2, then LEN bytes of "cmd1\0PYTHON\0COMMAND\0CWD\0UMASK\0ARGC\0ARG...\0KEY=VALUE\0..." (no
 * trailing NUL); the server answers lines: "pid N" (the worker running it: SIGINT, SIGTERM,
 * SIGHUP and SIGQUIT sent to this program are sent on to it), "fallback" (not served here:
 * run the Python command), "exit N" or "signal N" (how the command ended).
 *
 * Wherever it is not served (no server at $PHALANX_COMMAND_SOCKET, else
 * /run/phalanx/commands.sock; PHALANX_COMMAND_SOCKET set to "" or "off"; a server of another
 * installation, or run by another user than the caller or root; a server too busy) it execs
 * PHX_PYTHON -m phalanx.slurm COMMAND ARGS, the interpreter of the installation that built it.
 *
 * Built by phalanx/native.py with -DPHX_PYTHON="..." (`phalanx slurm-commands --install DIR`).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <unistd.h>

#ifndef PHX_PYTHON
#error "build with -DPHX_PYTHON=\"/path/to/python\""
#endif

#define DEFAULT_SOCKET "/run/phalanx/commands.sock"

static const char *const SERVED[] = {"sbatch", "squeue", "scancel", "sinfo", "scontrol",
                                     "sacct",  "sshare", "sprio",   "sdiag", "sstat",
                                     "sreport", "sacctmgr"};

static volatile sig_atomic_t worker_pid = 0;  /* set once "pid N" arrived */
static volatile sig_atomic_t pending_sig = 0; /* a signal that came before it */
static volatile sig_atomic_t relayed_sig = 0; /* the last signal sent on */

/* exec the Python command: PHX_PYTHON -m phalanx.slurm COMMAND ARGS (argv[0] skipped) */
static void python_command(const char *command, int argc, char **argv) {
    char **args = calloc((size_t)argc + 5, sizeof(char *));
    if (args == NULL) {
        dprintf(2, "%s: error: out of memory\n", command);
        _exit(1);
    }
    args[0] = PHX_PYTHON;
    args[1] = "-m";
    args[2] = "phalanx.slurm";
    args[3] = (char *)command;
    for (int i = 1; i < argc; i++) args[i + 3] = argv[i];
    args[argc + 3] = NULL;
    execv(PHX_PYTHON, args);
    dprintf(2, "%s: error: cannot run %s: %s\n", command, PHX_PYTHON, strerror(errno));
    _exit(1);
}

static int write_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = send(fd, buf, len, MSG_NOSIGNAL); /* a closed server: EPIPE, not SIGPIPE */
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

static void relay(int signum) {
    int saved = errno;
    if (worker_pid > 0) {
        relayed_sig = signum;
        (void)kill((pid_t)worker_pid, signum);
    } else {
        pending_sig = signum;
    }
    errno = saved;
}

/* the payload (fields joined by NUL, no trailing NUL) */
static char *payload(const char *command, int argc, char **argv, char **envp, size_t *size) {
    char cwd[PATH_MAX];
    if (getcwd(cwd, sizeof(cwd)) == NULL) return NULL;
    mode_t mask = umask(0);
    umask(mask);
    char smask[16], count[24];
    snprintf(smask, sizeof(smask), "%o", (unsigned)mask);
    snprintf(count, sizeof(count), "%d", argc - 1);
    const char *head[] = {"cmd1", PHX_PYTHON, command, cwd, smask, count};
    size_t total = 0;
    for (size_t i = 0; i < sizeof(head) / sizeof(head[0]); i++) total += strlen(head[i]) + 1;
    for (int i = 1; i < argc; i++) total += strlen(argv[i]) + 1;
    for (char **e = envp; *e; e++)
        if (strchr(*e, '=') != NULL) total += strlen(*e) + 1;
    total -= 1; /* no trailing NUL */
    char *buf = malloc(total + 1), *p = buf;
    if (buf == NULL) return NULL;
    for (size_t i = 0; i < sizeof(head) / sizeof(head[0]); i++) p = stpcpy(p, head[i]) + 1;
    for (int i = 1; i < argc; i++) p = stpcpy(p, argv[i]) + 1;
    for (char **e = envp; *e; e++)
        if (strchr(*e, '=') != NULL) p = stpcpy(p, *e) + 1;
    *size = total;
    return buf;
}

static void die_of(int signum) {
    /* end as the command ended: the shell sees the same signal (and stops a loop on ^C) */
    signal(signum, SIG_DFL);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, signum);
    sigprocmask(SIG_UNBLOCK, &set, NULL);
    raise(signum);
    _exit(128 + signum);
}

int main(int argc, char **argv, char **envp) {
    const char *name = strrchr(argv[0], '/');
    name = name ? name + 1 : argv[0];
    int served = 0;
    for (size_t i = 0; i < sizeof(SERVED) / sizeof(SERVED[0]); i++)
        if (strcmp(name, SERVED[i]) == 0) served = 1;
    if (!served) {
        /* not run as a command's name: pass everything to the Python entry point */
        if (argc < 2) {
            dprintf(2, "usage: %s COMMAND [ARGS...]\n", name);
            return 1;
        }
        name = argv[1];
        argv++;
        argc--;
        served = 0;
        for (size_t i = 0; i < sizeof(SERVED) / sizeof(SERVED[0]); i++)
            if (strcmp(name, SERVED[i]) == 0) served = 1;
        if (!served) python_command(name, argc, argv);
    }

    const char *path = getenv("PHALANX_COMMAND_SOCKET");
    if (path == NULL) path = DEFAULT_SOCKET;
    if (*path == '\0' || strcmp(path, "off") == 0) python_command(name, argc, argv);

    struct sockaddr_un addr;
    memset(&addr, 0, sizeof(addr));
    addr.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof(addr.sun_path)) python_command(name, argc, argv);
    strcpy(addr.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) python_command(name, argc, argv);
    if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0) {
        close(fd);
        python_command(name, argc, argv);
    }
    /* the server gets this command's environment and its stdin, stdout and stderr: it must
     * be this user's or root's, never a socket another user put at that path */
    struct ucred peer;
    socklen_t peer_len = sizeof(peer);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &peer_len) != 0 ||
        peer_len != sizeof(peer) || (peer.uid != getuid() && peer.uid != 0)) {
        dprintf(2,
                "%s: warning: %s is not served by you (uid %u) or root: not using it\n",
                name, path, (unsigned)getuid());
        close(fd);
        python_command(name, argc, argv);
    }

    size_t size = 0;
    char *data = payload(name, argc, argv, envp, &size);
    if (data == NULL) {
        close(fd);
        python_command(name, argc, argv);
    }
    char head[64];
    int hlen = snprintf(head, sizeof(head), "cmd1 %zu\n", size);
    int fds[3] = {0, 1, 2};
    char control[CMSG_SPACE(sizeof(fds))];
    memset(control, 0, sizeof(control));
    struct iovec iov = {.iov_base = head, .iov_len = (size_t)hlen};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(fds));
    memcpy(CMSG_DATA(cm), fds, sizeof(fds));

    /* relay from here: a ^C while the request travels is sent on once the worker is known */
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = relay;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    int forwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};
    for (size_t i = 0; i < sizeof(forwarded) / sizeof(forwarded[0]); i++)
        sigaction(forwarded[i], &sa, NULL);

    ssize_t sent;
    do {
        sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
    } while (sent < 0 && errno == EINTR);
    if (sent != hlen || write_all(fd, data, size) != 0) {
        close(fd); /* a closed fd 0, or a server gone: nothing ran yet */
        if (pending_sig) die_of(pending_sig);
        python_command(name, argc, argv);
    }
    free(data);

    char buf[256];
    size_t have = 0;
    for (;;) {
        ssize_t n = read(fd, buf + have, sizeof(buf) - 1 - have);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        have += (size_t)n;
        buf[have] = '\0';
        char *line = buf, *nl;
        while ((nl = memchr(line, '\n', have - (size_t)(line - buf))) != NULL) {
            *nl = '\0';
            if (strncmp(line, "pid ", 4) == 0) {
                worker_pid = atoi(line + 4);
                if (pending_sig && worker_pid > 0) {
                    relayed_sig = pending_sig;
                    (void)kill((pid_t)worker_pid, pending_sig);
                }
            } else if (strcmp(line, "fallback") == 0) {
                close(fd);
                if (pending_sig) die_of(pending_sig);
                python_command(name, argc, argv);
            } else if (strncmp(line, "exit ", 5) == 0) {
                _exit(atoi(line + 5) & 0xff);
            } else if (strncmp(line, "signal ", 7) == 0) {
                die_of(atoi(line + 7));
            }
            line = nl + 1;
        }
        have -= (size_t)(line - buf);
        memmove(buf, line, have);
        if (have >= sizeof(buf) - 1) have = 0; /* a line this long is not ours: drop it */
    }
    close(fd);
    if (relayed_sig) die_of(relayed_sig);
    if (worker_pid == 0 && pending_sig) die_of(pending_sig);
    if (worker_pid == 0) python_command(name, argc, argv); /* went away before it started */
    dprintf(2, "%s: error: lost the command server while the command ran\n", name);
    return 1;
}
