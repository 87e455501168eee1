"""Every third-party module the code imports is installed by a requirements file or named on a README/docs
`pip install` line: a package present only because someone installed it by hand would otherwise pass here and fail
on a fresh machine (math-verify did, for a whole release)."""
import ast
import glob
import importlib.metadata
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# torch's CUDA wheels install triton; kernels.py imports it only where the fused kernel runs (CUDA, or the interpreter)
WITH_TORCH_CUDA = {"triton"}


def normalize(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(path):
    """The distributions a requirements file installs, following `-r other.txt`."""
    names = set()
    for line in open(path):
        line = line.split("#")[0].strip()
        if line.startswith("-r"):
            names |= requirement_names(os.path.join(os.path.dirname(path), line[2:].strip()))
        elif line:
            names.add(normalize(re.match(r"[A-Za-z0-9_.\-]+", line).group()))
    return names


def pip_install_lines():
    """Distributions the README and docs/ ask for with a `pip install NAME` of their own (torchao, flash-attn)."""
    names = set()
    for path in [os.path.join(ROOT, "README.md")] + glob.glob(os.path.join(ROOT, "docs", "*.md")):
        for match in re.finditer(r"pip install ((?:[A-Za-z][\w.\-]*\s?)+)", open(path).read()):
            names |= {normalize(n) for n in match.group(1).split() if not n.startswith("-")}
    return names


def imported_modules(path):
    """Top-level module names a file imports: import statements anywhere (a function's too), and the names given
    to pytest.importorskip, importlib.import_module and find_spec."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("importorskip", "import_module", "find_spec") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value.split(".")[0])
    return found


def project_files():
    patterns = ["*.py", "*/*.py", "*/*/*.py"]
    files = [f for p in patterns for f in glob.glob(os.path.join(ROOT, p))]
    return [f for f in files if not os.path.relpath(f, ROOT).startswith(("out", "."))]


def own_modules(files):
    """Names that resolve inside the repo (a script, data/, a test helper imported from its own folder)."""
    names = {os.path.basename(f)[:-3] for f in files}
    return names | {os.path.basename(os.path.dirname(f)) for f in files}


def distributions_of(module, installed):
    """The distributions that provide a module: the installed ones, else one of the module's own name."""
    return {normalize(d) for d in installed.get(module, [])} or {normalize(module)}


def test_every_third_party_import_is_in_a_requirements_file():
    files = project_files()
    ours = own_modules(files)
    named = requirement_names(os.path.join(ROOT, "requirements-dev.txt")) | pip_install_lines()
    installed = importlib.metadata.packages_distributions()
    missing = {}
    for path in files:
        for module in imported_modules(path) - ours - set(sys.stdlib_module_names) - {"__future__"}:
            if not distributions_of(module, installed) & named:
                missing.setdefault(module, os.path.relpath(path, ROOT))
    assert not missing, "imported but in no requirements file nor README/docs pip line: " + ", ".join(
        f"{m} ({f}, distribution {sorted(distributions_of(m, installed))})" for m, f in sorted(missing.items()))


def test_the_runtime_requirements_cover_the_core():
    """requirements.txt alone runs the README's and docs' commands: every core file's (top level, data/) imports."""
    core = glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "data", "*.py"))
    ours = own_modules(project_files())
    named = requirement_names(os.path.join(ROOT, "requirements.txt")) | pip_install_lines() | WITH_TORCH_CUDA
    installed = importlib.metadata.packages_distributions()
    missing = sorted(f"{m} ({os.path.relpath(path, ROOT)})" for path in core
                     for m in imported_modules(path) - ours - set(sys.stdlib_module_names) - {"__future__"}
                     if not distributions_of(m, installed) & named)
    assert not missing, f"core imports that requirements.txt does not install: {missing}"


def test_the_check_sees_a_removed_requirement(tmp_path):
    """The check can fail: a requirements file without math-verify leaves rewards.py's import unnamed."""
    reqs = tmp_path / "requirements.txt"
    kept = [line for line in open(os.path.join(ROOT, "requirements.txt")) if not line.startswith("math-verify")]
    reqs.write_text("".join(kept))
    installed = importlib.metadata.packages_distributions()
    assert "math_verify" in imported_modules(os.path.join(ROOT, "nanopack", "rewards.py"))
    assert not distributions_of("math_verify", installed) & requirement_names(str(reqs))
    assert distributions_of("math_verify", installed) & requirement_names(os.path.join(ROOT, "requirements.txt"))
