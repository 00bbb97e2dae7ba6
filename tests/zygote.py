"""A zygote for the tests' gateway and scripted-worker processes.

The suite starts hundreds of `python -m llmfleet gateway|worker` processes, and each spent most
of its start-up CPU importing FastAPI, pydantic, redis and llmfleet itself: about a second of a
two-core machine apiece, shared with every other test running then. The zygote imports those once
and forks a child per process asked for (as Android's zygote and Chromium's do): the child is the
same program, `llmfleet.main` with its own arguments, environment, working directory and log file,
from the first line of its `main` on. Nothing a child does happens before the fork: the zygote
makes no event loop, connection, thread or setting; it only imports.

One zygote serves one test process over a socket pair; it is started on first use and ends when
that socket closes. `ZygoteChild` stands in for `subprocess.Popen`: the zygote reaps its children
and sends each exit status back.

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
        os.environ.update(request["env"])
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


def serve(fd: int) -> None:
    """The zygote's loop: fork a child per request, report each child's end; stop at EOF."""
    sock = socket.socket(fileno=fd)
    # What every child needs, imported once. Only imports: no loop, thread or connection.
    import gateway.main  # noqa: F401
    import llmfleet  # noqa: F401
    import uvloop  # noqa: F401
    import worker.adapters.scripted  # noqa: F401
    import worker.adapters.scripted_encoder  # noqa: F401
    import worker.main  # noqa: F401

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

    def __init__(self):
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, "-m", "tests.zygote", str(theirs.fileno())],
                                        pass_fds=[theirs.fileno()], cwd=ROOT, stdin=subprocess.DEVNULL)
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
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

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
            if not self.changed.wait_for(lambda: self._started, 30):
                raise RuntimeError("the zygote did not fork within 30 s")
            pid = self._started.pop()
        return ZygoteChild(self, pid, args)


_ZYGOTE: Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def zygote() -> Zygote:
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None or _ZYGOTE.process.poll() is not None:
            _ZYGOTE = Zygote()
        return _ZYGOTE


if __name__ == "__main__":
    serve(int(sys.argv[1]))
