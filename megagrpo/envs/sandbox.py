"""Run model-written Python in a child process that cannot hurt the trainer: the code sandbox.

`run(code, cfg)` starts `sys.executable -I -S -c _BOOT` (no `preexec_fn`, so it is safe from the threads
that run tools) with the job's stop signals blocked. The boot process B ignores them (`JOB_SIGNALS`), joins
a fresh `pids` cgroup, enters new network, PID, mount and IPC namespaces, bounds the IPC namespace
(`IPC_SYSCTLS`), makes every mount of the host read-only in its mount namespace, mounts a private
size-bounded tmpfs on /tmp (its work directory inside, /dev/shm and /var/tmp bound to it), preloads a set
of stdlib modules, and forks C, the init of the new PID namespace. C forks D, which sets
the resource limits, drops root to a fresh unprivileged uid and runs the code in-process; C reaps orphans
and reports D's wait status on a private pipe. The trainer reads stdout and stderr with a byte cap,
enforces the wall time, and on any exit kills everything that is left (C, the cgroup, the process group),
then removes the scratch directory. When C exits the kernel kills every process of its PID namespace, so
a forked child that called setsid() cannot outlive the run. D is not the init because an init ignores
SIGXCPU and SIGXFSZ, the signals of the CPU and file-size limits.

Every run sets up its isolation anew, and B checks it: under require (this process's policy, from
`require_isolation`), a run that did not get all of it (`ISOLATIONS`) never forks C, and its result is
`refused`; under best effort the code runs without what is missing, and the result names it (`missing`).
`probe` says once per process what the host's kernel refuses (a container without CAP_SYS_ADMIN refuses
every namespace) and `require_isolation` turns that into a one-line refusal at start unless the config
accepts it. A run killed from outside (B or C by SIGKILL) is `interrupted`: its outcome is not the code's.

Host cost per run: 3 processes (B, C, D) plus what D forks, up to `max_processes`; up to `max_processes` x
`memory_mb` of address space and `scratch_mb` of RAM (the tmpfs); one host scratch directory with main.py.

What is isolated, what is not, and the root / non-root differences: docs/sandbox.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields

from megagrpo.errors import MegagrpoError

# The stdlib modules the code can import even when the sandbox uid cannot read the interpreter's files
# (a Python under /root, mode 0700): they are imported before the uid drop, and the fork keeps them.
PRELOADED_MODULES = (  # noqa: SIM905 - one word list reads better than forty lines
    "array base64 bisect cmath collections copy csv ctypes dataclasses datetime decimal enum fractions "
    "functools glob hashlib heapq io itertools json linecache math operator pathlib pprint random re "
    "shutil signal socket statistics string struct subprocess tempfile textwrap threading time traceback "
    "typing unicodedata encodings.idna"
).split()

# Runs in B as `python -I -S -c _BOOT SPEC_JSON`; SPEC keys are set by `run`. Only the stdlib, no megagrpo.
_BOOT = r"""
import json, os, sys, signal
spec = json.loads(sys.argv[1])
for sig in spec["ignore_signals"]:  # the job's stop signals: the trainer, not the signal, ends a run
    signal.signal(sig, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_UNBLOCK, spec["ignore_signals"])  # blocked by `run` up to here
rep = spec["report_fd"]
def report(**kw):
    os.write(rep, (json.dumps(kw) + "\n").encode())
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: B dies with the trainer
if spec["cgroup_procs"]:
    with open(spec["cgroup_procs"], "w") as f:
        f.write(str(os.getpid()))
flags = 0 if spec["network"] else os.CLONE_NEWNET
flags |= os.CLONE_NEWPID | os.CLONE_NEWNS | os.CLONE_NEWIPC
uid, gid = os.getuid(), os.getgid()
if uid != 0:
    flags |= os.CLONE_NEWUSER
got = {"netns": False, "pidns": False, "ipcns": False, "mntns": False}
reason = None
try:
    os.unshare(flags)
    if uid != 0:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    got.update(netns=not spec["network"], pidns=True, ipcns=True)
