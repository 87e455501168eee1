"""Environments and tools (nanopack/env.py): tool calls parsed as the templates write them, observations rendered
through the real Qwen2.5 template as the difference of the conversation with and without them, trajectories that keep
the sampled ids (never re-encoded), observation tokens masked out, limits counted as truncated, a raising
environment one line naming it, the record and the turn."""
import math

import pytest

from test_reasoning_tools import FOLDERS, U, call, folders  # noqa: F401 (the fixture)

from nanopack.env import (BadCall, EnvError, ToolEnv, Trajectory, load_env, load_tools, observation_ids,
                          parse_tool_calls, rollout, tool_schema)
from nanopack.tokenizer import get_tokenizer

PARIS = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def add(a: int, b: int):
    """Add two integers."""
    return a + b


def test_tool_calls_parse_as_templates_write_them():
    assert parse_tool_calls(PARIS) == [("add", {"a": 2, "b": 3})]
    two = f"Let me add.\n{PARIS}\n" + PARIS.replace("2", "7")
    assert parse_tool_calls(two) == [("add", {"a": 2, "b": 3}), ("add", {"a": 7, "b": 3})]
    # Llama 3.1's: the reply is the call; arguments as a JSON string too
    assert parse_tool_calls('{"name": "add", "parameters": {"a": 1, "b": 1}}') == [("add", {"a": 1, "b": 1})]
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>') == \
        [("add", {"a": 1})]
    assert parse_tool_calls("2+3 = 5") == []
    for bad, says in [("<tool_call>\n{\"name\": \"add\"", "no </tool_call>"),
                      ("<tool_call>{name: add}</tool_call>", "not JSON"),
                      ('<tool_call>{"arguments": {}}</tool_call>', '{"name": ..., "arguments": {...}}')]:
        with pytest.raises(BadCall, match=says):
            parse_tool_calls(bad)


def test_tool_schema_from_the_signature():
    f = tool_schema(add)["function"]
    assert f["name"] == "add" and f["description"] == "Add two integers."
    assert f["parameters"] == {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                               "required": ["a", "b"]}


def test_tool_env_runs_calls_and_answers_errors():
    env = ToolEnv([add], answer=5)
    obs, reward, done = env.step(PARIS)
    assert obs == [dict(role="tool", name="add", content="5")] and not done and reward == 0.0
    obs, _, done = env.step("<tool_call>{oops}</tool_call>")
    assert obs["content"].startswith("error: the tool call is not JSON") and not done
    obs, _, _ = env.step('<tool_call>{"name": "mul", "arguments": {}}</tool_call>')
    assert obs[0]["content"] == "error: no tool 'mul'; the tools are add"
    obs, _, _ = env.step('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    assert obs[0]["content"].startswith("error: add raised TypeError")
    assert (env.calls, env.bad_calls) == (3, 3)
    assert env.step("The answer is 5.") == (None, 0.0, True)


def test_loading_names_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_env.py").write_text("class Game:\n    def __init__(self, **f): pass\nX = 3\n"
                                        "def add(a: int, b: int):\n    return a + b\n")
    assert load_env("my_env:Game").__name__ == "Game"
    assert [f.__name__ for f in load_tools("my_env:add")] == ["add"]
    with pytest.raises(EnvError, match=r"^env='Game': name an environment class as 'module:Class'"):
        load_env("Game")
    with pytest.raises(EnvError, match=r"^tools='my_env:X': my_env.X is a int, not a function$"):
        load_tools("my_env:X")


@pytest.fixture(scope="module")
def qwen(folders):  # noqa: F811 (the fixture imported above)
    return get_tokenizer(folders["qwen2.5"][0])


