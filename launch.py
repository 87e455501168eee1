"""
torchrun, ending a run stopped by a signal as the workers do: `python launch.py --nproc_per_node=8 train_sft.py ...`
takes torchrun's own arguments. On SIGTERM (a preemption) or Ctrl-C, torchrun passes the signal to the workers, which
save a checkpoint and print how to resume, and waits for them (its --shutdown_timeout); then it raises SignalException:
~30 lines of traceback and exit 1, read as a crash. Here it exits 128 + the signal instead (143 for SIGTERM, 130 for
Ctrl-C), what a process killed by it reports and Slurm and Kubernetes read as stopped by a signal, not failed.
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