except OSError as e:
    reason = f"unshare: {e.strerror}"
ipc_limits = None  # why the IPC namespace's limits could not be set (a read-only /proc/sys, an old kernel)
if got["ipcns"]:  # before the root (and /proc with it) turns read-only
    try:
        for name, value in spec["ipc_sysctls"]:
            with open(f"/proc/sys/kernel/{name}", "w") as f:
                f.write(value)
    except OSError as e:
        ipc_limits = f"kernel.{name}: {e.strerror}"
if got["pidns"]:  # a read-only root; a private /tmp (tmpfs, size-bounded) holding the work directory
    with open("main.py", "rb") as f:
        source_bytes = f.read()
    def mount(src, target, fstype, mflags, data):
        if libc.mount(src.encode(), target.encode(), fstype and fstype.encode(), mflags, data and data.encode()):
            raise OSError(ctypes.get_errno(), f"mount {target}: {os.strerror(ctypes.get_errno())}")
    try:
        mount("none", "/", None, 0x4000 | 0x40000, None)  # MS_REC | MS_PRIVATE: nothing leaks to the host
        with open("/proc/self/mountinfo") as f:
            mountinfo = [line.split() for line in f]
        for fs in mountinfo:  # id parent dev root MOUNT_POINT OPTIONS ...; the point's octal escapes decoded
            point = fs[4].encode().decode("unicode_escape").encode("latin-1").decode()
            locked = sum(bit for opt, bit in (("nosuid", 0x2), ("nodev", 0x4), ("noexec", 0x8)) if opt in fs[5].split(","))
            try:  # MS_BIND | MS_REMOUNT | MS_RDONLY, keeping the flags a user namespace may not clear
                mount("none", point, None, 0x1000 | 0x20 | 0x1 | locked, None)
            except OSError as e:
                # ENOENT, ENOTDIR, EACCES, EINVAL: no path of ours reaches this mount (its point deleted,
                # behind a directory B may not enter, or under a later mount), so the code reaches it neither
                if e.errno not in (2, 20, 13, 22):
                    raise
        mount("tmpfs", "/tmp", "tmpfs", 0x2 | 0x4, f"size={spec['scratch_bytes']},nr_inodes={spec['scratch_inodes']},mode=1777")
        for target in spec["private_dirs"]:
            if os.path.isdir(target):
                inner = "/tmp/." + target.strip("/").replace("/", "-")
                os.mkdir(inner)
                os.chmod(inner, 0o1777)
                mount(inner, target, None, 0x1000, None)  # MS_BIND: one size bound for all of them
        work = os.path.join("/tmp", os.path.basename(os.getcwd()))
        os.mkdir(work, 0o700)
        with open(os.path.join(work, "main.py"), "wb") as f:
            f.write(source_bytes)
        if spec["run_uid"] is not None:
            os.chown(work, spec["run_uid"], spec["run_uid"])
        os.chdir(work)
        os.environ["HOME"] = os.environ["TMPDIR"] = work
        got["mntns"] = True
    except OSError as e:
        reason = str(e)
if spec["require"] and not ((spec["network"] or got["netns"]) and got["pidns"] and got["ipcns"] and got["mntns"]):
    report(**got, reason=reason, ipc_limits=ipc_limits, child=None, refused=True)  # the code is never run
    os._exit(0)
for m in spec["preload"]:
    try:
        __import__(m)
    except ImportError:
        pass
import builtins, resource, traceback
sys.stdout.flush(); sys.stderr.flush()
child = os.fork()
if child:  # B: report, wait for C, exit
    report(**got, reason=reason, ipc_limits=ipc_limits, child=child, refused=False)
    os.waitpid(child, 0)
    os._exit(0)
libc.prctl(1, signal.SIGKILL)  # C dies with B
code_pid = os.fork()
if code_pid:  # C, the PID namespace's init: reap orphans until the code's process ends, then end them all
    while True:
        pid, status = os.wait()
        if pid == code_pid:
            report(status=status)
            os._exit(0)
