"""Under mpirun/mpiexec or srun, a rank that raises ends the whole job.

MPI launchers wait for every rank to exit. A rank that dies of an exception leaves the others computing
(or blocked in a collective until the backend's timeout): the job runs on for minutes, and the traceback
that matters scrolls away. `install()` (called by `toolkit.runtime.init()`) chains an excepthook that
prints the traceback once (torch's own hook prefixes it with `[rankN]:`), then ends the job: `MPI_Abort`
under mpirun/mpiexec (via mpi4py), `scancel` of this job step under SLURM's srun. A rank that fails only
because another one did prints one line instead of a second traceback.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys


def install(rank: int, launcher: str) -> None:
    """Chain the job-ending hook onto whatever excepthook is installed now (torch's, after init)."""
    previous = sys.excepthook

    def end_the_job(kind, value, tb):
        from .blame import is_consequence

        if is_consequence(value):
            print(f"[rank{rank}]: {kind.__name__} because another rank failed (its traceback is the one to read)",
                  file=sys.stderr)
        else:
            previous(kind, value, tb)
        print(f"[rank{rank}]: toolkit: rank {rank} raised {kind.__name__}; ending the whole job "
              f"({how(launcher)}) so the other ranks do not run on.", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        abort(launcher)

    sys.excepthook = end_the_job


def how(launcher: str, environ=None) -> str:
    """Which way the job is ended under this launcher."""
    environ = os.environ if environ is None else environ
    if launcher == "slurm" and "SLURM_STEP_ID" in environ and shutil.which("scancel"):
        return "scancel"
    return "MPI_Abort"


def abort(launcher: str) -> None:
    if how(launcher) == "scancel":  # ends every task of this step, MPI or not
        step = f"{os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_STEP_ID']}"
        subprocess.run(["scancel", "--signal=KILL", step], check=False)
    else:
        try:
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)
        except ImportError:
            pass
    os._exit(1)
