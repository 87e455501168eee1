"""What users bring (issue 51, round five): a record's fields renamed to ours (`fields`, every script and
data/prepare.py, GSM8K by name on the hub), the fields a script trains on taken where a record holds two kinds
(ultrafeedback_binarized's SFT splits), and RL records a reward cannot score refused before training: answers
math-verify cannot read, a field named as a reward's own argument, a reward that raises SystemExit or
KeyboardInterrupt."""
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, as_args
from data.dataset import check_kind, ignored_keys_note, prompt_record, read_prompts
from data.prepare import parse, prepare
from data.records import DataError, parse_fields, read_records
from hub_fixture import lay_out_cache, model_repo, prefs, write_parquet
from nanopack.parallel import stop_signal
from nanopack.rewards import RewardError, Rewards
from nanopack.tokenizer import Tokenizer

TOK = Tokenizer.byte_level()
GSM8K = [dict(question=f"What is {i}+{i}?", answer=f"{i} and {i} make {2 * i}.\n#### {2 * i}") for i in range(6)]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def prompts(path, reward="math", **kw):
    """train_rl.py's reading of prompt records: fields checked as its `scorable` checks them."""
    fns = Rewards(reward)

    def scorable(fields, where):
        fns.check_fields(fields, where)
        return fns.check_values(fields, where)
    return read_prompts(path, None, TOK, lambda ids, where: None, None, "data_split", kw.get("fields"), scorable,
                        kw.get("bad_records", "error"))


# ---- fields: a record's names -> ours ----------------------------------------------------------------------------
def test_fields_rename_every_record_and_refuse_what_they_cannot_mean(tmp_path):
    assert parse_fields("question:prompt, answer:solution") == {"question": "prompt", "answer": "solution"}
    assert parse_fields({"question": "prompt"}) == {"question": "prompt"} and parse_fields(None) == {}
    for spec in ("question", "question:", "a:prompt,b:prompt", "a:x,a:y"):
        with pytest.raises(DataError, match=r"write it as their_field:our_field pairs"):
            parse_fields(spec)
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K[:1] + [dict(question="q", prompt="p", answer="1")])
    renamed = read_records([path], verbose=False, fields=parse_fields("question:prompt"))
    assert next(renamed)[1] == dict(prompt=GSM8K[0]["question"], answer=GSM8K[0]["answer"])
    with pytest.raises(DataError, match=rf"{path}:2: the record's 'question' and 'prompt' would both be 'prompt' "
                                        r"\(fields=question:prompt\) — rename only one of them"):
        next(renamed)


def test_gsm8k_as_downloaded_trains_rl_with_a_rename(tmp_path):
    """The reported case: {"question", "answer"} is refused without a rename, read with --fields=question:prompt."""
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
    with pytest.raises(SystemExit, match=r"rename 'question' to 'prompt'"):
        check_kind(path, None, None, None, "rl")
    check_kind(path, None, path, None, "rl", "question:prompt")
    found = prompts(path, fields="question:prompt")
    assert [p[1] for p in found[:1]] == [[dict(role="user", content="What is 0+0?")]] and len(found) == 6
    assert found[0][2] == dict(answer=GSM8K[0]["answer"])


