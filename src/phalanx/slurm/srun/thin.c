/*
 * The compiled thin srun: srun/thin.py in C, so that a loop of `srun` in a job does not pay an
 * interpreter's start-up (~15-20 ms of every step, a third of a trivial step's path).
 *
 * Inside a job it hands the step to the job's resident helper (srun/helper.py) on
 * $TMPDIR/.phx-srun-$SLURM_JOB_ID.sock exactly as srun/thin.py does: one message
 * "srun1 LEN\n" carrying srun's stdin (when it has one open), stdout and stderr (SCM_RIGHTS:
 * the helper forwards that stdin to the step's tasks, as srun does), then LEN bytes of
 * "srun1\0CWD\0ARGC\0ARG...\0KEY=VALUE\0...", then it reads lines: "ok" (the helper took the
 * step), "fallback" (run the full srun), "exit N" (the step's exit status).  SIGINT, SIGTERM,
 * SIGUSR1 and SIGUSR2 are relayed as "sig N\n" lines.  Before sending anything it asks the
 * kernel who listens on the socket (SO_PEERCRED): a helper of another uid than the caller's
 * or root's (a socket planted in a TMPDIR shared with others) gets nothing, and a helper
 * that refuses the caller answers "refused REASON".  Wherever srun/thin.py would run the
 * full srun (no job, no helper, the helper refuses or goes away before taking the step) this
 * program execs it: PHX_PYTHON -m phalanx.slurm.srun.full ARGS.
 *
 * Built by phalanx/agent/native_srun.py with -DPHX_PYTHON="..." (the interpreter of the
 * installation that built it); the agents put its directory first on their jobs' PATH.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#ifndef PHX_PYTHON
#error "build with -DPHX_PYTHON=\"/path/to/python\""
#endif

static int sock_fd = -1;

static void full_srun(int argc, char **argv) {
    char **args = calloc((size_t)argc + 4, sizeof(char *));
    if (args == NULL) {
        dprintf(2, "srun: error: out of memory\n");
        _exit(1);
    }
    args[0] = PHX_PYTHON;
    args[1] = "-m";
    args[2] = "phalanx.slurm.srun.full";
    for (int i = 1; i < argc; i++) args[i + 2] = argv[i];
    args[argc + 2] = NULL;
    execv(PHX_PYTHON, args);
    dprintf(2, "srun: error: cannot run %s: %s\n", PHX_PYTHON, strerror(errno));
    _exit(1);
}

static int all_digits(const char *s) {
    if (s == NULL || *s == '\0') return 0;
    for (; *s; s++)
        if (!isdigit((unsigned char)*s)) return 0;
    return 1;
}

static int write_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = send(fd, buf, len, MSG_NOSIGNAL); /* a closed helper: EPIPE, not SIGPIPE */
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
    /* async-signal-safe: format by hand, one write */
    char line[16] = "sig ";
    char digits[8];
    int n = 0, saved = errno;
    do {
        digits[n++] = (char)('0' + signum % 10);
        signum /= 10;
    } while (signum > 0 && n < (int)sizeof(digits));
    int len = 4;
    while (n > 0) line[len++] = digits[--n];
    line[len++] = '\n';
    if (sock_fd >= 0) (void)!send(sock_fd, line, (size_t)len, MSG_NOSIGNAL);
    errno = saved;
}

/* the payload: srun1\0CWD\0ARGC\0ARGS...\0ENV... (fields joined by NUL, no trailing NUL) */
static char *payload(int argc, char **argv, char **envp, size_t *size) {
    char cwd[PATH_MAX];
    if (getcwd(cwd, sizeof(cwd)) == NULL) return NULL;
    char count[24];
    snprintf(count, sizeof(count), "%d", argc - 1);
    size_t total = strlen("srun1") + 1 + strlen(cwd) + 1 + strlen(count);
    for (int i = 1; i < argc; i++) total += 1 + strlen(argv[i]);
    for (char **e = envp; *e; e++)
        if (strchr(*e, '=') != NULL) total += 1 + strlen(*e);
    char *buf = malloc(total + 1), *p = buf;
    if (buf == NULL) return NULL;
    p = stpcpy(p, "srun1") + 1;
    p = stpcpy(p, cwd) + 1;
    p = stpcpy(p, count);
    for (int i = 1; i < argc; i++) p = stpcpy(p + 1, argv[i]);
    for (char **e = envp; *e; e++)
        if (strchr(*e, '=') != NULL) p = stpcpy(p + 1, *e);
    *size = total;
    return buf;
}