def test_observation_is_the_templates_difference(qwen):
    """The tool result's ids are what the real template writes after the reply: the conversation rendered whole
    with a generation header equals the prompt, the reply's own ids and the observation's."""
    tools = [tool_schema(add)]
    conversation = [U("What is 2+3?")]
    full_reply = [dict(role="assistant", tool_calls=[call("add", {"a": 2, "b": 3})])]
    result = [dict(role="tool", content="5")]
    whole = qwen.render(conversation + full_reply + result, add_generation_prompt=True, tools=tools)[0]
    prompt = qwen.render(conversation, add_generation_prompt=True, tools=tools)[0]
    reply_ids = qwen.render(conversation + full_reply, tools=tools)[0][len(prompt):]
    reply_ids = reply_ids[:reply_ids.index(qwen.eos_id) + 1]  # through <|im_end|>, as sampled
    ids, rendered = observation_ids(qwen, conversation, qwen.decode_reply(reply_ids), result, tools=tools)
    assert prompt + reply_ids + ids == whole
    assert rendered == prompt + reply_ids
    assert "<tool_response>\n5\n</tool_response>" in qwen.decode(ids)
    assert qwen.decode(ids).endswith("<|im_start|>assistant\n")


class Scripted:
    """turn() for rollout: each trajectory's replies in turn, as token lists (log-prob -i for token i); records what
    it was asked."""

    def __init__(self, replies):
        self.replies, self.asked = replies, []

    def __call__(self, rows, new, budgets):
        self.asked.append((rows, [list(c) for c in new], budgets))
        out = [self.replies[r].pop(0)[:b] for r, b in zip(rows, budgets)]
        return [(ids, [-float(i) for i in range(len(ids))]) for ids in out]


class Followups:
    """Answers 'a+b' then asks to add one more, twice; 1 per right answer."""

    def __init__(self, answer):
        self.answer, self.asked = answer, 0

    def step(self, reply):
        right = float(reply.strip().endswith(str(self.answer)))
        self.asked += 1
        if self.asked == 3:
            return None, right, True
        self.answer += 1
        return "And plus 1?", right, False


def odd_ids(tok, text):
    """The text's ids spelled one character at a time: ids a sampler may draw that encode() would merge."""
    return [i for ch in text for i in tok.encode(ch)]


def test_trajectory_keeps_sampled_ids_and_masks_observations(qwen):
    replies = ["2+3 = 5", "5+1 = 6", "6+1 = 8"]
    sampled = [odd_ids(qwen, r) + [qwen.eos_id] for r in replies]
    assert qwen.encode(replies[0]) != sampled[0][:-1]  # a decode/encode round trip would change them
    prompt = qwen.render_prompt([U("What is 2+3?")])
    t = Trajectory(prompt, [U("What is 2+3?")], Followups(5))
    gen = Scripted({0: [list(s) for s in sampled]})
    rollout(gen, qwen, [t], max_turns=5, max_tokens=1000, where=lambda i: f"record {i}")
    assert (t.turns, t.reward, t.truncated, t.done) == (3, 2.0, False, True)
    follow = qwen.render([U("x"), dict(role="assistant", content="y"), U("And plus 1?")],
                         add_generation_prompt=True)[0]
    obs = follow[follow.index(qwen.eos_id, len(qwen.render_prompt([U("x")]))) + 1:]
    assert t.ids == sampled[0] + obs + sampled[1] + obs + sampled[2]
    assert t.mask == [1] * len(sampled[0]) + [0] * len(obs) + [1] * len(sampled[1]) + [0] * len(obs) + \
        [1] * len(sampled[2])
    assert t.observation_tokens == 2 * len(obs)
    # the first turn reads the prompt; each later turn only the observation (the sampled ids are in its KV cache)
    assert [asked[1][0] for asked in gen.asked] == [prompt, obs, obs]
    # the sampler's log-probs of sampled tokens kept, NaN for observation tokens
    assert t.logprobs[:len(sampled[0])] == [-float(i) for i in range(len(sampled[0]))]
    assert [math.isnan(x) for x in t.logprobs] == [m == 0 for m in t.mask]
    # the template re-renders the odd spellings canonically: counted, the sampled ids kept
    assert t.redrawn == 2


