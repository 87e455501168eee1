r"""
train_rl.py's rewards: `reward` names one function or several, comma-separated, each 'builtin' (the
arithmetic task's exact answer), 'math' (math_reward: a final answer checked with math-verify),
'none' (0 for every reply: on-policy distillation from its teacher alone) or 'module:function';
the total is their sum weighted by `reward_weights`. A function is called f(prompt messages, reply
text, **fields) with only the record fields its signature takes, and must return a finite number
(a bool, a numpy scalar or a 0-d tensor too).

    # records {"prompt": ..., "answer": "... #### 72"}
    python train_rl.py --data=gsm8k.jsonl --reward=math
    python train_rl.py --reward='math,my_rewards:short' --reward_weights=1,0.2
"""
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import signal
import sys
import threading
from functools import lru_cache

import numpy as np
import torch

from nanopack.parallel import stop_signal

BUILTIN = {"builtin": "data.arithmetic:reward", "math": "nanopack.rewards:math_reward",
           "none": "nanopack.rewards:no_reward"}
NUMBER_KINDS = "biuf"  # numpy dtype kinds of a reward: bool, signed and unsigned integers, floats


class RewardError(ValueError):
    """A reward that cannot be loaded, called or read as a number: the message is one line naming
    it."""


# what each key that names code loads: (what it is, its signature, the form, an example, a file)
LOADED = dict(
    reward=("a function", "a function (prompt, reply, **fields) -> float", "'module:function'",
            "my_rewards:exact, a function exact in my_rewards.py in this folder", "my_rewards.py"),
    env=("an environment class", "a class (**fields) with step(reply) -> (observation, reward, "
         "done)", "'module:Class'", "my_env:Game, a class Game in my_env.py in this folder",
         "my_env.py"),
    tools=("a function", "a function (**arguments) -> result", "'module:function'",
           "my_tools:add, a function add in my_tools.py in this folder", "my_tools.py"))


def load_function(name, key="reward"):
    """'builtin', 'math' or 'module:function' -> the function (or, key='env', a class); the module
    is imported from where the run starts."""
    what, signature, form, example, file = LOADED[key]
    module, colon, attr = (BUILTIN.get(name, name) if key == "reward" else name).partition(":")
    if not (module and colon and attr):
        raise RewardError(f"{key}={name!r}: name {what} as {form} (e.g. {example})"
                          + ", or use 'builtin', 'math' or 'none'" * (key == "reward"))
    if name == "math" and key == "reward" and importlib.util.find_spec("math_verify") is None:
        raise RewardError("reward='math' checks answers with math-verify: pip install math-verify")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # a my_rewards.py where the run is launched
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise RewardError(f"{key}={name!r}: {e}; name {signature} as {form}, the module "
                          f"importable from here (e.g. {file} in this folder)")
    except Exception as e:  # the user's module fails as it is imported
        raise RewardError(f"{key}={name!r}: importing {module} raised "
                          f"{type(e).__name__}: {e}") from None
    if not callable(fn):
        raise RewardError(f"{key}={name!r}: {module}.{attr} is a {type(fn).__name__}, not {what}")
    return fn


