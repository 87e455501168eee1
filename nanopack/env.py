"""
Environments and tools for multi-turn RL: the model acts, the environment answers.

An environment is a class made per trajectory from its record's fields, Class(**fields), with
step(reply_text) -> (observation, reward, done): the observation a string (the next user turn), a
message dict (e.g. {"role": "tool", "content": ...}) or a list of them, None when done. Tools are
the common case: ToolEnv runs Python functions the model calls in its template's tool-call format.

Token in, token out: a trajectory is the prompt's ids, then each turn's sampled ids exactly as
sampled, then each observation's ids as the model's template renders the new messages after them
(found as the difference of the conversation rendered with and without them). A sampled reply is
decoded to show it to the environment and the template, never encoded again.
"""
import inspect
import json
import re
import time
from dataclasses import dataclass, field

from nanopack.rewards import RewardError, load_function

# Qwen2.5/Qwen3/Hermes: each call a JSON object between these tags
CALL_RE = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)
JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array",
              dict: "object"}


class EnvError(RuntimeError):
    """An environment that cannot be made or that raised: one line naming it, the record, the
    turn."""


class BadCall(ValueError):
    """A tool call that does not parse or names no tool: the environment answers with its text."""


def load_env(name):
    """'module:Class' -> the class; the module is imported from where the run starts."""
    try:
        return load_function(name, key="env")
    except RewardError as e:
        raise EnvError(str(e)) from None


def parse_tool_calls(text):
    """A reply's text -> [(name, arguments dict)]: <tool_call>{json}</tool_call> blocks (Qwen2.5,
    Qwen3, Hermes) or a reply that is one JSON object {"name", "arguments" or "parameters"} (Llama
    3.1/3.2); [] when it calls nothing. BadCall when a call is there and does not parse."""
    if "<tool_call>" in text:
        blocks = CALL_RE.findall(text)
        if any(not close for _, close in blocks):
            raise BadCall("a <tool_call> with no </tool_call> after it")
        return [one_call(body) for body, _ in blocks]
    stripped = text.strip()
    if stripped.startswith("{") and '"name"' in stripped:
        return [one_call(stripped)]
    return []


def one_call(body):
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        raise BadCall(f"the tool call is not JSON ({e.msg} at character {e.pos}): "
                      f"{body.strip()[:80]}")
    arguments = None
    if isinstance(call, dict):
        arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) \
            or not isinstance(arguments, dict):
        raise BadCall('a tool call is {"name": ..., "arguments": {...}}: got '
                      f"{body.strip()[:80]}")
    return call["name"], arguments


