"""A real four-node Slurm cluster on this one machine, for the integration tests (issue 10).

`SlurmCluster.start(root)` writes a slurm.conf under `root` (auth/none, linuxproc, cons_tres, no
accounting), starts `slurmctld` and four `slurmd` ("n1" to "n4", all 127.0.0.1 on distinct ports) as child
processes, and waits for every node to be idle. Each node declares 2 CPUs, and every slurmd runs on this
one host, so every job's processes share its cores: the CPU counts are what Slurm allocates, not what runs.
Four nodes, because an engine over several nodes takes whole nodes and the learner needs others: one
engine over two nodes beside a learner on two (issue 37); most jobs use two. `stop()` cancels any job left, waits for the job steps to
go, then sends SIGTERM to each daemon's PID (SIGKILL after a grace period); it never signals by name.

`ensure_packages()` installs Debian's slurm-wlm 22.05 and Open MPI when a command is missing (CI runs as
root) and otherwise returns the reason they cannot be had, which the fixture turns into a loud skip.

Run by hand: `python tests/integration/slurm_cluster.py /tmp/cluster` starts it and prints the
`SLURM_CONF` to export; Ctrl-C or SIGTERM stops it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SLURM_COMMANDS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
MPI_COMMANDS = ("mpirun",)
APT_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge", "libopenmpi-dev", "openmpi-bin")
NODES = ("n1", "n2", "n3", "n4")
PARTITION = "debug"
CPUS_PER_NODE = 2


def parity_reward(prompt: str, completion: str, sample: dict) -> float:
    """A reward that a random tiny model still earns on about half its completions (the parity of the
    completion's length), so that the Slurm training jobs take real, non-zero policy-gradient steps."""
    return float(len(completion) % 2)


def missing_commands(commands: tuple[str, ...] = SLURM_COMMANDS + MPI_COMMANDS) -> list[str]:
    return [c for c in commands if shutil.which(c) is None]


def ensure_packages(log: Path | None = None) -> str | None:
    """Install the Slurm/MPI packages if a command is missing. Returns None when ready, else why not."""
    missing = missing_commands()
    if not missing:
        return None
    if os.geteuid() != 0:
        return f"Slurm/MPI commands {missing} are missing and installing them needs root (apt-get)"
    if shutil.which("apt-get") is None:
        return f"Slurm/MPI commands {missing} are missing and this system has no apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - closed below
    try:
        for cmd in (
            ["apt-get", "update", "-q"],
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES],
        ):
            try:
                rc = subprocess.call(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=900)
            except subprocess.TimeoutExpired:
                return f"{' '.join(cmd)} timed out after 900 s"
            if rc != 0:
                return f"{' '.join(cmd)} failed with exit code {rc} (log: {log})"
    finally:
        if log:
            out.close()
    still = missing_commands()
    return f"installed {APT_PACKAGES} but {still} are still missing" if still else None