def fields_taken(fn, name):
    """-> (the record fields fn takes by name, None for all (**fields); those without a default)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: every field, as keywords
        return None, set()
    positional = [p for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in positional):
        raise RewardError(f"reward={name!r} takes {inspect.signature(fn)}, not (prompt, reply); a "
                          "reward is called f(prompt messages, reply text, **fields)")
    named = [p for p in params[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    every = any(p.kind == p.VAR_KEYWORD for p in params)
    # a field named as prompt's or reply's parameter would be passed twice by **fields
    own = {p.name for p in params[:2] if p.kind == p.POSITIONAL_OR_KEYWORD}
    required = {p.name for p in named if p.default is p.empty}
    return None if every else {p.name for p in named}, required, own


def parse_weights(weights, names):
    """reward_weights (None: 1 each; a number; a list or tuple of numbers) -> one float per reward,
    in order."""
    given = [1.0] * len(names) if weights is None else weights
    given = list(given) if isinstance(given, (list, tuple)) else [given]
    if not all(isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w)
               for w in given):
        raise RewardError(f"reward_weights={weights!r}; give one finite number per reward, in "
                          "order, e.g. --reward_weights=1,0.5")
    if len(given) != len(names):
        raise RewardError(f"reward_weights={weights!r} has {len(given)} weight(s) for {len(names)} "
                          f"rewards ({', '.join(names)}); give one per reward, in the same order")
    return np.array(given, dtype=np.float64)


def as_number(value):
    """A reward's value -> float, or None for what is not one number: a str, None, a list, a complex
    number."""
    if isinstance(value, (numbers.Real, np.bool_)):
        return float(value)
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in NUMBER_KINDS:
        return float(value)
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_complex():
        return float(value)
    return None


class Rewards:
    """The run's reward functions (names as written), each with its weight: call it on a reply for
    each one's reward."""

    def __init__(self, spec, weights=None):
        self.names = [name.strip() for name in spec.split(",")]
        if len(set(self.names)) < len(self.names):
            raise RewardError(f"reward={spec!r} names a function twice; give each once (and weigh "
                              "it)")
        self.weights = parse_weights(weights, self.names)
        self.fns = [load_function(name) for name in self.names]
        self.fields = [fields_taken(fn, name) for fn, name in zip(self.fns, self.names)]

    def __str__(self):
        if len(self.names) == 1:
            return self.names[0]
        return " + ".join(f"{w:g} x {name}" for name, w in zip(self.names, self.weights))

    def check_fields(self, fields, where):
        """A record field a reward takes without a default, missing: a RewardError now rather than
        at a later step."""
        for name, (taken, required, own) in zip(self.names, self.fields):
            missing = sorted(required - set(fields))
            if missing:
                raise RewardError(f"{where}: reward {name} takes {', '.join(map(repr, missing))}, "
                                  "which the record lacks (its fields: "
                                  f"{', '.join(map(repr, sorted(fields))) or 'none'}); add it to "
                                  "every record, or give the parameter a default")
            clash = sorted(own & set(fields)) if taken is None else []
            if clash:
                raise RewardError(f"{where}: the record's field {clash[0]!r} has the name of "
                                  f"reward {name}'s own argument ({', '.join(own)}), which "
                                  "**fields would pass twice; rename the field "
                                  f"(--fields={clash[0]}:{clash[0]}_field) or the argument")

    def check_values(self, fields, where):
        """-> a RewardError for a field value a reward cannot score (its `check`: the math reward's
        answer that math-verify cannot read), else None: found before training, not at a later
        step."""
        for name, fn, (taken, _, _) in zip(self.names, self.fns, self.fields):
            kwargs = fields if taken is None else {k: v for k, v in fields.items() if k in taken}
            try:
                getattr(fn, "check", lambda **_: None)(**kwargs)
            except ValueError as e:
                return RewardError(f"{where}: reward {name} cannot score this record: {e}")
        return None

    def score(self, prompts, replies, num_samples, decode):
        """-> (total rewards (N,), each function's own (N, F)) of the N = len(prompts) x
        num_samples replies (token lists, decode -> text); a failing function stops the run in one
        line. Host values: plan.py's fake tensors would hide them."""
        each = np.zeros((len(replies), len(self.names)))
        for i, reply in enumerate(replies):
            _, messages, fields, where = prompts[i // num_samples]
            try:
                each[i] = self(messages, decode(reply), fields, where)
            except RewardError as e:
                raise SystemExit(f"{e}; nothing from this step is trained or saved") from None
        return each @ self.weights, each

    def __call__(self, prompt, reply, fields, where):
        """-> (len(names),) each function's reward of `reply` to the prompt at `where` (record
        fields `fields`)."""
        out = np.empty(len(self.fns))
        for i, (name, fn, (taken, _, _)) in enumerate(zip(self.names, self.fns, self.fields)):
            kwargs = fields if taken is None else {k: v for k, v in fields.items() if k in taken}
            try:
                value = fn(prompt, reply, **kwargs)
            except (Exception, SystemExit, KeyboardInterrupt) as e:
                if stop_signal.name or isinstance(e, KeyboardInterrupt) and ctrl_c_raises():
                    raise  # a real Ctrl-C or SIGTERM (a second one raises in the handler): a stop
                raise RewardError(f"reward {name} raised {type(e).__name__}: {e} (prompt {where}, "
                                  f"reply {reply!r})") from None
            out[i] = number = as_number(value)
            if number is None or not math.isfinite(number):
                got = f"{value!r:.60}" + f" (a {type(value).__name__})" * (number is None)
                raise RewardError(f"reward {name} returned {got} for prompt {where} (reply "
                                  f"{reply!r}); a reward must be a finite number (an int, float or "
                                  "bool, a numpy scalar or 0-d tensor)")
        return out


def ctrl_c_raises():
    """Python's own SIGINT handler (no run's StopSignal): a KeyboardInterrupt may be a real
    Ctrl-C."""
    return signal.getsignal(signal.SIGINT) is signal.default_int_handler


@lru_cache(maxsize=4096)  # a prompt's k replies, step after step, share its answer
def parse_answer(answer):
    r"""A record's answer (as text) -> math-verify's parse of it: GSM8K's text after '####', MATH's
    \boxed{...} (or $...$) as it is, else the whole answer read as LaTeX."""
    from math_verify import parse
    text = answer
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    elif "\\boxed" not in text and "$" not in text:
        # bare LaTeX (\sqrt{2}, p - q) is read only inside math delimiters
        text = f"\\boxed{{{text}}}"
    parsed = parse(text, parsing_timeout=timeout_seconds())
    if not parsed:
        raise ValueError(f"answer {answer!r} is no math that math-verify can read; write it as a "
                         "number or LaTeX")
    return parsed


def timeout_seconds():
    """math-verify's timeout is signal.alarm, which only the main thread may set: elsewhere,
    none."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_reward(prompt, reply, answer):
    r"""1.0 if the reply's final answer (its \boxed{}, else after 'answer:', else its last number,
    as math-verify finds it) equals the record's `answer` (a number, LaTeX, GSM8K's '... #### 72',
    MATH's \boxed{...}) as math, else 0.0."""
    from math_verify import parse, verify
    return float(verify(parse_answer(str(answer)), parse(reply, parsing_timeout=timeout_seconds()),
                        timeout_seconds=timeout_seconds()))


# each record's answer, read before training
math_reward.check = lambda answer, **_: parse_answer(str(answer))


def no_reward(prompt, reply):
    """reward='none': no reward, for a run that learns from a teacher alone."""
    return 0.0
