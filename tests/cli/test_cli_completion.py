"""``kibo completion bash|zsh``: the scripts, and completion through them for real.

bash: the printed script is sourced in a real bash, and its completion function is
called the way bash calls it on TAB, against the installed ``kibo`` (the script calls
``kibo`` back with ``_KIBO_COMPLETE`` set).  zsh is not installed on the test machines,
so its script is checked for its header and the callback it makes is run directly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_invoke import invoke

BIN = Path(sys.executable).parent


def test_the_scripts_name_kibo() -> None:
    bash = invoke(None, "completion", "bash")
    assert bash.exit_code == 0
    assert "_KIBO_COMPLETE=bash_complete" in bash.stdout
    assert "complete -o nosort -F _kibo_completion kibo" in bash.stdout
    zsh = invoke(None, "completion", "zsh")
    assert zsh.exit_code == 0
    assert zsh.stdout.startswith("#compdef kibo\n")
    assert "_KIBO_COMPLETE=zsh_complete" in zsh.stdout
    assert invoke(None, "completion", "fish-or-not").exit_code == 2


def complete_in_bash(*words: str) -> list[str]:
    """What bash offers for TAB after `words` (the last one is being completed)."""
    if not (BIN / "kibo").exists() or shutil.which("bash") is None:
        pytest.skip("needs the kibo console script and bash")
    line = " ".join(words)
    script = (f'source <(kibo completion bash)\nCOMP_WORDS=({line})\n'
              f'COMP_CWORD={len(words) - 1}\n'
              f'_kibo_completion kibo "{words[-1]}" "{words[-2]}"\n'
              'printf "%s\\n" "${COMPREPLY[@]}"\n')
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line]


def test_bash_completes_commands_subcommands_and_options() -> None:
    assert "workspace" in complete_in_bash("kibo", "")
    assert complete_in_bash("kibo", "node", "l") == ["list"]
    assert complete_in_bash("kibo", "workspace", "ex") == ["exec", "expand-layer"]
    assert complete_in_bash("kibo", "node", "list", "--page-") == ["--page-size",
                                                                    "--page-token"]
    assert complete_in_bash("kibo", "completion", "") == ["bash", "zsh"]


def test_the_zsh_callback_answers() -> None:
    if not (BIN / "kibo").exists():
        pytest.skip("needs the kibo console script")
    env = {**os.environ, "_KIBO_COMPLETE": "zsh_complete", "COMP_WORDS": "kibo node l",
           "COMP_CWORD": "2"}
    done = subprocess.run([str(BIN / "kibo")], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:2] == ["plain", "list"]
