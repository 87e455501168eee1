"""What fake steps that differ only in microbatch_tokens (plan.py's plan and its search) share: one
FakeTensorMode, one fake process group, the models the run builds (the policy with its adapters
and FSDP2 sharding, a live reference, a teacher), built and sharded once, and the policy's AdamW
state, allocated once. None of them depends on the budget; each step's data and tracker stay its
own."""
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode


class Reuse:
    def __init__(self):
        # the models' fake tensors belong to it: another mode may not mix with them
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        # kind ('policy', 'frozen') -> what the run built, in the order it built them
        self.built = {}
        # the policy's parameter -> its AdamW state
        self.optimizer_state = None

    def model(self, kind, index, build):
        """The run's index-th model of this kind, built by build() at the first step."""
        made = self.built.setdefault(kind, [])
        if index == len(made):
            made.append(build())
        return made[index]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        # the group the models' sharding holds, kept between the steps
        if dist.is_initialized():
            dist.destroy_process_group()
        self.built.clear()
        self.optimizer_state = None