os.close(rep)  # D runs the code: not init, so SIGXCPU and SIGXFSZ end it
cpu = spec["cpu_seconds"]
for lim, val in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, spec["memory_bytes"]),
                 (resource.RLIMIT_FSIZE, spec["file_bytes"]), (resource.RLIMIT_NOFILE, spec["open_files"]),
                 (resource.RLIMIT_NPROC, spec["nproc"]), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(lim, val if isinstance(val, tuple) else (val, val))
if spec["run_uid"] is not None:
    os.setgroups([])
    os.setgid(spec["run_uid"])
    os.setuid(spec["run_uid"])
# As non-root, D still owns its user namespace with every capability in it, enough to remount the root
# read-write or unmount the private /tmp: drop them all (capset, _LINUX_CAPABILITY_VERSION_3); as root the
# uid change has dropped them already.
if libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()):
    os.write(2, b"sandbox: could not drop capabilities; the code was not run\n")
    os._exit(125)
libc.prctl(1, signal.SIGKILL)  # after the uid change, which clears it: D dies with C
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; the default ends the run at the limit
sys.argv = ["main.py"]
rc = 0
try:
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": builtins})
except SystemExit as e:
    if e.code is None or isinstance(e.code, int):
        rc = e.code or 0
    else:
        print(e.code, file=sys.stderr)
        rc = 1
except BaseException as e:
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # from the code's frame, not the boot's
    rc = 1
try:
    sys.stdout.flush(); sys.stderr.flush()
finally:
    os._exit(rc & 0xFF)
"""

# What stopped a run. None: it ended by itself (any exit code).
LIMITS = ("wall", "cpu", "memory", "output", "file_size", "processes")

_MIN_UID, _MAX_UID = 1 << 20, (1 << 31) - 2  # far above any account's uid, below the overflow ids

# The signals a job's scheduler sends to every process of a job step (Slurm: SIGTERM at preemption or the
# time limit, SIGINT/SIGUSR1/SIGUSR2 by `scancel --signal`, SIGHUP, SIGQUIT). A run ignores them all: the
# trainer decides when a run ends (its wall limit), so a stop request never becomes "killed by SIGTERM" in
# a trajectory. SIGKILL cannot be ignored: a run whose boot process or init it kills is `interrupted`.
JOB_SIGNALS = (
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGTERM,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
# Where the code may write on a stock Linux host, made private: /tmp is a tmpfs of the run's own (its work
# directory inside), and these are bound to directories of that tmpfs, so one `scratch_mb` bounds them all.
# Every other mount of the host is read-only inside the run, so nothing else it writes outlives it.
PRIVATE_DIRS = ("/dev/shm", "/var/tmp")
SCRATCH_INODES = 4096  # files and directories on the run's tmpfs: bounds their number, not only their bytes
# Limits of the run's own IPC namespace: sysctls that B writes (the kernel's admin-guide/sysctl/kernel.rst).
# shm_rmid_forced: a System V shared memory segment dies when its last process detaches (or when its creator
# exits without attaching it), so its pages are always mapped by a process of the run, which `memory_mb`
# (RLIMIT_AS) bounds. msgmni: 16 message queues of 16 KiB (msgmnb) hold 256 KiB of kernel memory, not the
# default 32000 (512 MiB). sem: 32 semaphores a set, 512 in all, 32 per semop call, 16 sets (default 32000).
IPC_SYSCTLS = (("shm_rmid_forced", "1"), ("msgmni", "16"), ("sem", "32 512 32 16"))
# What `missing_isolation` names, in the order of the one-line refusal.
ISOLATIONS = (
    "network isolation",
    "PID namespace",
    "private mounts (read-only root, private /tmp, /dev/shm, scratch size)",
    "IPC namespace",
)


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one sandboxed run. The defaults suit a tool call in an RL rollout: small and short."""

    cpu_seconds: int = 5  # RLIMIT_CPU of the code's process: SIGXCPU at the limit, SIGKILL a second later
    wall_seconds: float = 10.0  # from start to kill of everything the run started
    memory_mb: int = 512  # RLIMIT_AS (address space) of each process: allocations past it fail (MemoryError)
    max_processes: int = (
        16  # processes and threads at once, the code's own included (pids cgroup / RLIMIT_NPROC)
    )
    max_file_mb: int = 16  # RLIMIT_FSIZE: the largest file the code can write; SIGXFSZ ends the run past it
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 16384  # stdout and stderr, each; past it the run is killed and the text cut
    network: bool = False  # False: a new network namespace (loopback only, down); True: the host's network
    scratch_mb: int = 64  # the run's private tmpfs (/tmp with its work directory, /dev/shm, /var/tmp): RAM

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "network" and not value > 0:
                raise MegagrpoError(f"sandbox.{f.name} must be > 0, got {value!r}: give a positive limit")
        if self.max_processes < 2:
            raise MegagrpoError("sandbox.max_processes must be >= 2 (the code's process and one thread)")