int main(int argc, char **argv, char **envp) {
    const char *job = getenv("SLURM_JOB_ID");
    if (job == NULL || *job == '\0') job = getenv("PHX_JOB_ID");
    const char *tmp = getenv("TMPDIR");
    const char *attach = getenv("PHX_SRUN_ATTACH");
    const char *no_helper = getenv("PHX_SRUN_NO_HELPER");
    if (!all_digits(job) || tmp == NULL || *tmp == '\0' || (attach && *attach) ||
        (no_helper && *no_helper))
        full_srun(argc, argv);

    struct sockaddr_un addr;
    memset(&addr, 0, sizeof(addr));
    addr.sun_family = AF_UNIX;
    int plen = snprintf(addr.sun_path, sizeof(addr.sun_path), "%s/.phx-srun-%s.sock", tmp, job);
    if (plen < 0 || (size_t)plen >= sizeof(addr.sun_path)) full_srun(argc, argv);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) full_srun(argc, argv);
    if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0) {
        close(fd);
        full_srun(argc, argv);
    }
    /* the helper gets srun's environment and its stdout and stderr: it must be this user's
     * (or root's), never a socket another user planted at that name */
    struct ucred peer;
    socklen_t peer_len = sizeof(peer);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &peer_len) != 0 ||
        peer_len != sizeof(peer)) {
        dprintf(2, "srun: error: cannot tell who serves %s: not using it\n", addr.sun_path);
        close(fd);
        full_srun(argc, argv);
    }
    if (peer.uid != getuid() && peer.uid != 0) {
        dprintf(2,
                "srun: error: %s is served by uid %u, not by you (uid %u) or root: not handing "
                "it the step (a socket planted in a shared TMPDIR?); running srun without the "
                "job's helper\n",
                addr.sun_path, (unsigned)peer.uid, (unsigned)getuid());
        close(fd);
        full_srun(argc, argv);
    }

    size_t size = 0;
    char *data = payload(argc, argv, envp, &size);
    if (data == NULL) {
        close(fd);
        full_srun(argc, argv);
    }
    char head[64];
    int hlen = snprintf(head, sizeof(head), "srun1 %zu\n", size);
    int fds[3] = {0, 1, 2};
    size_t nfds = fcntl(0, F_GETFD) == -1 ? 2 : 3; /* a closed stdin is not sent */
    const int *sent_fds = nfds == 3 ? fds : fds + 1;
    char control[CMSG_SPACE(sizeof(fds))];
    memset(control, 0, sizeof(control));
    struct iovec iov = {.iov_base = head, .iov_len = (size_t)hlen};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(nfds * sizeof(int));
    memcpy(CMSG_DATA(cm), sent_fds, nfds * sizeof(int));
    ssize_t sent;
    do {
        sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
    } while (sent < 0 && errno == EINTR);
    if (sent != hlen || write_all(fd, data, size) != 0) {
        close(fd);
        full_srun(argc, argv);  /* nothing was started: the helper only runs a whole request */
    }
    free(data);

    sock_fd = fd;
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = relay;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    int forwarded[] = {SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
    for (size_t i = 0; i < sizeof(forwarded) / sizeof(forwarded[0]); i++)
        sigaction(forwarded[i], &sa, NULL);

    char buf[4096];
    size_t have = 0;
    int accepted = 0;
    for (;;) {
        ssize_t n = read(fd, buf + have, sizeof(buf) - 1 - have);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        have += (size_t)n;
        buf[have] = '\0';
        char *line = buf, *nl;
        while ((nl = memchr(line, '\n', have - (size_t)(line - buf))) != NULL) {
            *nl = '\0';
            if (strcmp(line, "ok") == 0) {
                accepted = 1;
            } else if (strcmp(line, "fallback") == 0) {
                sock_fd = -1;
                close(fd);
                full_srun(argc, argv);
            } else if (strncmp(line, "refused ", 8) == 0) { /* not this user's helper */
                dprintf(2, "srun: error: the job's srun helper %s\n", line);
                sock_fd = -1;
                close(fd);
                full_srun(argc, argv);
            } else if (strncmp(line, "exit ", 5) == 0) {
                _exit(atoi(line + 5) & 0xff);
            }
            line = nl + 1;
        }
        have -= (size_t)(line - buf);
        memmove(buf, line, have);
        if (have >= sizeof(buf) - 1) have = 0; /* a line this long is not ours: drop it */
    }
    sock_fd = -1;
    close(fd);
    if (!accepted) full_srun(argc, argv); /* the helper went away before it took the step */
    dprintf(2, "srun: error: lost the job's srun helper while the step ran\n");
    return 1;
}
