"""Every `python ...` command in README.md parses with the real argument parsers and passes the checks
train.py makes before any work (no model is loaded), so a README line cannot silently be wrong."""
import re
import shlex
import shutil

import pytest

import evaluate
import train
from tests.conftest import ROOT

VARIABLES = {"$algo": "empo2", "$seed": "0", "$run": "runs/webshop-mini-empo2-s0"}


def readme_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|;|\bdo\b", line):
                part = part.split("#")[0].strip()
                if part.startswith("python ") and part.split()[1].endswith(".py"):
                    for var, value in VARIABLES.items():
                        part = part.replace(var, value)
                    commands.append(shlex.split(part)[1:])
    return commands


COMMANDS = readme_commands()


def test_the_readme_has_commands():
    scripts = {c[0] for c in COMMANDS}
    assert {"train.py", "evaluate.py", "bench.py"} <= scripts and len(COMMANDS) > 10


@pytest.mark.parametrize("argv", [c for c in COMMANDS if c[0] in ("train.py", "evaluate.py")], ids=" ".join)
def test_readme_command_parses(argv):
    if "scienceworld" in argv and shutil.which("java") is None:
        pytest.skip("ScienceWorld needs a Java runtime to list its tasks")
    script, args = argv[0], argv[1:]
    if "--help" in args:
        with pytest.raises(SystemExit) as exc:
            (train.parse_args if script == "train.py" else evaluate.parse_args)(args)
        assert exc.value.code == 0
        return
    if script == "train.py":
        parsed = train.parse_args(args)   # exits with a message on a bad flag or setting
    else:
        parsed = evaluate.parse_args(args)[1]
    for flag, value in flag_values(args):   # each flag the README shows reaches the setting it names
        got = getattr(parsed, flag)
        assert got == value or (isinstance(got, list) and value in got) or str(got) == value \
            or (isinstance(got, (int, float)) and not isinstance(got, bool) and got == float(value)), (flag, got, value)


def flag_values(args: list[str]) -> list[tuple[str, object]]:
    """(field, value) for each --flag VALUE and each bare --flag (True) on a command line."""
    out = []
    for k, a in enumerate(args):
        if a.startswith("--") and a != "--help":
            name, _, inline = a[2:].partition("=")
            following = args[k + 1] if k + 1 < len(args) else "--"
            value = inline or (True if following.startswith("--") else following)
            out.append((name.replace("-", "_"), value))
    return out


def test_flag_values_reads_values_and_bare_flags():
    assert flag_values(["--env", "rooms", "--resume", "--min-logp=-5", "--compare", "a", "b"]) == [
        ("env", "rooms"), ("resume", True), ("min_logp", "-5"), ("compare", "a")]
