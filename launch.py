"""
torchrun, ending a run stopped by a signal as the workers do:
`python launch.py --nproc_per_node=8 train_sft.py ...`. On SIGTERM or Ctrl-C torchrun's own exit is
1 with ~30 lines of traceback, read as a crash; here it is 128 + the signal (143 SIGTERM, 130
Ctrl-C), which Slurm and Kubernetes read as stopped by a signal, not failed, once every worker saved
its stop; a worker that did not (killed, failed) makes it one line and exit 1. torchrun SIGKILLs a
worker still running 30 s after its signal, often before a big model's step and checkpoint end: here
it waits 600 s by default.
"""
import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import PContext, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main, parse_args

# a worker's exit after a SIGINT / SIGTERM it was sent itself (nanopack.run.Run.exit_stopped)
STOPPED = (128 + 2, 128 + 15)
# seconds; --shutdown_timeout=N (or TORCH_ELASTIC_SHUTDOWN_TIMEOUT) chooses another
SHUTDOWN_TIMEOUT = 600
torchrun_close = PContext.close
worker_exits = {}  # local rank -> exit code, of the workers torchrun stopped


def shutdown_timeout(argv, environ):
    """The seconds torchrun gives its workers to end after its signal; ours unless the user chose
    (sets environ)."""
    chosen = parse_args(argv).shutdown_timeout
    if chosen is None:
        chosen = int(environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT)))
    return chosen


def close_recording_exits(pcontext, *args, **kwargs):
    """torchrun stopping its workers, then their exit codes, which launch.py's exit reports."""
    try:
        torchrun_close(pcontext, *args, **kwargs)
    finally:
        # a second signal cuts torchrun's wait short: a worker still running (None) has not saved
        # either
        handlers = getattr(pcontext, "subprocess_handlers", {})
        worker_exits.update({rank: h.proc.poll() for rank, h in handlers.items()})


def exited(code):
    if code is None:
        return "still running"
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"


if __name__ == "__main__":
    timeout = shutdown_timeout(sys.argv[1:], os.environ)
    PContext.close = close_recording_exits
    try:
        main()
    except SignalException as e:
        lost = {rank: code for rank, code in worker_exits.items() if code not in STOPPED}
        # killed (SIGKILL past the timeout) or failed while saving: their steps since the checkpoint
        # are gone
        if lost:
            ranks = ", ".join(f"local rank {rank} {exited(code)}"
                              for rank, code in sorted(lost.items()))
            sys.exit(f"launch.py: {e.sigval.name}: the run was NOT saved ({ranks}; torchrun kills "
                     f"a worker still running {timeout} s after its signal): the steps since the "
                     "last checkpoint are lost; give a step and its checkpoint the time they take "
                     "with --shutdown_timeout=<seconds>")
        sys.exit(128 + e.sigval)
    except ChildFailedError as e:
        # the first worker to end was stopped by a signal sent to it, not to the launcher
        code = e.get_first_failure()[1].exitcode
        if code not in STOPPED:
            raise
        sys.exit(code)
