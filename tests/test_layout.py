"""The shape of the code: each core file (top-level *.py, data/*.py, nanopack/*.py) one concern, at
most 500 lines, no line over 120 characters, and imports only from a lower floor (so no import cycle;
a file never reaches up to the scripts)."""
import ast
import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOORS = [  # lowest first: a module may import only from floors below its own
    ("nanopack.kernels", "nanopack.attention", "nanopack.decode_graphs", "nanopack.plan_search", "packing", "nanopack.chat_template", "nanopack.parallel", "losses",
     "nanopack.bpe"),
    ("nanopack.tokenizer", "nanopack.context", "data.records"),
    ("model", "data.messages"),
    ("nanopack.hf", "nanopack.hub", "nanopack.generate"),
    ("data.prepare",),  # takes hub names, as the scripts do
    ("data.arithmetic", "nanopack.lora", "nanopack.metrics"),
    # rewards: loads data.arithmetic's reward by name
    ("nanopack.checkpoint", "data.dataset", "nanopack.rewards"),
    ("nanopack.keys", "nanopack.configurator", "nanopack.env"),
    ("nanopack.run", "nanopack.startup", "nanopack.rollout"),  # rollout: runs env.py's trajectories
    ("nanopack.reference", "nanopack.fakes", "nanopack.fake_reuse"),
    ("nanopack.fake_step", "nanopack.teacher"),
    ("train_sft", "train_dpo", "train_rl", "sample", "plot", "launch", "plan"),
]
# what a researcher edits and runs; the machinery lives in nanopack/
TOP_LEVEL = {"train_sft", "train_dpo", "train_rl", "model", "packing", "losses", "sample", "plot", "plan", "launch"}
FLOOR = {name: i for i, names in enumerate(FLOORS) for name in names}


def core_files():
    files = sorted(glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "data", "*.py"))
                   + glob.glob(os.path.join(ROOT, "nanopack", "*.py")))
    return {os.path.relpath(f, ROOT)[:-3].replace(os.sep, "."): f for f in files if not f.endswith("__init__.py")}


def project_imports(path, modules):
    """The project modules a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in modules}
    return found


def test_the_top_level_holds_only_what_researchers_edit():
    top = {os.path.basename(f)[:-3] for f in glob.glob(os.path.join(ROOT, "*.py"))}
    assert top == TOP_LEVEL, f"top level: {sorted(top - TOP_LEVEL)} belong in nanopack/"


def test_every_core_module_has_a_floor():
    missing = sorted(set(core_files()) - set(FLOOR))
    assert not missing, f"add {missing} to FLOORS in tests/test_layout.py"


@pytest.mark.parametrize("module", sorted(core_files()))
def test_imports_go_only_down(module):
    path = core_files()[module]
    up = sorted(m for m in project_imports(path, set(core_files())) if FLOOR[m] >= FLOOR[module])
    assert not up, f"{module} (floor {FLOOR[module]}) imports {up} from its own floor or above"


@pytest.mark.parametrize("module", sorted(core_files()))
def test_file_size_and_line_length(module):
    lines = open(core_files()[module]).read().split("\n")
    assert len(lines) <= 501, f"{module}: {len(lines)} lines, over 500: split it by concern"
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 120]
    assert not long, f"{module}: lines {long[:5]} are over 120 characters"


def test_the_checker_sees_an_upward_import(tmp_path):
    bad = tmp_path / "model.py"
    bad.write_text("import torch\nfrom nanopack.run import start_run\n\ndef f():\n    import train_sft\n")
    assert project_imports(str(bad), set(core_files())) == {"nanopack.run", "train_sft"}


def test_no_merge_conflict_markers_left():
    """A merge once committed README.md's file table with both sides and its <<<<<<< / >>>>>>> lines."""
    import subprocess
    files = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.txt", "*.sh", "*.toml"], cwd=ROOT,
                           capture_output=True, text=True).stdout.split() or glob.glob(os.path.join(ROOT, "*.md"))
    for name in files:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                assert not line.startswith(("<<<<<<< ", ">>>>>>> ")), f"{name}:{i}: {line.strip()}"
