"""One rank of a ``WorkerGroup``: ``python -m splash_rollout.distributed.worker ...``.

``WorkerGroup`` starts each rank as a fresh interpreter running this module (what torchrun does),
so a rank never re-imports the caller's main program: the caller can be a script with no
``if __name__ == "__main__":`` guard, ``python -c``, a program on stdin or a notebook. The caller
passes one end of a private socket pair (an inherited file descriptor, so no other process can
connect) and talks to the rank over it with pickled messages:

* caller -> rank: ``("call", call_id, pickled (fn, args, kwargs))``, ``("interrupt", bool)``, ``("stop",)``
* rank -> caller: ``("hello", splash_rollout file)``, ``("ready",)``, ``("start_error", traceback)``,
  ``("beat", call_id, info)``, ``("ok", call_id, value)``, ``("error", call_id, traceback)``

A reader thread turns ``interrupt`` messages into a ``threading.Event`` (``ctx.interrupted()``)
while the main thread runs calls, and ends the process when the caller goes away.

A call's ``fn`` is a module-level function; when it lives in the caller's ``__main__`` and that
program is a file, the rank loads that file under the name ``__mp_main__`` (so its guarded code
does not run) the first time such a call arrives.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import pickle
import queue
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

CALLER_MAIN = "__mp_main__"
"""The module name a rank gives the caller's main program (the name multiprocessing uses, and
which ``multiprocessing`` aliases to ``__main__`` in the caller, so answers unpickle there)."""

loading_caller_main = False
"""True while a rank executes the caller's main program to find a call's function (a program that
starts ranks again at import time is refused instead of recursing)."""
_caller_main: ModuleType | None = None


def send(conn: Connection, lock: threading.Lock, msg: tuple) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    with lock:
        conn.send_bytes(data)


def _load_caller_main(path: str | None) -> ModuleType:
    global loading_caller_main, _caller_main
    if _caller_main is not None:
        return _caller_main
    if path is None:
        raise RuntimeError("a call's function lives in the caller's __main__, which has no file "
                           "(python -c, stdin, a notebook); define it in an importable module")
    spec = importlib.util.spec_from_file_location(CALLER_MAIN, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load the caller's main program {path!r} to find a call's function")
    module = importlib.util.module_from_spec(spec)
    before = sys.modules.get(CALLER_MAIN)  # multiprocessing aliases it to this worker module
    sys.modules[CALLER_MAIN] = module
    loading_caller_main = True
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules[CALLER_MAIN] = before
        raise
    finally:
        loading_caller_main = False
    _caller_main = module
    return module


class _CallUnpickler(pickle.Unpickler):
    """Resolves names from the caller's ``__main__`` in its main program's file."""

    def __init__(self, data: bytes, main_path: str | None):
        import io

        super().__init__(io.BytesIO(data))
        self.main_path = main_path

    def find_class(self, module: str, name: str) -> Any:
        if module in ("__main__", CALLER_MAIN):
            module = _load_caller_main(self.main_path).__name__
        return super().find_class(module, name)


def _read_caller(conn: Connection, calls: queue.Queue, interrupt: threading.Event) -> None:
    """Reader thread: interrupts take effect at once; calls queue for the main thread."""
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)  # the caller is gone (or shut us down hard): nothing left to serve
        if msg[0] == "interrupt":
            interrupt.set() if msg[1] else interrupt.clear()
        else:
            calls.put(msg)
            if msg[0] == "stop":
                return


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m splash_rollout.distributed.worker",
                                description="one rank of a WorkerGroup (started by WorkerGroup, not by hand)")
    p.add_argument("--fd", type=int, required=True, help="inherited socket to the caller")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="TCP port of the process-group rendezvous")
    p.add_argument("--backend", default="gloo")
    p.add_argument("--timeout-s", type=float, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--main-path", default=None, help="the caller's main program, if it is a file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    from splash_rollout.distributed.faults import inject

    inject("rank_start", 0, args.rank, unit="stage")  # before the caller hears from us: a crash
    conn, lock = Connection(args.fd), threading.Lock()
    import splash_rollout

    send(conn, lock, ("hello", os.path.abspath(splash_rollout.__file__)))
    calls: queue.Queue = queue.Queue()
    interrupt = threading.Event()
    threading.Thread(target=_read_caller, args=(conn, calls, interrupt), name="splash-caller", daemon=True).start()
    try:
        import torch

        from splash_rollout.distributed.groups import init_process_groups
        from splash_rollout.distributed.launch import WorkerContext

        torch.set_num_threads(args.threads)
        if args.backend == "nccl":  # before the first NCCL call: each rank on its own GPU
            torch.cuda.set_device(args.rank % torch.cuda.device_count())
        inject("rank_start", 1, args.rank, unit="stage")  # a reported failure
        ctx = WorkerContext(init_process_groups(args.rank, args.world_size, "127.0.0.1", args.port, args.backend,
                                                args.timeout_s), interrupt=interrupt)
    except BaseException:  # noqa: BLE001 - reported to the caller, which raises
        send(conn, lock, ("start_error", traceback.format_exc()))
        return
    send(conn, lock, ("ready",))
    while True:
        msg = calls.get()
        if msg[0] == "stop":
            break
        _, call_id, payload = msg
        ctx._beat = lambda info, cid=call_id: send(conn, lock, ("beat", cid, info))
        try:
            fn, fn_args, fn_kwargs = _CallUnpickler(payload, args.main_path).load()
            reply = ("ok", call_id, fn(ctx, *fn_args, **fn_kwargs))
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:  # noqa: BLE001 - the caller raises it, naming this rank
            data = pickle.dumps(("error", call_id, traceback.format_exc()), protocol=pickle.HIGHEST_PROTOCOL)
        with lock:
            conn.send_bytes(data)
    from splash_rollout.distributed.groups import destroy_process_groups

    destroy_process_groups()
    # nothing is left to write back: skip the interpreter's teardown of torch (seconds of freeing
    # and finalisers), so a shut-down engine frees its cores at once
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