def tool_schema(fn):
    """A Python function -> its JSON schema as chat templates read tools: the name, the docstring's
    first line, each parameter's type from its annotation (str when none)."""
    params = inspect.signature(fn).parameters.values()
    properties = {p.name: {"type": JSON_TYPES.get(p.annotation, "string")} for p in params}
    required = [p.name for p in params if p.default is inspect.Parameter.empty]
    doc = (inspect.getdoc(fn) or fn.__name__).splitlines()[0]
    return {"type": "function", "function": {
        "name": fn.__name__, "description": doc,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


class ToolEnv:
    """The model calls tools in its template's format; each call's result is a tool message. A reply
    that calls nothing ends the trajectory (its answer is scored by --reward); a call that does not
    parse, names no tool or raises is answered with the error, so the model can try again."""

    def __init__(self, tools, **fields):
        self.tools = {fn.__name__: fn for fn in tools}
        self.fields, self.calls, self.bad_calls = fields, 0, 0

    def step(self, reply):
        try:
            calls = parse_tool_calls(reply)
        except BadCall as e:
            self.bad_calls += 1
            return dict(role="tool", content=f"error: {e}"), 0.0, False
        if not calls:
            return None, 0.0, True
        results = []
        for name, arguments in calls:
            self.calls += 1
            results.append(dict(role="tool", name=name, content=self.run(name, arguments)))
        return results, 0.0, False

    def run(self, name, arguments):
        if name not in self.tools:
            self.bad_calls += 1
            return f"error: no tool {name!r}; the tools are {', '.join(self.tools)}"
        try:
            result = self.tools[name](**arguments)
        except Exception as e:  # the model's arguments were wrong: it reads why and may retry
            self.bad_calls += 1
            return f"error: {name} raised {type(e).__name__}: {e}"
        return result if isinstance(result, str) else json.dumps(result)


def load_tools(names):
    """'module:function,module:function' -> the functions."""
    try:
        return [load_function(n, key="tools") for n in names.split(",")]
    except RewardError as e:
        raise EnvError(str(e)) from None


class Multiturn:
    """train_rl.py's --env / --tools: each record's trajectories made with an environment from its
    fields (ToolEnv for --tools), at most max_turns replies each. env: 'builtin' (the built-in
    task's follow-up questions) or 'module:Class'; tools: 'module:function,...'."""

    def __init__(self, env, tools, max_turns):
        name = "data.arithmetic:FollowUps" if env == "builtin" else env
        self.name = name or "ToolEnv"
        self.env_class = load_env(name) if name else None
        self.tools = load_tools(tools) if tools else []
        self.schemas = [tool_schema(fn) for fn in self.tools]
        self.max_turns = max_turns

    def make(self, fields, where):
        """An environment from a record's fields, those of the template left out."""
        own = {k: v for k, v in fields.items() if k not in ("tools", "chat_template_kwargs")}
        try:
            return self.env_class(**own) if self.env_class else ToolEnv(self.tools, **own)
        except Exception as e:
            raise EnvError(f"env {self.name}(**fields) raised {type(e).__name__}: {e} ({where}; "
                           f"its fields: {', '.join(own) or 'none'})") from None


def as_messages(observation):
    if isinstance(observation, str):
        return [dict(role="user", content=observation)]
    return [observation] if isinstance(observation, dict) else list(observation)


def reply_message(text):
    """A sampled reply as the template re-renders it: its tool calls as tool_calls, the rest as
    content (only the observation's ids are taken from that render)."""
    try:
        calls = parse_tool_calls(text)
    except BadCall:
        calls = []
    if not calls:
        return dict(role="assistant", content=text)
    content = CALL_RE.sub("", text).strip() if "<tool_call>" in text else ""
    return dict(role="assistant", content=content, tool_calls=[
        {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls])


def nth_stop(ids, n, stop_ids):
    """The index of the n-th stop token in ids (n >= 1), or None."""
    seen = 0
    for i, t in enumerate(ids):
        seen += t in stop_ids
        if seen == n:
            return i
    return None


def observation_ids(tok, conversation, reply_text, new, **template):
    """The ids the template writes after a sampled reply for the new messages, through the next
    generation header -> (ids, the template's render of the conversation through the reply).
    conversation: the messages before the reply. The reply ends with its turn's stop token, so the
    observation is whatever follows the same number of stop tokens in the render with it.
    template: the prompt's template inputs (tools, chat_template_kwargs)."""
    before = tok.render(conversation, add_generation_prompt=True, **template)[0]
    n = sum(t in tok.stop_ids for t in before) + 1
    full = tok.render(conversation + [reply_message(reply_text)] + new,
                      add_generation_prompt=True, **template)[0]
    end = nth_stop(full, n, tok.stop_ids)
    if end is None:
        raise EnvError("the chat template wrote no end-of-turn token after the model's reply, so "
                       "the observation cannot be placed after it")
    return full[end + 1:], full[:end + 1]


@dataclass
class Trajectory:
    """One trajectory after its prompt: ids (sampled and observation tokens in order), mask (1
    sampled, 0 observation), the sampler's log-prob of each (NaN: an observation's), what the
    environment said and did."""
    prompt: list
    messages: list
    env: object
    template: dict = field(default_factory=dict)  # the prompt's template inputs (tools, ...)
    ids: list = field(default_factory=list)
    mask: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    observation_tokens: int = 0
    redrawn: int = 0  # turns the template renders otherwise in the history (e.g. reasoning dropped)
    truncated: bool = False
    done: bool = False
    env_seconds: float = 0.0
    tool_calls: int = 0
    bad_calls: int = 0

    def last_reply(self):
        """The ids of the trajectory's last sampled reply (it ends with one)."""
        n = next((i for i, m in enumerate(reversed(self.mask)) if not m), len(self.mask))
        return self.ids[len(self.ids) - n:]

    def finish(self):
        """Keep the environment's counts, drop the environment (it may not pickle across ranks)."""
        self.tool_calls = getattr(self.env, "calls", 0)
        self.bad_calls = getattr(self.env, "bad_calls", 0)
        self.env = None


def rollout(turn, tok, trajectories, max_turns, max_tokens, where, more=bool):
    """Run trajectories to their end, turn by turn, all live ones in one call per turn.
    turn(rows, new, budgets) -> each row's next reply as (sampled ids, their log-probs), its stop
    token included: rows index trajectories, new[i] the ids appended to trajectory rows[i] since its
    last reply (its prompt at the first turn, then an observation: a generator that keeps each
    trajectory's KV cache reads only those), budgets the new tokens each may take. A trajectory
    ends when its environment says done, at max_turns, when a reply is cut (no stop token), or at
    max_tokens after its prompt; the last three count as truncated. where(i): trajectory i's record,
    for errors. more(live): whether to take another turn (FSDP: while any rank has live ones)."""
    live, new = list(range(len(trajectories))), [t.prompt for t in trajectories]
    while more(live):
        budgets = [max_tokens - len(trajectories[i].ids) for i in live]
        replies = turn(live, new, budgets)
        still, new = [], []
        for i, (ids, logps) in zip(live, replies):
            t = trajectories[i]
            before = len(t.ids) + len(ids)
            if take_turn(tok, t, ids, logps, max_turns, max_tokens, where(i)):
                still.append(i)
                new.append(t.ids[before:])
        live = still
    return trajectories


def take_turn(tok, t, reply, logps, max_turns, max_tokens, where):
    """Append a sampled reply and the environment's answer -> whether the trajectory goes on."""
    t.ids += reply
    t.mask += [1] * len(reply)
    t.logprobs += list(logps)
    t.turns += 1
    text = tok.decode_reply(reply)
    if not reply or reply[-1] not in tok.stop_ids:
        t.truncated = t.done = True
        t.messages.append(dict(role="assistant", content=text))
        return False
    t0 = time.perf_counter()
    try:
        observation, reward, done = t.env.step(text)
        reward = float(reward)
    except Exception as e:
        raise EnvError(f"env {type(t.env).__name__}.step raised {type(e).__name__}: {e} ({where}, "
                       f"turn {t.turns})") from None
    t.env_seconds += time.perf_counter() - t0
    t.reward += reward
    if done or observation is None:
        t.done = True
        t.messages.append(dict(role="assistant", content=text))
        return False
    new = as_messages(observation)
    ids, rendered = observation_ids(tok, t.messages, text, new, **t.template)
    t.redrawn += rendered[:-1] != (t.prompt + t.ids)[:-1]
    t.messages.append(reply_message(text))
    if t.turns >= max_turns or len(t.ids) + len(ids) >= max_tokens:
        t.truncated = t.done = True
        return False
    t.messages += new
    t.ids += ids
    t.mask += [0] * len(ids)
    t.logprobs += [float("nan")] * len(ids)
    t.observation_tokens += len(ids)
    return True