@dataclass(frozen=True)
class SandboxResult:
    """What a run did. `exit_code` and `signal` are those of the code's process (one of them is None)."""

    stdout: str
    stderr: str
    truncated: bool  # stdout or stderr was cut at max_output_bytes
    exit_code: int | None
    signal: int | None
    limit: str | None  # one of LIMITS, or None when the code ended by itself
    wall_seconds: float
    network_isolated: bool  # the code ran in a network namespace of its own (False when cfg.network)
    process_limit: str  # how max_processes was enforced: "cgroup+rlimit" or "rlimit"
    uid: int  # the uid the code ran as
    scratch_dir: str  # removed when `run` returns
    notes: list[str] = field(default_factory=list)  # isolation that was asked for and not in effect
    missing: tuple[str, ...] = ()  # the `ISOLATIONS` that were not in effect (empty: fully isolated)
    interrupted: bool = False  # something outside the run killed it: its outcome is not the code's
    refused: bool = False  # under require, `missing` was not empty: the code was never run (module doc)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.limit is None


def run(code: str, cfg: SandboxConfig | None = None, *, best_effort: bool | None = None) -> SandboxResult:
    """Run `code` as `__main__` in a sandboxed child and return what it printed and how it ended.

    Each run sets up its own isolation. Under require (`best_effort` False), a run that could not have all
    of it (`missing`) never runs the code: `refused` is set. Under best effort the code runs without what is
    missing. `best_effort` None: this process's policy, set by `require_isolation` (require until then).

    Blocks for at most about `cfg.wall_seconds` plus the cleanup (a fraction of a second), and holds at
    most 2 × `max_output_bytes` + 128 KiB of the child's output in the trainer, whatever it writes. Raises
    OSError only when the sandbox itself cannot start (no scratch directory, no interpreter); anything
    the code does ends up in the result.
    """
    cfg = cfg or SandboxConfig()
    root = os.geteuid() == 0
    run_uid = random.randint(_MIN_UID, _MAX_UID) if root else None
    scratch = tempfile.mkdtemp(prefix="megagrpo-sandbox-")
    cgroup = _PidsCgroup.create(cfg.max_processes + 2)  # + B and C, which stay in the cgroup too
    notes: list[str] = []
    try:
        with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8", errors="replace") as f:
            f.write(code)
        if run_uid is not None:
            os.chown(scratch, run_uid, run_uid)
        os.chmod(scratch, 0o700)
        report_r, report_w = os.pipe()
        spec = {
            "report_fd": report_w,
            "cgroup_procs": cgroup.procs_file if cgroup else None,
            "network": cfg.network,
            "preload": PRELOADED_MODULES,
            "cpu_seconds": cfg.cpu_seconds,
            "memory_bytes": cfg.memory_mb << 20,
            "file_bytes": cfg.max_file_mb << 20,
            "open_files": cfg.max_open_files,
            "nproc": _nproc_limit(cfg.max_processes, root),
            "run_uid": run_uid,
            "ignore_signals": [int(x) for x in JOB_SIGNALS],
            "scratch_bytes": cfg.scratch_mb << 20,
            "scratch_inodes": SCRATCH_INODES,
            "private_dirs": PRIVATE_DIRS,
            "ipc_sysctls": IPC_SYSCTLS,
            "require": not (_best_effort if best_effort is None else best_effort),
        }
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8"}
        start = time.monotonic()
        # B starts with the job's signals blocked (the mask survives fork and exec) and ignores them before
        # it unblocks them: a job-wide SIGTERM at any moment never ends a run, the wall limit does.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _BOOT, json.dumps(spec)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=scratch,
                env=env,
                pass_fds=(report_w,),
                start_new_session=True,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            os.close(report_w)
        with os.fdopen(report_r, "rb") as report:
            out, err, truncated, reports, stop, boot_rc = _collect(proc, report, cfg, start, cgroup)
        wall = time.monotonic() - start
        events = cgroup.max_events() if cgroup else 0
    finally:
        if cgroup:
            cgroup.remove()
        _rmtree(scratch)

    setup = reports[0] if reports else {}
    status = reports[1]["status"] if len(reports) > 1 else None
    exit_code = os.waitstatus_to_exitcode(status) if status is not None else None
    refused = bool(setup.get("refused"))  # nothing ran: no status, and no signal either
    sig = None
    if not refused and (exit_code is None or exit_code < 0):
        sig, exit_code = (-exit_code if exit_code is not None else signal.SIGKILL), None
    stdout, stderr = (b.decode("utf-8", errors="replace") for b in (out, err))
    limit = stop or _limit_from_status(sig, exit_code, stderr, events)
    # Something outside the run killed its boot process or its init (B exits 0 after C's report, and C
    # reports unless killed): the code's status, if any, is not the code's doing.
    interrupted = stop is None and (boot_rc != 0 or (bool(setup) and status is None and not refused))
    missing = missing_isolation(setup, cfg)
    notes += [f"{m} unavailable ({setup.get('reason') or 'not reported'})" for m in missing]
    if setup.get("ipc_limits"):
        notes.append(
            f"IPC namespace limits not set ({setup['ipc_limits']}): its System V shared memory is "
            "bounded by the kernel's defaults, not by memory_mb"
        )
    if not root:
        notes.append("non-root: RLIMIT_NPROC is shared with this uid's other processes (approximate)")
    return SandboxResult(
        stdout=stdout,
        stderr=stderr,
        truncated=truncated,
        exit_code=exit_code,
        signal=sig,
        limit=limit,
        wall_seconds=wall,
        network_isolated=bool(setup.get("netns", False)),
        process_limit="cgroup+rlimit" if cgroup else "rlimit",
        uid=run_uid if run_uid is not None else os.getuid(),
        scratch_dir=scratch,
        notes=notes,
        missing=missing,
        interrupted=interrupted,
        refused=refused,
    )


