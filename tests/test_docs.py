"""The docs are checked like code: every command in README.md and docs/*.md names a script that exists and only keys
it declares (parsed, not run), every relative link resolves, and every script's --help exits 0. A renamed key breaks
this test, not the reader."""
import ast
import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
CONFIGURED = ("train_sft.py", "train_dpo.py", "train_rl.py", "sample.py")  # keys: configurator globals
# the keys every training script takes besides its own (configure(globals(), machinery=keys))
MACHINERY = "nanopack/keys.py"
HELP = CONFIGURED + ("plan.py", "plot.py", "data/prepare.py")
LAUNCHERS = {"torchrun": "--", "launch.py": "--"}  # options before the script are the launcher's


def read(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def commands(text):
    """Shell commands in the page's ``` blocks (``` python blocks excluded): continuation lines joined, comments and
    prompts dropped, split at && ; |."""
    for lang, block in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        if lang not in ("", "bash", "sh", "shell", "console"):
            continue
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip().removeprefix("$ ")
            for part in re.split(r"&&|;|\|", line):
                try:
                    words = shlex.split(part)
                except ValueError:  # an unbalanced quote is a broken command
                    raise AssertionError(f"cannot parse {part!r}")
                if words:
                    yield words


def declared(script):
    """The --keys a script takes: its configurator globals (and the machinery's, for a script that
    passes them), or its argparse options (and plan.py's own)."""
    text = read(script)
    if script in CONFIGURED + (MACHINERY,):
        keys = set()
        for node in ast.parse(text).body:
            for stmt in node.body if isinstance(node, ast.If) else [node]:  # sample.py keeps its keys under __main__
                if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
                    keys.add(stmt.targets[0].id)
        takes_machinery = script != MACHINERY and "machinery=keys" in text
        return keys | (declared(MACHINERY) if takes_machinery else set())
    plan_keys = re.search(r"^PLAN_KEYS = dict\((.*)\)$", text, re.M)  # plan.py's own options
    return (set(re.findall(r"""add_argument\(\s*["']--([\w-]+)""", text)) | set(re.findall(r'"--(\w+)[="]', text))
            | set(re.findall(r"(\w+)=", plan_keys.group(1)) if plan_keys else []))


def check(words, where):
    """-> problems with one command: the script it runs and the keys it passes."""
    while words and re.fullmatch(r"\w+=\S*", words[0]):  # VAR=value before the command
        words = words[1:]
    if not words or words[0] not in ("python", "python3", "torchrun", "bash"):
        return []
    words = words[1:] if words[0] != "torchrun" else ["torchrun"] + words[1:]
    scripts = [i for i, w in enumerate(words) if w.endswith((".py", ".sh")) and not w.startswith("-")]
    if not scripts:
        return [] if words[0] in ("-m", "-c") or "-m" in words else [f"{where}: {' '.join(words)}: no script"]
    problems = []
    for i in scripts:  # the script, and config files after it
        if not os.path.isfile(os.path.join(ROOT, words[i])):
            problems.append(f"{where}: {words[i]} does not exist")
    script = words[scripts[0]]
    if os.path.basename(script) in ("launch.py",) and len(scripts) > 1:
        script = words[scripts[1]]
    args = words[words.index(script) + 1:]
    if script == "plan.py" and args and args[0].endswith(".py"):
        own = declared("plan.py")
        script, args = args[0], [a for a in args[1:] if a[2:].partition("=")[0] not in own]
    if not os.path.isfile(os.path.join(ROOT, script)) or script.endswith(".sh"):
        return problems
    keys = declared(script)
    for a in args:
        key = a[2:].partition("=")[0]
        if a.startswith("--") and key not in keys | {"help"}:
            problems.append(f"{where}: {script} declares no key --{key} ({' '.join(words)})")
    return problems


@pytest.mark.parametrize("page", PAGES)
def test_commands_name_scripts_and_keys_that_exist(page):
    problems = [p for words in commands(read(page)) for p in check(words, page)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    text = re.sub(r"^```.*?^```", "", read(page), flags=re.S | re.M)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    broken = [link for link in links if not re.match(r"\w+:|#", link)
              and not os.path.exists(os.path.join(ROOT, os.path.dirname(page), link.split("#")[0]))]
    assert not broken, f"{page}: links to nothing: {broken}"


def test_every_script_help_exits_0():
    """--help of each script a page tells people to run prints and exits 0 (run at once: each imports torch)."""
    procs = {s: subprocess.Popen([sys.executable, s, "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for s in HELP}
    for script, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0 and len(out.splitlines()) > 3, f"{script} --help: rc {proc.returncode}\n{out}"


def test_the_check_catches_what_it_should():
    """The checker itself: a misspelt key, a missing script and a missing config file are each caught."""
    page = "```bash\npython train_sft.py --max_iter=3 && python train_sftt.py\ntorchrun --nproc_per_node=8 " \
           "train_dpo.py config/nope.py --beta=0.1\npython plan.py train_sft.py --gpus=8 --lr=1\n```\n"
    problems = [p for words in commands(page) for p in check(words, "x")]
    assert len(problems) == 4, problems
    assert all(any(s in p for p in problems) for s in ("--max_iter", "train_sftt.py", "config/nope.py", "--lr"))
