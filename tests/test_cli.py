"""`dgrpo` answers --help and config errors fast, before torch or vLLM is imported."""

from __future__ import annotations

import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    # check=False: the tests assert the exit code themselves (2 for a config error)
    return subprocess.run([sys.executable, "-m", "dgrpo.cli", *args], check=False, capture_output=True, text=True,
                          timeout=60)


def test_help_lists_every_option_of_the_command(child_processes):
    out = run("sampler", "--help")
    assert out.returncode == 0
    for key in ("sampler.gpu_memory_utilization", "sampler.enable_prefix_caching", "model.path", "KEY=VALUE"):
        assert key in out.stdout


def test_config_error_exits_2_naming_the_key_without_importing_heavy_modules(child_processes):
    code = (
        "import sys\n"
        "from dgrpo.cli.main import main\n"
        "rc = main(['sampler', 'sampler.max_num_seqs=0'])\n"
        "heavy = [m for m in ('torch', 'vllm') if m in sys.modules]\n"
        "print('HEAVY', heavy, 'RC', rc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert "sampler.max_num_seqs=0" in out.stderr
    assert "HEAVY [] RC 2" in out.stdout


def test_python_m_dgrpo_is_the_dgrpo_command(child_processes, tmp_path):
    """`python -m dgrpo` runs the CLI, from any folder (not only `python -m dgrpo.cli`)."""
    out = subprocess.run([sys.executable, "-m", "dgrpo", "show-config", "sampler.port=6001"], check=False,
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "port: 6001" in out.stdout


def test_show_config_prints_resolved_yaml(child_processes):
    out = run("show-config", "sampler.port=6000")
    assert out.returncode == 0 and "port: 6000" in out.stdout


def test_missing_model_folder_is_one_clear_line(child_processes, tmp_path):
    out = run("sampler", f"model.path={tmp_path / 'nope'}")
    assert out.returncode == 2
    assert "is not a Hugging Face folder" in out.stderr and "Traceback" not in out.stderr