def missing_isolation(setup: dict, cfg: SandboxConfig) -> tuple[str, ...]:
    """The `ISOLATIONS` a run asked for and did not get, from its boot process's report."""
    got = (
        cfg.network or bool(setup.get("netns")),
        bool(setup.get("pidns")),
        bool(setup.get("mntns")),
        bool(setup.get("ipcns")),
    )
    return tuple(name for name, ok in zip(ISOLATIONS, got, strict=True) if not ok)


@dataclass(frozen=True)
class Isolation:
    """What the sandbox can enforce on this host: the `ISOLATIONS` it cannot, and the kernel's reason."""

    missing: tuple[str, ...]
    reason: str

    def line(self) -> str:
        """One line naming what cannot be enforced, and why."""
        return f"the code sandbox cannot enforce {', '.join(self.missing)} on this host ({self.reason})"


_PROBES: dict[bool, Isolation] = {}
_best_effort = False  # this process's policy for a run that cannot be isolated (`require_isolation`)


def probe(network: bool = False) -> Isolation:
    """Run one empty program in the sandbox and say what it could not enforce; once per process (and per
    `network`), about 0.2 s. A container without CAP_SYS_ADMIN (Docker's default) refuses every namespace:
    `missing` then names them all."""
    if network not in _PROBES:
        r = run("", SandboxConfig(wall_seconds=30.0, network=network), best_effort=True)
        reason = next((n.split(" unavailable (", 1)[1][:-1] for n in r.notes if " unavailable (" in n), "")
        if r.interrupted or r.exit_code != 0:
            raise OSError(
                f"the sandbox's probe run failed: exit {r.exit_code}, signal {r.signal}: {r.stderr}"
            )
        _PROBES[network] = Isolation(r.missing, reason or "not reported")
    return _PROBES[network]


