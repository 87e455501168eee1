r"""rewards.py without a model: reward names ('builtin', 'math', 'module:function', several with weights), only the
record fields a reward's signature takes, what a reward may return (numbers, numpy scalars, 0-d tensors) and what
stops the run (text, None, lists, NaN), the math reward on GSM8K / MATH-style answers; and RL's prompt records
(data/dataset.py): GSM8K's "question" gets a rename hint, SFT and DPO files are refused before the model loads."""
import json
import re
import sys
import threading

import numpy as np
import pytest
import torch

from nanopack import rewards
from data.dataset import check_kind, prompt_record
from data.prepare import DataError
from nanopack.rewards import RewardError, Rewards, math_reward, parse_weights

PROMPT = [{"role": "user", "content": "What is 6 x 12?"}]


def test_a_reward_name_without_a_colon_is_one_clear_line():
    with pytest.raises(RewardError, match=r"reward='myrew': name a function as 'module:function' \(e.g. my_rewards:"):
        Rewards("myrew")
    with pytest.raises(RewardError, match="module 'tests.rl_rewards' has no attribute 'nope'"):
        Rewards("tests.rl_rewards:nope")
    with pytest.raises(RewardError, match="names a function twice"):
        Rewards("math, math")
    assert Rewards("builtin").fns[0].__module__ == "data.arithmetic"
    assert Rewards(" math").fns == [math_reward]


def test_a_module_that_fails_to_import_or_a_function_that_takes_no_reply_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text("def f(prompt, reply):\n    return 1 +\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match=r"importing broken_rewards raised SyntaxError: invalid syntax"):
        Rewards("broken_rewards:f")
    with pytest.raises(RewardError, match=r"reward='one_argument' takes \(reply\), not \(prompt, reply\)"):
        rewards.fields_taken(lambda reply: 1.0, "one_argument")


def test_the_math_reward_without_math_verify_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if not installed: find_spec sees no module
    with pytest.raises(RewardError, match=r"reward='math' checks answers with math-verify: pip install math-verify"):
        Rewards("math")


@pytest.mark.parametrize("value, expected", [
    (1, 1.0), (0.5, 0.5), (True, 1.0), (np.float32(0.25), 0.25), (np.int64(3), 3.0), (np.bool_(False), 0.0),
    (np.array(2.0), 2.0), (torch.tensor(0.75), 0.75), (torch.tensor(True), 1.0), (-2, -2.0)])
def test_numbers_of_every_common_kind_are_rewards(value, expected):
    assert Rewards("tests.rl_rewards:echo")(PROMPT, "72", {"value": value}, "p.jsonl:3") == [expected]


@pytest.mark.parametrize("value, shown", [
    ("1", "'1' (a str)"), (None, "None (a NoneType)"), ([1.0], "[1.0] (a list)"), (np.array([1.0]), "(a ndarray)"),
    (torch.tensor([1.0]), "(a Tensor)"), (np.array("1"), "(a ndarray)"), (1j, "1j (a complex)"),
    (float("nan"), "returned nan for"), (float("inf"), "returned inf for")])
def test_anything_but_a_finite_number_stops_the_run_naming_reward_prompt_and_value(value, shown):
    with pytest.raises(RewardError) as e:
        Rewards("tests.rl_rewards:echo")(PROMPT, "72", {"value": value}, "p.jsonl:3")
    message = str(e.value)
    assert message.startswith("reward tests.rl_rewards:echo returned ") and shown in message, message
    assert "for prompt p.jsonl:3 (reply '72'); a reward must be a finite number" in message and "\n" not in message


def test_a_reward_gets_only_the_fields_its_signature_takes():
    fields = {"answer": 72, "id": 7, "source": "gsm8k"}
    takes_answer = Rewards("tests.rl_rewards:answer_in_reply")
    assert takes_answer(PROMPT, "it is 72", fields, "p.jsonl:1") == [1.0]  # `id` and `source` not passed
    assert takes_answer(PROMPT, "it is 72", dict(fields, bonus=0.5), "p.jsonl:1") == [1.5]  # a field it does take
    everything = Rewards("tests.rl_rewards:distinct_characters")  # **fields: all of them, as before
    assert everything(PROMPT, "aab", fields, "p.jsonl:1") == [2.0]
    takes_answer.check_fields(fields, "p.jsonl:1")  # `bonus` has a default: not required
    with pytest.raises(RewardError, match=r"p.jsonl:2: reward tests.rl_rewards:answer_in_reply takes 'answer', which "
                                          r"the record lacks \(its fields: 'id', 'source'\); add it to every record"):
        takes_answer.check_fields({"id": 8, "source": "gsm8k"}, "p.jsonl:2")


def test_several_rewards_weighted():
    both = Rewards("tests.rl_rewards:answer_in_reply, tests.rl_rewards:distinct_characters", (1, 0.5))
    each = both(PROMPT, "72", {"answer": 72}, "p.jsonl:1")
    assert list(each) == [1.0, 2.0] and each @ both.weights == 2.0  # each function's own; the total weighted
    assert str(both) == "1 x tests.rl_rewards:answer_in_reply + 0.5 x tests.rl_rewards:distinct_characters"
    assert list(parse_weights(None, ["a", "b"])) == [1.0, 1.0] and list(parse_weights(2, ["a"])) == [2.0]
    with pytest.raises(RewardError, match=r"reward_weights=\(1, 0.5, 2\) has 3 weight\(s\) for 2 rewards \(a, b\)"):
        parse_weights((1, 0.5, 2), ["a", "b"])
    for bad in ("a,b", (1, float("nan")), (True, 1)):  # --reward_weights=a,b reaches us as the text 'a,b'
        with pytest.raises(RewardError, match="give one finite number per reward"):
            parse_weights(bad, ["a", "b"])


# (answer as a GSM8K / MATH record gives it, a right reply, a wrong reply)
MATH = [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "She sold 48 + 24 = 72 clips.", "She sold 24."),
    ("#### 1,000", "The total is 1000 dollars.", "The total is 100 dollars."),
    (72, r"Adding up: $48 + 24$, so \boxed{72}. Check: 3 + 5 = 8.", "48 + 24 = 73"),  # \boxed{} over the last number
    (r"\frac{1}{2}", "Half of it: 0.5", "1/3"),
    (r"\boxed{\frac{3}{4}}", r"$\frac{3}{4}$", r"\boxed{\frac{4}{3}}"),
    ("The answer is $\\boxed{\\sqrt{2}}$ since ...", r"\boxed{\sqrt 2}", r"\boxed{2}"),
]


