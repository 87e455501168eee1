"""
A distillation teacher: a frozen Hugging Face model beside the student, loaded as a live
reference is (reference.frozen_model: in the run's dtype, FSDP2-sharded like the student, no
gradients), run on the student's own packed micro-batch (prefix sharing and context parallelism
apply alike). Its vocabulary must be the student's: the token ids are shared.
  logps        its log-prob of each trained token (train_rl.py's on-policy distillation)
  distill_head the student's LM head replaced by the NLL + generalized JSD to the teacher through
               both heads, chunk by chunk (kernels.chunked_distill; train_sft.py)
"""
import torch

from nanopack import kernels
from nanopack.parallel import fail
from nanopack import reference
from nanopack.reference import Reference
from nanopack.startup import base_weights, initial_config


def _states(h, w, targets, vocab_size):
    # FSDP2 frees the gathered head after the forward: a copy outlives it
    return h.detach(), w[:vocab_size].detach().clone()


class Teacher(Reference):
    """A live Reference on other weights: logps(mb, temperature) as the reference's."""

    def distill_head(self, mb, beta, temperature, weight, scales=None):
        """The student's forward head for micro-batch mb: f(h, w, targets, V) -> (sum_t scale_t
        ((1 - weight) NLL_t + weight JSD_t), (NLL sum, JSD sum)); the teacher runs here, first."""
        with torch.no_grad(), self.autocast:
            h_t, w_t = self.model(**mb.inputs(), head=_states)

        def head(h, w, targets, vocab_size):
            return kernels.chunked_distill(h, w, targets, vocab_size, h_t, w_t, beta, temperature,
                                           weight, scales)
        return head


def load_teacher(run, name, student_config):
    """The `teacher` key's model (a Hugging Face folder; a hub name is resolved to one), frozen;
    a vocabulary unlike the student's stops the run with one line naming both."""
    if not name:
        fail("config error: distillation learns from a teacher: set --teacher to a Hugging Face "
             "folder or hub name whose vocabulary is the student's")
    start = dict(init_from=name, preset=None, weights=base_weights(name))
    config = initial_config(start, None)
    if config.vocab_size != student_config.vocab_size:
        fail(f"config error: teacher={name!r} has a vocabulary of "
                         f"{config.vocab_size:,} tokens and the student "
                         f"{student_config.vocab_size:,}: distillation compares their "
                         f"distributions token by token, so it needs a teacher with the student's "
                         f"tokenizer")
    return Teacher(model=reference.frozen_model(run, config, start), autocast=run.autocast)