def require_isolation(cfg: SandboxConfig, accept: bool, where: str) -> Isolation:
    """`probe` this host for `cfg`; raise a one-line `MegagrpoError` naming what cannot be enforced unless
    `accept` (then every such run is counted: `SandboxResult.missing`, rollout/sandbox_unisolated_calls).
    `where` is the config field that accepts it. Run once at start, before any rollout: `accept` becomes
    this process's policy for every later run (`run`), whose isolation is set up, and checked, per run."""
    global _best_effort
    try:
        iso = probe(cfg.network)
    except OSError as e:  # no scratch space, no interpreter, or a boot that failed: say so, not a traceback
        raise MegagrpoError(f"{where}: the code sandbox could not run its start-up probe: {e}") from None
    if iso.missing and not accept:
        raise MegagrpoError(
            f"{iso.line()}: run where namespaces are allowed (a container needs CAP_SYS_ADMIN, e.g. docker "
            f"run --cap-add SYS_ADMIN), or set {where}: best_effort to run the code without them, each such "
            "call counted (docs/sandbox.md)"
        )
    _best_effort = accept
    return iso


def _collect(proc, report, cfg: SandboxConfig, start: float, cgroup: _PidsCgroup | None):
    """Read stdout, stderr and B's reports until the run ends, its wall time passes or its output overflows.

    Returns (stdout bytes, stderr bytes, truncated, reports, "wall" | "output" | None, B's return code);
    both byte strings are cut at max_output_bytes. Every process of the run is dead when it returns.
    """
    cap = cfg.max_output_bytes
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray(), report: bytearray()}
    sel = selectors.DefaultSelector()
    for f in bufs:
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    deadline = start + cfg.wall_seconds
    stop = None
    child = None
    while sel.get_map():
        now = time.monotonic()
        if now >= deadline:
            stop = "wall"
            break
        for key, _ in sel.select(timeout=min(0.1, deadline - now)):
            chunk = os.read(key.fd, 1 << 16)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            buf = bufs[key.fileobj]
            buf += chunk
            if key.fileobj is report and child is None and b"\n" in buf:
                child = json.loads(buf.split(b"\n", 1)[0]).get("child")
            if key.fileobj is not report and len(buf) > cap:
                stop = "output"
        if stop or (proc.poll() is not None and not _fd_open(sel, report)):
            break  # output overflow, or B and C are done (the report pipe closed): strays are killed below
    sel.close()
    _kill_all(proc, child, cgroup)
    for f in (proc.stdout, proc.stderr, report):
        with contextlib.suppress(OSError, TypeError):
            bufs[f] += f.read() or b""  # what was written before the kill; EOF now that all writers are dead
        f.close()
    reports = [json.loads(line) for line in bytes(bufs[report]).splitlines() if line.strip()]
    out, err = bufs[proc.stdout], bufs[proc.stderr]
    truncated = max(len(out), len(err)) > cap
    return bytes(out[:cap]), bytes(err[:cap]), truncated, reports, stop, proc.returncode


def _fd_open(sel: selectors.BaseSelector, f) -> bool:
    return f in {k.fileobj for k in sel.get_map().values()}


