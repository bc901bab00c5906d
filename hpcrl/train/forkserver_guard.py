"""Imported first in the launcher's fork server (:func:`hpcrl.launch_local.worker_context`): the server dies with
the launcher that started it (``PR_SET_PDEATHSIG``), and with it every trainer process it forked (each dies with
the server, its parent: :func:`hpcrl.procs.die_with_parent` in :func:`hpcrl.launch_local._worker`), and rank 0's
engines with rank 0.

Without it a launcher killed with SIGKILL (``kill -9``, an OOM kill) left the server and the ranks running: the
ranks hold the server's liveness pipe (multiprocessing hands it to each child), so the server never saw its
launcher go, and the ranks, whose parent is the server, never got their death signal; a 2-rank run went on to its
last step with nobody to report to. Imports nothing heavy (a GPU launcher's server imports only this). Not to be
imported anywhere else: importing it ties the importer's life to its parent's.
"""

from __future__ import annotations

import os

from hpcrl.procs import LAUNCHER_PID_ENV, die_with_parent

die_with_parent()
# the launcher may have died before the line above ran: then no signal will come
if os.environ.get(LAUNCHER_PID_ENV, str(os.getppid())) != str(os.getppid()):
    os._exit(1)
