"""Reading a run script as bash would (cli/importers/shell/script.py): the launch command's words, expanded without
running
anything, compared with what bash itself passes to the launch command.

The reference is bash: each script is copied with a prelude that replaces the launch program (`python3`, and `ray`
which runs what follows its `--`) by a function that writes its arguments NUL-separated to a file and exits; bash
then runs that copy. Only the test runs bash; the reader never does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dgrpo.cli.importers.shell.script import ScriptError, Unresolved, read_script

SCRIPTS = Path(__file__).parent / "fixtures" / "verl_scripts"
ENV = {"HOME": "/home/u", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PWD": "/work/run", "LANG": "C"}
PRELUDE = (
    'python3() { printf "%s\\0" "$@" > "$DGRPO_ARGS"; exit 0; }\n'
    "python() { python3 \"$@\"; }\n"
    'ray() { while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do shift; done; shift; "$@"; }\n'
    "ulimit() { :; }\n"
)
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the reference is bash")


def bash_args(text: str, tmp_path: Path, env: dict[str, str]) -> list[str]:
    """The arguments bash passes to the launch program, after `-m module`."""
    copy, out = tmp_path / "copy.sh", tmp_path / "args"
    copy.write_text(PRELUDE + text)
    proc = subprocess.run(["bash", str(copy)], env={**env, "DGRPO_ARGS": str(out)}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=30, check=False)
    assert out.exists(), f"bash never reached the launch command: {proc.stderr[-2000:]}"
    args = out.read_text().split("\0")[:-1]
    assert args[0] == "-m", args[:3]
    return args[2:]


def our_args(text: str, env: dict[str, str]) -> list:
    reading = read_script(text, env, "run.sh")
    assert reading.launch is not None
    return reading.launch.args


@pytest.mark.parametrize("name", sorted(p.name for p in SCRIPTS.glob("*.sh")))
def test_verl_scripts_expand_as_bash_expands_them(child_processes, name, tmp_path):
    text = (SCRIPTS / name).read_text()
    ours = our_args(text, ENV)
    assert all(isinstance(w, str) for w in ours), [w for w in ours if not isinstance(w, str)]
    assert ours == bash_args(text, tmp_path, ENV)


def test_environment_overrides_the_scripts_defaults(child_processes, tmp_path):
    text = (SCRIPTS / "test_dapo_7b_math.sh").read_text()
    env = {**ENV, "MODEL_PATH": "/models/q", "NNODES": "2", "RAY_DATA_HOME": "/data dir"}
    ours = our_args(text, env)
    assert ours == bash_args(text, tmp_path, env)
    assert "actor_rollout_ref.model.path=/models/q" in ours and "trainer.nnodes=2" in ours
    assert "data.train_files=/data dir/data/dapo-math-17k.parquet" in ours  # quoted: one word


# Constructs verl's scripts use (and their neighbours), each checked against bash.
CONSTRUCTS = r"""
set -euo pipefail
base=/srv/models
name=Qwen2.5-7B-Instruct
export BATCH=${BATCH:-16}
declare -a extra=(trainer.save_freq=5 "trainer.project_name=my project")
extra+=(trainer.test_freq=$((BATCH / 4)))
flags="data.shuffle=False  data.seed=7"
: "${UNSET_WITH_DEFAULT:=fallback}"
cat > /dev/null <<EOF
python3 -m verl.trainer.main_ppo not.this=1
EOF
helper() {
    python3 -m verl.trainer.main_ppo not.this.either=1
}
long=abcdefgh
python3 -m verl.trainer.main_ppo \
    actor_rollout_ref.model.path="${base}/${name}" \
    a.lower=${name,,} a.upper="${name^^}" a.len=${#name} \
    a.strip_suffix=${name%-*} a.strip_longest=${name%%-*} a.strip_prefix=${base#*/} a.strip_prefix_long=${base##*/} \
    a.replace=${name/-/_} a.replace_all="${name//-/_}" a.sub=${long:2:3} a.tail=${long: -3} \
    a.alt=${name:+set} a.unset_alt=${NOPE:+set} a.dflt=${NOPE-plain} a.assigned=${UNSET_WITH_DEFAULT} \
    a.arith=$(( (BATCH * 3 + 1) % 7 - -7 / 2 )) a.pow=$((2 ** 10)) a.hex=$((0x1f + 010)) a.cmp=$((BATCH > 8 ? 1 : 0)) \
    a.count=${#extra[@]} a.first=${extra[0]} a.quotes='single $name' a.mixed="x"'y'z a.escaped=\$name \
    a.ansi=$'tab\there' a.tilde=~/x \
    $flags "${extra[@]}" "$@"
"""


def test_shell_constructs_match_bash(child_processes, tmp_path):
    ours = our_args(CONSTRUCTS, ENV)
    assert ours == bash_args(CONSTRUCTS, tmp_path, ENV)
    # (16*3 + 1) % 7 = 0, and -7 / 2 truncates toward zero: 0 - (-3) = 3
    assert "trainer.project_name=my project" in ours and "a.arith=3" in ours and "a.hex=39" in ours


@pytest.mark.parametrize("script,names,why", [
    ("python3 -m verl.trainer.main_ppo data.train_files=$TRAIN\n", ("$TRAIN",), "nor set in the environment"),
    ("X=$(date +%s)\npython3 -m verl.trainer.main_ppo trainer.experiment_name=run_$X\n", ("$(date +%s)",),
     "command substitution"),
    ("if [ -n \"$Y\" ]; then N=4; fi\npython3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.n=$N\n", ("$N",),
     "under a condition"),
    ("[ -z \"$Y\" ] && N=4\npython3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.n=$N\n", ("$N",),
     "under a condition"),
    ("P=$((RANDOM % 100))\npython3 -m verl.trainer.main_ppo data.seed=$P\n", ("$RANDOM",), "run to run"),
    ("python3 -m verl.trainer.main_ppo data.train_batch_size=$((GEN * 2))\n", ("$GEN",), "environment"),
    ("python3 -m verl.trainer.main_ppo data.seed=$1\n", ("$1",), "arguments"),
    ("source ./env.sh\npython3 -m verl.trainer.main_ppo data.seed=$SEED\n", ("$SEED",), "sources ./env.sh"),
])
def test_what_bash_knows_only_at_run_time_stays_unresolved(script, names, why):
    (word,) = our_args(script, {})
    assert isinstance(word, Unresolved) and word.names == names and why in word.why, word
    assert word.text.split("=", 1)[0] in script  # the key stays readable: the importer names it


def test_an_unset_variable_with_a_default_is_not_unresolved():
    assert our_args("python3 -m verl.trainer.main_ppo x.y=${MISSING:-3} x.z=${MISSING:+no}\n", {}) == ["x.y=3", "x.z="]


def test_launch_behind_ray_and_redirections():
    text = ("ray job submit --address=x -- python3 -m recipe.dapo.main_dapo a.b=1 c.d=2 2>&1 | tee log.txt\n"
            "python3 -m verl.trainer.main_ppo never.read=1\n")
    reading = read_script(text, {}, "run.sh")
    assert reading.launch.args == ["a.b=1", "c.d=2"] and reading.launch.line == 1


def test_a_script_without_a_launch_command_has_none():
    reading = read_script("algorithm.adv_estimator=grpo data.seed=1\n", {}, "x.sh")
    assert reading.launch is None and reading.commands == [["algorithm.adv_estimator=grpo", "data.seed=1"]]


def test_broken_syntax_is_named():
    with pytest.raises(ScriptError, match="unterminated double quote"):
        read_script('python3 -m verl.trainer.main_ppo a.b="open\n', {}, "x.sh")


def test_a_word_this_reader_cannot_expand_keeps_its_key():
    (word, plain) = our_args("python3 -m verl.trainer.main_ppo a.b=${X[0]x} c.d=1\n", {})
    assert isinstance(word, Unresolved) and word.text.startswith("a.b=") and "bad substitution" in word.why
    assert plain == "c.d=1"