def _kill_all(proc: subprocess.Popen, child: int | None, cgroup: _PidsCgroup | None) -> None:
    """SIGKILL everything the run started: C (which ends its PID namespace), B's process group, the cgroup."""
    if child:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if cgroup:
        cgroup.kill_all()
    proc.wait()


def _limit_from_status(sig: int | None, exit_code: int | None, stderr: str, pid_events: int) -> str | None:
    if sig == signal.SIGXCPU:
        return "cpu"
    if sig == signal.SIGXFSZ:
        return "file_size"
    tail = stderr.rstrip().rsplit("\n", 1)[-1]
    if exit_code and tail.startswith("MemoryError"):
        return "memory"
    # a fork bomb's processes interleave their tracebacks: the failed fork's line can be anywhere
    if exit_code and (pid_events or any(ln.startswith("BlockingIOError") for ln in stderr.splitlines())):
        return "processes"
    return None


def _nproc_limit(max_processes: int, root: bool) -> int:
    """RLIMIT_NPROC counts every process of the uid. As root the code runs as a fresh uid, so the limit is
    exactly `max_processes`; otherwise it is the uid's current count plus `max_processes` (approximate)."""
    if root:
        return max_processes
    uid, count = os.getuid(), 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
            count += any(line.split()[1:2] == [str(uid)] for line in f if line.startswith("Uid:"))
    return count + max_processes


def _rmtree(path: str) -> None:
    def writable(fn, p, _exc):  # the code may have removed its own permissions on what it made
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
        with contextlib.suppress(OSError):
            fn(p)

    shutil.rmtree(path, onexc=writable)
    if os.path.exists(path):
        shutil.rmtree(path, ignore_errors=True)


class _PidsCgroup:
    """A child cgroup of our own with the `pids` controller (v1 or v2), when it can be made (root, or a
    delegated v2 subtree): `pids.max` bounds the processes, and killing its members ends every stray."""

    def __init__(self, path: str):
        self.path = path
        self.procs_file = os.path.join(path, "cgroup.procs")

    @classmethod
    def create(cls, max_pids: int) -> _PidsCgroup | None:
        name = f"megagrpo-sandbox-{os.getpid()}-{random.getrandbits(48):012x}"
        for parent in _pids_cgroup_parents():
            path = os.path.join(parent, name)
            try:
                os.mkdir(path)
            except OSError:
                continue
            try:
                with open(os.path.join(path, "pids.max"), "w") as f:
                    f.write(str(max_pids))
                return cls(path)
            except OSError:
                with contextlib.suppress(OSError):
                    os.rmdir(path)
        return None

    def pids(self) -> list[int]:
        with contextlib.suppress(OSError), open(self.procs_file) as f:
            return [int(x) for x in f.read().split()]
        return []

    def kill_all(self) -> None:
        with contextlib.suppress(OSError), open(os.path.join(self.path, "cgroup.kill"), "w") as f:
            f.write("1")  # v2: one atomic kill, forks in flight included
        for _ in range(200):  # v1: kill what is listed until the list stays empty
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    def max_events(self) -> int:
        """How often a fork failed on pids.max."""
        with contextlib.suppress(OSError, ValueError), open(os.path.join(self.path, "pids.events")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "max":
                    return int(value)
        return 0

    def remove(self) -> None:
        for _ in range(100):  # a killed member leaves the cgroup once reaped
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                self.kill_all()
                time.sleep(0.01)


def _pids_cgroup_parents() -> list[str]:
    """The cgroup directories of this process where a `pids` child could be made: v1's pids hierarchy, then
    v2's unified one when its subtree has the pids controller enabled."""
    out = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return out
    for _, controllers, rel in lines:
        if "pids" in controllers.split(","):
            out.append(os.path.join("/sys/fs/cgroup/pids", rel.lstrip("/")))
    for _, controllers, rel in lines:
        if controllers == "":
            for base in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
                parent = os.path.join(base, rel.lstrip("/"))
                with contextlib.suppress(OSError), open(os.path.join(parent, "cgroup.subtree_control")) as f:
                    if "pids" in f.read().split():
                        out.append(parent)
    return out
