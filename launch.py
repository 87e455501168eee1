"""
torchrun, ending a run stopped by a signal as the workers do: `python launch.py --nproc_per_node=8 train_sft.py ...`.
On SIGTERM or Ctrl-C torchrun's own exit is 1 with ~30 lines of traceback, read as a crash; here it is 128 + the
signal (143 SIGTERM, 130 Ctrl-C), which Slurm and Kubernetes read as stopped by a signal, not failed.
"""
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

STOPPED = (128 + 2, 128 + 15)  # a worker's exit after a SIGINT / SIGTERM it was sent itself (common.Run.exit_stopped)

if __name__ == "__main__":
    try:
        main()
    except SignalException as e:
        sys.exit(128 + e.sigval)
    except ChildFailedError as e:  # the first worker to end was stopped by a signal sent to it, not to the launcher
        code = e.get_first_failure()[1].exitcode
        if code not in STOPPED:
            raise
        sys.exit(code)