def test_prepared_folders_record_their_fields(tmp_path):
    """A rename changes the tokens: meta.json holds it, and a run on the folder with other fields says so."""
    chats = [dict(conversation=[dict(role="user", content=f"q{i}"), dict(role="assistant", content=f"a{i}")])
             for i in range(4)]
    path = write_jsonl(tmp_path / "c.jsonl", chats)
    meta = prepare(path, str(tmp_path / "out"), TOK, fields="conversation:messages", val_fraction=0, verbose=False)
    same = prepare(write_jsonl(tmp_path / "m.jsonl", [dict(messages=c["conversation"]) for c in chats]),
                   str(tmp_path / "m"), TOK, val_fraction=0, verbose=False)
    assert meta["fields"] == {"conversation": "messages"} and same["fields"] is None
    assert meta["counts"] == same["counts"]
    run = dict(data=str(tmp_path / "out"), max_len=4096, fields=None)
    assert "fields=None (prepared with {'conversation': 'messages'})" in ignored_keys_note(run, run["data"], 4096)
    assert ignored_keys_note(dict(run, fields="conversation:messages"), run["data"], 4096) == ""
    out = subprocess.run([sys.executable, "data/prepare.py", "--input", path, "--out_dir", str(tmp_path / "cli"),
                          "--fields", "conversation:messages", "--val_fraction", "0"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0 and "--fields" in subprocess.run(
        [sys.executable, "train_sft.py", "--help"], cwd=ROOT, capture_output=True, text=True).stdout


# ---- a record with two kinds: the script's own fields --------------------------------------------------------------
def test_ultrafeedback_sft_split_trains_sft_and_dpo_alike(tmp_path):
    """ultrafeedback_binarized's train_sft split (messages beside chosen/rejected): SFT reads messages, DPO the pair;
    data/prepare.py needs --kind only where messages is not the chosen conversation."""
    folder = tmp_path / "uf" / "data"
    write_parquet(str(folder / "train_sft-00000-of-00001.parquet"), prefs(6))
    check_kind(str(folder), "train_sft", None, None, "sft")
    check_kind(str(folder), "train_sft", None, None, "dpo")
    sft = prepare(str(folder), str(tmp_path / "sft"), TOK, data_split="train_sft", kind="sft", val_fraction=0,
                  verbose=False)
    assert sft["kind"] == "sft" and sft["counts"]["train"]["examples"] == 6
    record = dict(prefs(1)[0], messages=[dict(role="user", content="other"), dict(role="assistant", content="x")])
    assert parse(record, "f:1", "sft")[0] == "sft" and parse(record, "f:1", "dpo")[0] == "dpo"
    with pytest.raises(DataError, match=r"f:1: .*not the chosen conversation — keep one kind per line, or choose "
                                        r"which to read with --kind=sft"):
        parse(record, "f:1")


# ---- RL records a reward cannot score ----------------------------------------------------------------------------
def test_math_answers_math_verify_cannot_read_are_bad_records(tmp_path, capsys):
    """The reported case: '\\$5' and '' (step 1 trained, step 2 died) are named before any training; skip counts."""
    path = write_jsonl(tmp_path / "p.jsonl", [dict(prompt="a", answer="#### 72"), dict(prompt="b", answer="\\$5"),
                                              dict(prompt="c", answer="")])
    with pytest.raises(SystemExit, match=rf"data error: {path}: 2 bad records: .* \(1\) {path}:2: reward math cannot "
                                         r"score this record: answer '\\\\\$5' is no math .* \(2\) .*:3:"):
        prompts(path)
    assert [p[3] for p in prompts(path, bad_records="skip")] == [f"{path}:1"]
    assert f"{path}: 2 bad records skipped (bad_records='skip')" in capsys.readouterr().out


def test_a_field_named_as_the_rewards_own_argument_is_refused(tmp_path):
    """A **fields reward would die after sampling with 'got multiple values for argument'; named parameters don't."""
    takes_all = Rewards("tests.rl_rewards:distinct_characters")
    with pytest.raises(RewardError, match=r"p:1: the record's field 'reply' has the name of reward "
                                          r"tests.rl_rewards:distinct_characters's own argument .* "
                                          r"\(--fields=reply:reply_field\)"):
        takes_all.check_fields(dict(reply="x", answer=1), "p:1")
    _, (_, fields) = prompt_record(dict(messages=[dict(role="user", content="q")], prompt="q"), "p:2")
    with pytest.raises(RewardError, match=r"field 'prompt' has the name"):
        takes_all.check_fields(fields, "p:2")
    Rewards("tests.rl_rewards:contains_target").check_fields(dict(reply="x", target="t"), "p:3")
    path = write_jsonl(tmp_path / "p.jsonl", [dict(prompt="q", reply="x")])
    with pytest.raises(SystemExit, match=r"data error: .*p.jsonl:1: the record's field 'reply'"):
        prompts(path, "tests.rl_rewards:distinct_characters")
    assert prompts(path, "tests.rl_rewards:distinct_characters", fields="reply:reference")[0][2] == dict(reference="x")


@pytest.mark.parametrize("name", ["exits", "interrupts"])
def test_a_reward_that_raises_systemexit_or_keyboardinterrupt_is_one_line(name, monkeypatch):
    fns = Rewards(f"tests.rl_rewards:{name}")
    previous = signal.signal(signal.SIGINT, lambda *a: None)  # a run's own handler: no KeyboardInterrupt of Ctrl-C
    try:
        with pytest.raises(RewardError, match=rf"reward tests.rl_rewards:{name} raised "
                                              r"(SystemExit: 3|KeyboardInterrupt: ) \(prompt p:1, reply 'r'\)"):
            fns([], "r", {}, "p:1")
        monkeypatch.setattr(stop_signal, "name", "SIGINT")  # a real Ctrl-C: the stop goes on as a stop
        with pytest.raises((SystemExit, KeyboardInterrupt)):
            fns([], "r", {}, "p:1")
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.slow
def test_gsm8k_by_name_with_a_rename_trains_rl_offline(tmp_path):
    """The docs' example by name (a gsm8k-shaped repo: configs main and socratic) from an offline cache: refused
    without --fields, trained with --fields=question:prompt and the math reward."""
    root = tmp_path / "repo"
    for config in ("main", "socratic"):
        for split in ("train", "test"):
            write_parquet(str(root / config / f"{split}-00000-of-00001.parquet"), GSM8K)
    cache = str(tmp_path / "home" / "hub")
    lay_out_cache(cache, "dataset", "nanopack-test/gsm8k", str(root), "f" * 40)
    lay_out_cache(cache, "model", "nanopack-test/tiny-chat", model_repo(str(tmp_path / "model")), "a" * 40)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1",
               HF_ENDPOINT="http://127.0.0.1:9", HF_TOKEN="", HF_HUB_DISABLE_PROGRESS_BARS="1")
    cfg = dict(init_from="nanopack-test/tiny-chat", data="nanopack-test/gsm8k/main", data_split="train",
               reward="math", k=2, prompts_per_step=2, max_new_tokens=4, max_iters=1, eval_interval=0,
               eval_examples=0, out_dir=str(tmp_path / "rl"))
    refused = subprocess.run([sys.executable, "train_rl.py", *as_args(**cfg)], cwd=ROOT, capture_output=True,
                             text=True, env=env)
    assert refused.returncode != 0 and "rename 'question' to 'prompt'" in refused.stderr
    assert "Traceback" not in refused.stderr
    out = subprocess.run([sys.executable, "train_rl.py", *as_args(**cfg, fields="question:prompt")], cwd=ROOT,
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0 and "6 train prompts" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