def test_limits_end_trajectories_as_truncated(qwen):
    prompt = qwen.render_prompt([U("What is 2+3?")])
    reply = qwen.encode("2+3 = 5") + [qwen.eos_id]
    t = Trajectory(prompt, [U("What is 2+3?")], Followups(5))
    rollout(Scripted({0: [reply] * 3}), qwen, [t], max_turns=2, max_tokens=1000, where=str)
    assert (t.turns, t.truncated, t.mask.count(1)) == (2, True, 2 * len(reply))
    assert t.mask[-1] == 1  # no observation after the last turn
    # a reply with no stop token (cut at its budget) ends it too
    obs, _ = observation_ids(qwen, [U("What is 2+3?")], "2+3 = 5", [U("And plus 1?")])
    cap = Trajectory(prompt, [U("What is 2+3?")], Followups(5))
    gen = Scripted({0: [reply] * 3})
    rollout(gen, qwen, [cap], max_turns=5, max_tokens=2 * len(reply) + len(obs) - 1, where=str)
    assert cap.truncated and cap.turns == 2 and gen.asked[1][2] == [len(reply) - 1]
    assert cap.ids == reply + obs + reply[:-1]


def test_a_raising_environment_names_itself_the_record_and_turn(qwen):
    class Broken:
        def step(self, reply):
            raise KeyError("score")
    t = Trajectory(qwen.render_prompt([U("hi")]), [U("hi")], Broken())
    with pytest.raises(EnvError, match=r"^env Broken.step raised KeyError: 'score' \(data.jsonl line 3, turn 1\)$"):
        rollout(Scripted({0: [[qwen.eos_id]]}), qwen, [t], 3, 100, where=lambda i: "data.jsonl line 3")


def test_builtin_follow_ups_build_on_what_the_model_said():
    from data.arithmetic import FollowUps, env_prompts
    prompts = list(env_prompts("val", 50))
    assert len(prompts) == 50 and all(f["follow_ups"] for _, f in prompts)
    assert all(m[-1]["role"] == "user" for m, _ in prompts)
    env = FollowUps(answer=3, follow_ups=[("*", 2), ("-", 2)])
    assert env.step("8-5 = 3") == ("Now multiply that by 2.", 1.0, False)
    # wrong (6 was right), and the next question is asked of the 7 it said: 7-2 = 5
    assert env.step("3*2 = 7") == ("Now subtract 2 from that.", 0.0, False)
    assert env.step("7-2 = 5") == (None, 1.0, True)


def test_a_qwen_tool_call_is_run_and_answered_through_the_real_template(qwen):
    """--tools through rollout: the prompt offers the tool, the sampled call runs, its result is the template's
    <tool_response> after the reply; a call that does not parse is answered with why and counted; a reply with no call
    ends the trajectory."""
    tools = [tool_schema(add)]
    conversation = [U("What is 2+3?")]
    prompt = qwen.render_prompt(conversation, tools=tools)
    replies = [PARIS, "<tool_call>{oops}</tool_call>", "It is 5."]
    sampled = [qwen.encode(r) + [qwen.eos_id] for r in replies]
    t = Trajectory(prompt, list(conversation), ToolEnv([add]), dict(tools=tools))
    gen = Scripted({0: [list(s) for s in sampled]})
    rollout(gen, qwen, [t], max_turns=5, max_tokens=2000, where=str)
    t.finish()
    assert (t.turns, t.tool_calls, t.bad_calls, t.truncated) == (3, 1, 1, False)
    first_obs, second_obs = gen.asked[1][1][0], gen.asked[2][1][0]
    assert "<tool_response>\n5\n</tool_response>" in qwen.decode(first_obs)
    assert "error: the tool call is not JSON" in qwen.decode(second_obs)
    # the sampled replies as sampled, each observation the template's render after them
    assert t.ids == sampled[0] + first_obs + sampled[1] + second_obs + sampled[2]
    history = conversation + [t.messages[1], t.messages[2]]
    assert second_obs == observation_ids(qwen, history, replies[1], [t.messages[4]], tools=tools)[0]
    assert t.messages[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