@pytest.mark.parametrize("answer, right, wrong", MATH)
def test_the_math_reward_on_gsm8k_and_math_answers(answer, right, wrong):
    assert math_reward(PROMPT, right, answer) == 1.0
    assert math_reward(PROMPT, wrong, answer) == 0.0


def test_the_math_reward_outside_the_main_thread():
    """math-verify's timeout is signal.alarm, which a thread other than the main one may not set."""
    found = []
    worker = threading.Thread(target=lambda: found.append(math_reward(PROMPT, r"\boxed{72}", "#### 72")))
    worker.start()
    worker.join()
    assert found == [1.0]


def test_an_answer_math_verify_cannot_read_stops_the_run_naming_the_prompt():
    with pytest.raises(RewardError, match=r"reward math raised ValueError: answer '' is no math .* \(prompt p.jsonl:4"):
        Rewards("math")(PROMPT, "72", {"answer": ""}, "p.jsonl:4")


# ---- RL's prompt records (data/dataset.py) ------------------------------------------------------------------------
def test_prompt_records_and_the_gsm8k_rename_hint():
    kind, (messages, fields) = prompt_record({"prompt": "Say hi", "id": 3, "target": "hi"}, "p.jsonl:1")
    assert kind == "rl" and messages == [{"role": "user", "content": "Say hi"}] and fields == {"id": 3, "target": "hi"}
    assert prompt_record({"chosen": "a", "rejected": "b", "prompt": "q"}, "p.jsonl:1") == ("dpo", None)
    sft = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert prompt_record(sft, "p.jsonl:1") == ("sft", None)
    with pytest.raises(DataError, match=r"gsm8k.jsonl:1: no 'prompt' or 'messages' \(the line's keys: 'answer', "
                                        r"'question'\) — put the user's turn in 'prompt' \(rename 'question' to"):
        prompt_record({"question": "How many?", "answer": "#### 72"}, "gsm8k.jsonl:1")


@pytest.mark.parametrize("record, found", [
    ({"prompt": "Say hi", "chosen": "hi", "rejected": "no"}, "is DPO data but train_rl.py trains RL (prompt records)"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "is SFT data but"),
])
@pytest.mark.parametrize("as_val", [False, True])
def test_an_sft_or_dpo_file_is_refused_before_the_model_loads(tmp_path, record, found, as_val):
    path, prompts = tmp_path / "other.jsonl", tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(record) + "\n")
    prompts.write_text(json.dumps({"prompt": "Say hi"}) + "\n")
    data, val = (str(prompts), str(path)) if as_val else (str(path), None)
    with pytest.raises(SystemExit, match=re.escape(f"data error: {path}:1 {found}")):
        check_kind(data, None, val, None, "rl")
    check_kind(str(prompts), None, str(prompts), None, "rl")  # prompt records: no complaint
