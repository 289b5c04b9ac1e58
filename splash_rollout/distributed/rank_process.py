"""The caller's side of one ``WorkerGroup`` rank: its process, socket, stderr and start command.

A rank is a fresh ``python -m splash_rollout.distributed.worker`` process with the caller's
``sys.path``, working directory and environment, joined to the caller by a socket pair whose other
end only that process inherits (nothing else can connect, and the rank's death closes it). Its
stderr is copied to the caller's stderr and its tail is kept, so the error for a rank that dies
without a word still carries what it printed (a traceback, a C++ abort message).
"""
from __future__ import annotations

import codecs
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

from splash_rollout.distributed.failure import RankFailure


STDERR_TAIL_BYTES = 8192
"""How much of a dead rank's stderr its error carries."""


class RankProcess:
    """One rank's process, its socket and the tail of its stderr (which also goes to ours)."""

    def __init__(self, rank: int, argv: list[str], env: dict[str, str], answers: queue.Queue):
        self.rank = rank
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(argv + ["--fd", str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env,
                                     cwd=os.getcwd(), stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        theirs.close()  # the rank holds the only other end: its death closes our socket
        self.conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._tail = bytearray()
        self._stderr = threading.Thread(target=self._tee_stderr, name=f"splash-rank{rank}-stderr", daemon=True)
        self._stderr.start()
        threading.Thread(target=self._read, args=(answers,), name=f"splash-rank{rank}-reader", daemon=True).start()

    def _read(self, answers: queue.Queue) -> None:
        while True:
            try:
                answers.put((self.rank, self.conn.recv_bytes()))
            except (EOFError, OSError):
                answers.put((self.rank, None))  # closed: the rank died or was shut down
                return

    def _tee_stderr(self) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        fd = self.proc.stderr.fileno()
        while chunk := os.read(fd, 65536):
            self._tail += chunk
            del self._tail[:-STDERR_TAIL_BYTES]
            try:
                sys.stderr.write(decoder.decode(chunk))
                sys.stderr.flush()
            except (OSError, ValueError):
                pass  # our own stderr is closed; the tail is still kept

    def send(self, msg: tuple) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.conn.send_bytes(data)

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def stderr_tail(self) -> str:
        """The last lines the rank wrote to stderr (complete once it has exited)."""
        if self.exitcode is not None:
            self._stderr.join(1.0)
        text = bytes(self._tail).decode("utf-8", errors="replace")
        return text if len(self._tail) < STDERR_TAIL_BYTES else "..." + text[text.find("\n"):]

    def died(self, what: str, seen: str = "") -> RankFailure:
        tail = self.stderr_tail().strip()
        return RankFailure(f"rank {self.rank} died during {what} (exit code {self.exitcode})"
                           + (f"; {seen}" if seen else "")
                           + (f"\nrank {self.rank} stderr (last lines):\n{tail}" if tail else ""))

    def close(self, kill: bool, timeout_s: float) -> None:
        if kill:
            self.proc.kill()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5.0)
        self.conn.close()
        self._stderr.join(1.0)


class Interrupt:
    """``WorkerGroup.interrupt``: an event whose changes are sent to every rank."""

    def __init__(self, ranks: list[RankProcess]):
        self._ranks, self._set, self._lock = ranks, False, threading.Lock()

    def _tell(self, value: bool) -> None:
        with self._lock:
            self._set = value
            for r in self._ranks:
                try:
                    r.send(("interrupt", value))
                except OSError:
                    pass  # a dead rank: the running call reports it

    def set(self) -> None:
        self._tell(True)

    def clear(self) -> None:
        self._tell(False)

    def is_set(self) -> bool:
        return self._set


def rank_argv(world_size: int, port: int, backend: str, timeout_s: float, threads: int) -> list[str]:
    isolated = ["-P"] if sys.version_info >= (3, 11) else []  # sys.path comes from PYTHONPATH alone
    argv = [sys.executable, *isolated, "-m", "splash_rollout.distributed.worker", "--world-size", str(world_size),
            "--port", str(port), "--backend", backend, "--timeout-s", str(timeout_s), "--threads", str(threads)]
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file and os.path.isfile(main_file):
        argv += ["--main-path", os.path.abspath(main_file)]
    return argv


def rank_env() -> dict[str, str]:
    """The caller's environment (``SPLASH_FAULT`` included) and its ``sys.path``, so a rank imports
    the same ``splash_rollout`` and the same modules a call's function lives in."""
    path = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys(path)))