def ensure_mpi4py(python: str = sys.executable) -> str | None:
    """Make mpi4py importable by `python` (its binary wheel, via pip). None when ready, else why not.

    mpi4py belongs to the `mpi` extra (pyproject.toml), so a fresh environment may lack it.
    """
    probe = [python, "-c", "import mpi4py.MPI"]
    if subprocess.run(probe, capture_output=True, timeout=60).returncode == 0:
        return None
    cmd = [python, "-m", "pip", "install", "-q", "--only-binary=:all:", "mpi4py>=4.0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return f"mpi4py is not installed and `{' '.join(cmd)}` failed: {r.stderr.strip()[-500:]}"
    if subprocess.run(probe, capture_output=True, timeout=60).returncode != 0:
        return "mpi4py was installed but `import mpi4py.MPI` fails (no MPI library? install openmpi-bin)"
    return None


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports (bound together so they differ, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def slurm_conf_text(root: Path, host: str, ctld_port: int, node_ports: list[int]) -> str:
    """slurm.conf for one controller and len(NODES) slurmd on this host (all paths under `root`)."""
    lines = [
        "ClusterName=megagrpo-test",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/none",
        "CredType=cred/none",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={root}/jobcomp.txt",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "ReturnToService=2",
        "SchedulerType=sched/builtin",
        "KillWait=10",
        "MinJobAge=600",
        "InactiveLimit=0",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.%n.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd.%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    for name, port in zip(NODES, node_ports):
        lines.append(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={CPUS_PER_NODE} State=UNKNOWN"
        )
    lines.append(f"PartitionName={PARTITION} Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


@dataclass
class JobInfo:
    job_id: int
    state: str  # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, REQUEUED, ...
    exit_code: str  # "rc:signal"
    restarts: int
    fields: dict[str, str] = field(default_factory=dict)


@dataclass
class SlurmCluster:
    root: Path
    conf: Path = field(init=False)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.conf = self.root / "slurm.conf"

    # -- environment for client commands ---------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """os.environ plus SLURM_CONF (without it the client commands fail on a DNS lookup)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, check=check, timeout=timeout)

    # -- life cycle --------------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> SlurmCluster:
        host = socket.gethostname()
        for sub in ("state", "log", *(f"spool/{n}" for n in NODES)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        ctld_port, *node_ports = free_ports(1 + len(NODES))
        self.conf.write_text(slurm_conf_text(self.root, host, ctld_port, node_ports))
        try:
            self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            for name in NODES:
                self._spawn(f"slurmd.{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)])
            self.wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.root / "log" / f"{name}.stdout", "wb")  # noqa: SIM115 - owned by the process
        self.procs[name] = subprocess.Popen(
            cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        out.close()

    def wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}; see {self.root / 'log'}")
            r = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in NODES):
                return
            time.sleep(0.5)
        raise RuntimeError(f"Slurm nodes not idle after {timeout} s: {states}; see {self.root / 'log'}")

    def job_ids(self) -> list[int]:
        r = self.run("squeue", "-h", "-o", "%i", check=False)
        return [int(x) for x in r.stdout.split() if x.strip().isdigit()]

    def stop(self, grace: float = 20) -> None:
        """Cancel every job, wait for them to leave, then SIGTERM (later SIGKILL) each daemon by PID."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            ids = self.job_ids()
            for jid in ids:
                self.run("scancel", str(jid), check=False)
            deadline = time.monotonic() + grace
            while ids and time.monotonic() < deadline:
                time.sleep(0.5)
                ids = [j for j in self.job_ids() if self.job(j).state in ("RUNNING", "COMPLETING")]
        for _name, p in reversed(list(self.procs.items())):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _name, p in reversed(list(self.procs.items())):
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self.procs.clear()

    # -- jobs -------------------------------------------------------------------------------------

    def job(self, job_id: int) -> JobInfo:
        """State of a job from `scontrol -o show job` (no accounting database is needed)."""
        r = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
        fields: dict[str, str] = {}
        for tok in r.stdout.split():
            k, sep, v = tok.partition("=")
            if sep and k not in fields:
                fields[k] = v
        return JobInfo(
            job_id=job_id,
            state=fields.get("JobState", "UNKNOWN"),
            exit_code=fields.get("ExitCode", ""),
            restarts=int(fields.get("Restarts", "0") or 0),
            fields=fields,
        )

    def release_requeued(self, job_id: int, timeout: float) -> JobInfo:
        """Start a requeued job now instead of after Slurm's hold, once it can start without being refused.

        A requeue makes slurmctld send REQUEST_TERMINATE_JOB stamped with its clock (whole seconds); each
        slurmd revokes the job's credential as of that stamp, kills the old instance, runs its epilog and
        reports back, and only then is the job's COMPLETING flag cleared, so `JobState=PENDING` means
        every node has recorded the revocation. A launch credential whose creation second is not later
        than the stamp is refused ("Job credential revoked") and the job ends FAILED; Slurm's hold of
        cred_expire + 1 s avoids this. The stamp is at most the second in which PENDING was seen, so
        StartTime is set once the clock is past that second.
        """
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            seen = time.time()
            if info.restarts >= 1 and info.state == "PENDING":
                break
            if info.state not in ("RUNNING", "PENDING", "REQUEUED", "COMPLETING"):
                raise RuntimeError(f"job {job_id} is {info.state}, not requeued; {self.ctld_log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not requeued after {timeout} s: {json.dumps(info.fields)}")
            time.sleep(0.5)
        time.sleep(max(0.0, int(seen) + 1 - time.time()))
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        return info

    def ctld_log_tail(self, n: int = 30) -> str:
        log = self.root / "log" / "slurmctld.log"
        lines = log.read_text(errors="replace").splitlines()[-n:] if log.exists() else ["(no log)"]
        return "slurmctld.log:\n" + "\n".join(lines)

    def wait_job(
        self, job_id: int, timeout: float, *, states: tuple[str, ...] = ("COMPLETED", "FAILED", "CANCELLED")
    ) -> JobInfo:
        """Poll `scontrol` until the job reaches one of `states` (sbatch --wait polls far more slowly)."""
        deadline = time.monotonic() + timeout
        info = self.job(job_id)
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.state in states or info.state in ("TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {info.state} after {timeout} s: {json.dumps(info.fields)}")


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/megagrpo-slurm")
    why = ensure_packages(root / "apt.log")
    if why:
        print(why, file=sys.stderr)
        return 1

    def stop_request(signum, frame):
        raise KeyboardInterrupt

    # a background job of a non-interactive shell starts with SIGINT ignored: take SIGTERM too
    signal.signal(signal.SIGINT, stop_request)
    signal.signal(signal.SIGTERM, stop_request)
    cluster = SlurmCluster(root).start()
    print(f"export SLURM_CONF={cluster.conf}; stop with: kill {os.getpid()}", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
