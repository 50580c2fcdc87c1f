"""Running a completion's code against unit tests in a child process that cannot hurt the trainer (Linux).

The child runs `python -I` (no user site, no Python environment variables) in a fresh temporary folder, in its own
session, with limits set before it starts: CPU seconds, address space, file size (its output goes to a file that
cannot grow past the limit), open files, no core dumps, and a process count. It first takes a network namespace
(no interface up) and a PID namespace of its own where the kernel allows (root; otherwise unprivileged user
namespaces): when the namespace's first process ends, every process left in it is killed. Under root the harness
then runs as `nobody` where nobody can reach the interpreter (a Python under /root cannot be: then it stays root,
where the process limit does not hold, and the PID namespace and the timeout bound a fork bomb); otherwise the
process limit is the user's current count plus a few. Where no network namespace can be had, the child's Python
refuses to create sockets (a guard in its harness that code loading C libraries could get around; `Sandbox.network`
says which one holds). A wall-clock timeout kills the whole session.

The outcome is the share of tests that passed; a runaway, a crash, a kill or output past the limit scores 0, and
why is kept for the log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

OUTPUT_BYTES = 1 << 20  # what the child may write (stdout and stderr together)
EXTRA_PROCESSES = 8  # processes the child may start (threads count too)

# Runs first in the child. It takes namespaces of its own where it can (network: no interface up; PID: when its first
# process ends, the kernel kills every process left in it, a fork bomb included), then forks that first process,
# which forks the harness with the limits set (under root, as nobody where nobody can run the interpreter).
LIMITS = r"""
import ctypes, json, os, resource, sys
lim = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
NET, PID, USER = 0x40000000, 0x20000000, 0x10000000
tries = [NET | PID, NET] if lim["root"] else [USER | NET | PID, USER | NET]
got = next((f for f in tries if libc.unshare(f) == 0), 0)
open("network.txt", "w").write("namespace" if got & NET else "python guard")
def wait(pid):
    status = os.waitpid(pid, 0)[1]
    os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
first = os.fork()
if first:
    wait(first)
harness = os.fork()
if harness:
    wait(harness)
for name, value in (("CPU", lim["cpu"]), ("AS", lim["memory"]), ("FSIZE", lim["output"]), ("NOFILE", 64),
                    ("CORE", 0), ("NPROC", lim["processes"])):
    resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, value))
if lim["drop"]:
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
os.execv(lim["python"], [lim["python"], "-I", "harness.py", str(lim["report_fd"])])
"""

# Runs in the child: no sockets, the solution then each test in one namespace; one JSON line of results on the
# report pipe (its fd in argv).
HARNESS = r"""
import json, os, socket, sys
def _refused(*a, **k):
    raise OSError("network access is disabled in the reward sandbox")
socket.socket = socket.create_connection = socket.socketpair = _refused
spec = json.load(open("spec.json"))
report = os.fdopen(int(sys.argv[1]), "w")
ns = {"__name__": "__main__"}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
except BaseException as e:
    report.write(json.dumps({"passed": 0, "total": len(spec["tests"]), "error": "solution: %s: %s" % (type(e).__name__, e)}))
    report.close()
    os._exit(0)
passed, first = 0, None
for i, test in enumerate(spec["tests"]):
    try:
        exec(compile(test, "test_%d" % i, "exec"), dict(ns))
        passed += 1
    except BaseException as e:
        first = first or "test %d: %s: %s" % (i, type(e).__name__, e)
