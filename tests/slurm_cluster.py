"""A real single-node SLURM cluster on the test machine (Debian's slurm-wlm and munge), for tests.

`single_node_slurm()` installs the packages when they are missing (root and apt-get needed), writes
/etc/slurm/slurm.conf, starts munged, slurmctld and slurmd, waits for the node to be idle, and on exit
stops the daemons it started (by their pids) and removes its slurm.conf (or restores the one it
replaced). `unavailable_reason()` says why it cannot run here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
CONFIG = Path("/etc/slurm/slurm.conf")
PID_FILES = {"slurmctld": Path("/run/nbsim-slurmctld.pid"), "slurmd": Path("/run/nbsim-slurmd.pid")}
PARTITION = "nbsim"
WRITTEN_BY_TESTS = "# written by nbsim's tests"


def unavailable_reason() -> str | None:
    """None when a single-node SLURM can be started here, else why not."""
    if os.environ.get("NBSIM_SKIP_SLURM"):
        return "NBSIM_SKIP_SLURM is set"
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "starting SLURM daemons needs root"
    if not (shutil.which("slurmctld") and shutil.which("munged")) and not shutil.which("apt-get"):
        return "slurm-wlm/munge are not installed and apt-get is not available"
    return None


def _run(command: list[str], timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, check=True, capture_output=True, text=True, timeout=timeout, **kwargs)


def install() -> None:
    if shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("munged"):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _run(["apt-get", "update", "-qq"], env=env)
    _run(["apt-get", "install", "-y", "-qq", *PACKAGES], env=env)


def write_config(host: str) -> str | None:
    """Write the single-node cluster's slurm.conf; the configuration it replaced (None: none, or one these
    tests wrote)."""
    previous = CONFIG.read_text() if CONFIG.is_file() else None
    if previous is not None and previous.startswith(WRITTEN_BY_TESTS):
        previous = None
    cpus = os.cpu_count() or 1
    memory_mb = int(Path("/proc/meminfo").read_text().split()[1]) // 1024 - 512
    for folder in ("/var/spool/slurmctld", "/var/spool/slurmd", "/var/log/slurm"):
        Path(folder).mkdir(parents=True, exist_ok=True)
    CONFIG.parent.mkdir(parents=True, exist_ok=True)
    # A short MessageTimeout, and the file is removed (or the one it replaced restored) on exit: while it
    # names a controller that is not running, every Snakemake start (its SLURM plugin runs `scontrol show
    # config` on import) waits about that long for it.
    # batch_sched_delay=0: the controller schedules a submitted batch job at once instead of holding it up to
    # 3 s (its default, for clusters flooded with submissions); each of the sweep's stages waited 2-3 s so.
    CONFIG.write_text(f"""{WRITTEN_BY_TESTS}: a single-node cluster
ClusterName=nbsim
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=300
MessageTimeout=3
SlurmctldPidFile={PID_FILES["slurmctld"]}
SlurmdPidFile={PID_FILES["slurmd"]}
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName={host} CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName={PARTITION} Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
""")
    return previous


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _start_munge() -> int | None:
    """Start munged unless it runs already; its pid when this call started it."""
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
        return None
    run_dir = Path("/run/munge")
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.chown(run_dir, "munge", "munge")
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        _run(["mungekey", "--create"])
        shutil.chown(key, "munge", "munge")
    _run(["runuser", "-u", "munge", "--", "munged"])
    deadline = time.time() + 20
    while time.time() < deadline:
        pid = _pid(run_dir / "munged.pid")
        if _alive(pid):
            return pid
        time.sleep(0.2)
    raise RuntimeError("munged did not start")


def _wait_idle(timeout: float = 90) -> None:
    deadline = time.time() + timeout
    state = ""
    while time.time() < deadline:
        result = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
        state = result.stdout.strip()
        if state in ("idle", "mix", "alloc"):
            return
        time.sleep(0.2)
    raise RuntimeError(f"the SLURM node did not become idle (state '{state}')")


@contextlib.contextmanager
def single_node_slurm():
    """Install if needed, start munged/slurmctld/slurmd, yield the partition name, stop what was started."""
    install()
    host = socket.gethostname().split(".")[0]
    previous_config = write_config(host)
    started: list[int] = []
    try:
        munge = _start_munge()
        if munge:
            started.append(munge)
        for daemon, arguments in (("slurmctld", ["-i"]), ("slurmd", [])):
            _run([daemon, *arguments])
            deadline = time.time() + 30
            while not _alive(_pid(PID_FILES[daemon])):
                if time.time() > deadline:
                    raise RuntimeError(f"{daemon} did not start; see /var/log/slurm/{daemon}.log")
                time.sleep(0.2)
            started.append(_pid(PID_FILES[daemon]))
        _wait_idle()
        yield PARTITION
    finally:
        for pid in reversed(started):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.time() + 30
        while any(_alive(pid) for pid in started) and time.time() < deadline:
            time.sleep(0.2)
        if previous_config is None:
            CONFIG.unlink(missing_ok=True)
        else:
            CONFIG.write_text(previous_config)
