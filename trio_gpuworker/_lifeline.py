"""A worker never outlives its daemon (docs/architecture.md, 'Kill').

The daemon holds the write end of one pipe (close-on-exec, so no child ever inherits it) and every worker
inherits the read end (`GPUWORKER_LIFELINE_FD`). However the daemon ends, SIGKILL included, the kernel closes its
end; the worker's watcher thread then reads EOF and SIGKILLs the worker's own process group, so the worker and
everything it started (compiler and BEAM helper processes) go at once, even while its compute thread is busy and
its event loop never gets to see the socket's EOF. Any engine started through `worker_command` may do the same.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

LIFELINE_ENV = "GPUWORKER_LIFELINE_FD"


def watch_lifeline(environ: dict[str, str] | None = None) -> bool:
    """Start the watcher thread if the daemon handed a lifeline over; True if it did."""
    value = (os.environ if environ is None else environ).get(LIFELINE_ENV)
    if not value:
        return False
    fd = int(value)
    threading.Thread(target=_watch, args=(fd,), name="lifeline", daemon=True).start()
    return True


def _watch(fd: int) -> None:
    while True:
        try:
            if os.read(fd, 64) == b"":
                break  # every write end is closed: the daemon is gone
        except InterruptedError:
            continue
        except OSError:
            break
    die_with_the_daemon("its lifeline closed")


def die_with_the_daemon(why: str) -> None:
    """The daemon is gone: kill this worker's whole process group now (this process included)."""
    try:
        print(f"worker {os.getpid()}: the daemon is gone ({why}); stopping its process group", file=sys.stderr,
              flush=True)
    except (OSError, ValueError):
        pass
    if os.getpgrp() == os.getpid():  # the daemon started us as a group leader: the group is ours alone
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os._exit(1)