report.write(json.dumps({"passed": passed, "total": len(spec["tests"]), "error": first}))
report.close()
os._exit(0)
"""


@dataclass(frozen=True)
class Outcome:
    score: float  # share of tests passed (0 when the run failed)
    problem: str | None  # why not 1: the first failing test, the limit hit, the crash


@dataclass
class Sandbox:
    timeout: float = 5.0  # wall-clock seconds (CPU seconds: the same, rounded up)
    memory: int = 512 << 20  # bytes of address space
    network: str = ""  # how network access is kept out: "namespace" or "python guard" (set by the first run)

    def run(self, code: str, tests: list[str]) -> Outcome:
        """Run `code`, then each test (Python source, passing when it raises nothing) in its namespace."""
        with tempfile.TemporaryDirectory(prefix="openflash-reward-") as tmp:
            folder = Path(tmp)
            (folder / "solution.py").write_text(code, encoding="utf-8", errors="replace")
            (folder / "spec.json").write_text(json.dumps({"tests": tests}), encoding="utf-8")
            (folder / "harness.py").write_text(HARNESS, encoding="utf-8")
            os.chmod(folder, 0o777)  # (the child may run as nobody)
            return self._run(folder, len(tests))

    def _run(self, folder: Path, total: int) -> Outcome:
        read_fd, write_fd = os.pipe()
        root = os.geteuid() == 0
        python = os.path.realpath(sys.executable)  # (past a venv's link: nobody may not enter its folder)
        limits = {"cpu": int(self.timeout) + 1, "memory": self.memory, "processes": _process_limit(root),
                  "output": OUTPUT_BYTES, "root": root, "report_fd": write_fd, "python": python,
                  "drop": root and _others_can_run(python)}
        # The limits are set by a first Python in the child (LIMITS), which then becomes the harness: no code runs
        # between fork and exec in this (threaded) process.
        with open(folder / "output.txt", "wb") as output:
            try:
                proc = subprocess.Popen([sys.executable, "-I", "-c", LIMITS, json.dumps(limits)], cwd=folder,
                                        stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                        pass_fds=(write_fd,), start_new_session=True,
                                        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
            finally:
                os.close(write_fd)
        start = time.monotonic()
        try:
            proc.wait(timeout=self.timeout + 1.0)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_session(proc)
        os.set_blocking(read_fd, False)  # (a process that left the session may still hold the pipe open)
        with os.fdopen(read_fd, "rb") as report:
            try:
                raw = report.read(1 << 16) or b""
            except BlockingIOError:
                raw = b""
        if not self.network:
            self.network = _network_note(folder)
        signalled = {proc.returncode, proc.returncode - 128} & {-signal.SIGXCPU, signal.SIGXCPU, -signal.SIGKILL,
                                                                 signal.SIGKILL}
        if timed_out or signalled:
            return Outcome(0.0, f"killed after {time.monotonic() - start:.1f} s (time limit {self.timeout} s)")
        if (folder / "output.txt").stat().st_size >= OUTPUT_BYTES or proc.returncode - 128 == signal.SIGXFSZ:
            return Outcome(0.0, f"wrote more than {OUTPUT_BYTES} bytes of output")
        try:
            result = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            tail = (folder / "output.txt").read_bytes()[-300:].decode("utf-8", "replace").strip()
            return Outcome(0.0, f"the run ended without a result (exit status {proc.returncode}): {tail[-200:]}")
        passed = int(result.get("passed", 0))
        return Outcome(passed / max(total, 1), result.get("error"))


def _process_limit(root: bool) -> int:
    """RLIMIT_NPROC for the child: a few processes of its own (as nobody under root; otherwise on top of what
    the user runs now, which the limit counts too)."""
    if root:
        return EXTRA_PROCESSES
    uid, count = os.getuid(), 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                continue
    return count + EXTRA_PROCESSES


def _others_can_run(path: str) -> bool:
    """Whether a user with no rights of its own (nobody) can reach and run `path`: every folder on the way
    searchable by others, the file readable and executable by them."""
    p = Path(path)
    try:
        if p.stat().st_mode & 0o005 != 0o005:
            return False
        return all(parent.stat().st_mode & 0o001 for parent in p.parents)
    except OSError:
        return False


def _network_note(folder: Path) -> str:
    try:
        return (folder / "network.txt").read_text().strip() or "python guard"
    except OSError:
        return "python guard"


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the child's session (what it forked) until none is left (a fork bomb's members may
    be forking while a signal goes out; 2 s at most), then reap the child."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            break
        proc.poll()
        if not _alive_in_group(proc.pid):
            break
        time.sleep(0.01)
    proc.wait()


def _alive_in_group(pgid: int) -> bool:
    """Whether a process of group `pgid` other than a zombie still runs (from /proc/PID/stat)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False
