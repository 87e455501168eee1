"""
RL's rollouts: a step's prompts drawn from the shuffled stream, k replies to each sampled by the
engine (nanopack/generate.py), scored by the rewards; with dynamic sampling (DAPO) the groups whose
rewards are all equal are dropped and more prompts sampled. Each reply's random stream is keyed by
(seed, prompt position, reply), so a step's samples depend neither on the world size nor on a
resume; each sampled token keeps its log-prob as the sampler computed it.
"""
import math
import time
from functools import lru_cache

import numpy as np
import torch

from data.messages import template_inputs
from nanopack import generate as generation
from nanopack.env import EnvError, Trajectory, rollout
from nanopack.parallel import all_reduce_max, all_reduce_sum


def teaches(rewards):
    """(G, k) -> (G,) whether a group's rewards differ: one whose k rewards are equal has all
    advantages 0."""
    return rewards.max(1, initial=-math.inf) > rewards.min(1, initial=math.inf)


class Rollouts:
    """run: the script's run (ranks, CP group, autocast); prompts: (ids, messages, fields, where)
    records; config: the script's keys (k, prompts_per_step, temperature, top_p, max_new_tokens,
    dynamic_sampling, max_extra_rounds, seed); multiturn: env.Multiturn (--env, --tools) or None:
    a reply is then a trajectory, max_new_tokens its tokens after the prompt."""

    def __init__(self, run, config, prompts, rewards, model, raw_model, tok, sync_ranks,
                 multiturn=None):
        self.run, self.config, self.prompts, self.rewards = run, config, prompts, rewards
        self.model, self.raw_model, self.tok, self.sync_ranks = model, raw_model, tok, sync_ranks
        self.first_in_cp, self.multiturn = run.cp.rank == 0, multiturn

    @lru_cache(maxsize=2)
    def permutation(self, epoch):
        return np.random.default_rng((self.config["seed"], epoch)).permutation(len(self.prompts))

    def generate(self, prompts, **sampling):
        """The engine's replies to prompt records -> (token lists, the sampler's log-prob lists),
        the model in eval mode, under the run's autocast."""
        self.model.eval()
        with self.run.autocast:
            # through the module, where plan.py's fake step patches it
            out = generation.generate(self.raw_model, [p[0] for p in prompts],
                                      self.config["max_new_tokens"], self.tok.stop_ids,
                                      sync_ranks=self.sync_ranks, logprobs=True, **sampling)
        self.model.train()
        return out

    def play(self, prompts, keys, k, temperature):
        """k trajectories of each prompt record, each with its own environment, to their end ->
        [Trajectory], prompt i's j-th at i * k + j. Each turn reads only what is new (the prompt,
        then each observation) into the reply's live slot of the engine's KV cache."""
        c, mt = self.config, self.multiturn
        try:
            trajectories = [Trajectory(p[0], list(p[1]), mt.make(p[2], p[3]),
                                       template_inputs(p[2], p[3], mt.schemas))
                            for p in prompts for _ in range(k)]
        except EnvError as e:
            raise SystemExit(str(e)) from None
        engine = generation.Engine(self.raw_model, keep_slots=True, sync_ranks=self.sync_ranks)
        sampling = generation.Sampling(c["max_new_tokens"], temperature, None, c["top_p"],
                                       tuple(self.tok.stop_ids), c["seed"])
        replies = []

        def turn(rows, new, budgets):
            if not replies:  # the first turn: each prompt read once for its k replies
                replies.extend(engine.generate([p[0] for p in prompts], sampling, k, keys))
                return [(r.tokens, r.logprobs) for r in replies]
            chosen = [replies[i] for i in rows]
            starts = [len(r.tokens) + len(n) for r, n in zip(chosen, new)]
            engine.extend(chosen, new, budgets, sampling)
            return [(r.tokens[s:], r.logprobs[s:]) for r, s in zip(chosen, starts)]

        def more(live):  # FSDP: every forward is a collective, so every rank takes each turn
            return all_reduce_max(int(bool(live)), self.run.device) > 0 if self.sync_ranks \
                else bool(live)

        self.model.eval()
        with self.run.autocast:
            try:
                rollout(turn, self.tok, trajectories, mt.max_turns, c["max_new_tokens"],
                        lambda i: prompts[i // k][3], more)
            except EnvError as e:
                raise SystemExit(f"{e}; nothing from this step is trained or saved") from None
        self.model.train()
        for t in trajectories:
            t.finish()
        return trajectories

    def score(self, prompts, replies, k, trajectories=None):
        """-> (total rewards (N,), each reward function's (N, F)) of N = len(prompts) x k replies;
        a trajectory's total: its environment's rewards summed, plus the reward functions' of its
        last reply to the conversation before it."""
        if trajectories is None:
            return self.rewards.score(prompts, replies, k, self.tok.decode_reply)
        finals = [(None, t.messages[:-1], *prompts[i // k][2:]) for i, t in enumerate(trajectories)]
        total, each = self.rewards.score(finals, [t.last_reply() for t in trajectories], 1,
                                         self.tok.decode_reply)
        return total + np.array([t.reward for t in trajectories]), each

    def sample(self, first):
        """This rank's share of the prompts at stream positions first .. first + prompts_per_step
        -> (their positions, prompts, k token lists per prompt, k sampler log-prob lists per
        prompt, k trajectories per prompt (None: single-turn), rewards (G, k), each reward
        function's (G * k, F), seconds in `reward`)."""
        c, cp, n, k = self.config, self.run.cp, len(self.prompts), self.config["k"]
        mine = list(range(first + cp.data_rank, first + c["prompts_per_step"], cp.data_size))
        prompts = [self.prompts[self.permutation(i // n)[i % n]] for i in mine]
        trajectories = None
        if self.multiturn:
            trajectories = self.play(prompts, mine, k, c["temperature"])
            replies, logps = [t.ids for t in trajectories], [t.logprobs for t in trajectories]
        else:
            replies, logps = self.generate(prompts, temperature=c["temperature"],
                                           top_p=c["top_p"], seed=c["seed"], keys=mine,
                                           num_samples=k)
        t0 = time.perf_counter()
        scored = self.score(prompts, replies, k, trajectories) if self.first_in_cp else None
        # a CP group's first rank's replies and rewards are the group's: a nondeterministic
        # kernel or reward cannot set its ranks apart
        (replies, logps, trajectories), (rewards, each) = cp.broadcast(
            ((replies, logps, trajectories), scored))
        groups, logps, trajectories = ([x[g * k:(g + 1) * k] for g in range(len(prompts))]
                                       if x is not None else [None] * len(prompts)
                                       for x in (replies, logps, trajectories))
        return (mine, prompts, groups, logps, trajectories, rewards.reshape(-1, k), each,
                time.perf_counter() - t0)

    def collect(self, first):
        """One step's groups from prompt stream position `first` -> ((prompts, replies, sampler
        log-probs, trajectories, rewards) to train, (every reply sampled, every reward, each reward
        function's, every trajectory, rounds), seconds in `reward`, the next position).
        dynamic_sampling (DAPO): groups whose rewards are all equal are dropped and rounds of
        prompts_per_step more prompts sampled until prompts_per_step groups teach something (the
        first ones in the stream: the same on any world size), or max_extra_rounds were sampled."""
        c, device = self.config, self.run.device
        per_step = c["prompts_per_step"]
        kept, sampled, reward_s, rounds, n_kept = ([], [], [], [], []), ([], [], [], []), 0.0, 0, 0
        while True:
            positions, prompts, replies, logps, trajectories, rewards, each, seconds = \
                self.sample(first)
            for part, x in zip(sampled, (replies, [rewards], [each], trajectories)):
                part.extend(x)
            reward_s, rounds = reward_s + seconds, rounds + 1
            if not c["dynamic_sampling"]:
                to_train = (prompts, replies, logps, trajectories, rewards)
                return to_train, (*sampled, rounds), reward_s, first + per_step
            flags = np.zeros(per_step)
            flags[np.array(positions, dtype=np.int64) - first] = teaches(rewards)
            teaching = np.flatnonzero(np.array(all_reduce_sum(flags.tolist(), device)))
            chosen = teaching[:per_step - n_kept] + first
            for g in np.flatnonzero(np.isin(positions, chosen)):
                for part, x in zip(kept, (prompts[g], replies[g], logps[g], trajectories[g],
                                          rewards[g])):
                    part.append(x)
            n_kept, first = n_kept + len(chosen), first + per_step
            # the step trains what it has: its line says so
            if n_kept == per_step or rounds > c["max_extra_rounds"]:
                to_train = (*kept[:4], np.array(kept[4]).reshape(-1, c["k"]))
                return to_train, (*sampled, rounds), reward_s, first


def sampled_tokens(group, trajectories, stop_ids):
    """A group's replies -> (each one's mask: 1 on sampled tokens, 0 on a trajectory's
    observations; whether each was cut: no stop token, or a trajectory's limits)."""
    if trajectories is None:
        return [np.ones(len(r)) for r in group], [not r or r[-1] not in stop_ids for r in group]
    return [np.array(t.mask, dtype=np.float64) for t in trajectories], [
        t.truncated for t in trajectories]


def sampler_logps(logps, keep, masks, units, k):
    """The sampler's log-probs of a micro-batch's trained tokens, in its packed order: groups
    `units` (indices into `keep`, the kept groups), k replies each, the tokens their masks train."""
    out = [np.asarray(logps[keep[u]][j], dtype=np.float64)[masks[u][j] != 0]
           for u in units.tolist() for j in range(k)]
    return torch.from_numpy(np.concatenate(out) if out else np.zeros(0)).float()


TRAJECTORY_SUMS = ("turns", "observation_tokens", "tool_calls", "bad_calls", "redrawn",
                   "env_seconds")


def trajectory_sums(groups):
    """A step's trajectories (k per group; a group of None: single-turn) -> their sums by name."""
    every = [t for group in groups if group is not None for t in group]
    return {name: sum(getattr(t, name) for t in every) for name in TRAJECTORY_SUMS}


def trajectory_log(totals, n, world_size):
    """The step's trajectory sums over all ranks, n trajectories -> (the metrics: means per
    trajectory, the environment's milliseconds per rank; their part of the log line)."""
    m = {f"{name}_mean": totals[name] / n for name in TRAJECTORY_SUMS[:-1]}
    m["env_ms"] = 1000 * totals["env_seconds"] / world_size
    calls = f", tool calls {m['tool_calls_mean']:.2f} ({m['bad_calls_mean']:.2f} bad)" * bool(
        totals["tool_calls"] + totals["bad_calls"])
    line = (f" | turns {m['turns_mean']:.2f}, observations {m['observation_tokens_mean']:.1f} "
            f"tokens{calls}, env {m['env_ms']:.0f} ms")
    return m, line
