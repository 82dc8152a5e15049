"""Every Python block of README.md runs as written (CPU, a subprocess each, from a scratch directory); the
tensor-parallel block runs as a 2-process gloo job under torchrun; README's test command is the one CI runs."""
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
README = (REPOSITORY / "README.md").read_text()
BLOCK = re.compile(r"^(<!-- (?P<marker>[\w-]+) -->\n)?```(?P<language>\w*)\n(?P<code>.*?)^```",
                   re.MULTILINE | re.DOTALL)
BLOCKS = [match.groupdict() for match in BLOCK.finditer(README)]
PYTHON_BLOCKS = [block["code"] for block in BLOCKS if block["language"] == "python"]
TIMEOUT_S = 300


def is_distributed(code: str) -> bool:
    return "init_process_group" in code


def run_block(code: str, directory: pathlib.Path) -> subprocess.CompletedProcess:
    """Run a block as a script in `directory`: with torchrun on 2 processes when it joins a process group."""
    script = directory / "block.py"
    script.write_text(code)
    launcher = [sys.executable]
    if is_distributed(code):
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([*launcher, str(script)], cwd=directory, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


@pytest.mark.parametrize("code", PYTHON_BLOCKS, ids=[f"block{i}" for i in range(len(PYTHON_BLOCKS))])
def test_python_block_runs(code, tmp_path):
    result = run_block(code, tmp_path)
    output = f"--- stdout ---\n{result.stdout[-2000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
    assert result.returncode == 0, f"README block failed:\n{code}\n{output}"
    assert result.stdout.strip(), f"the block printed nothing\n{output}"


def test_readme_has_the_quickstart_and_the_tensor_parallel_example():
    assert len(PYTHON_BLOCKS) >= 3
    distributed = [code for code in PYTHON_BLOCKS if is_distributed(code)]
    assert len(distributed) == 1, "one tensor-parallel example, run on 2 processes"
    code = distributed[0]
    assert "ColumnParallelLinear" in code and "RowParallelLinear" in code and "sequence_parallel=True" in code
    name = re.match(r"# (\S+\.py)\n", code)
    assert name, "the tensor-parallel block starts with its file name as a comment"
    assert f"torchrun --nproc-per-node 2 {name.group(1)}" in README, "README says how to run it, as the test does"


def test_the_tensor_parallel_block_fails_when_a_rank_fails(tmp_path):
    """The 2-process run is a real check: a failure on rank 1 fails it."""
    code = next(code for code in PYTHON_BLOCKS if is_distributed(code))
    broken = code.replace("y.square().mean().backward()",
                          "y.square().mean().backward()\nassert rank == 0, 'rank 1 fails'")
    assert broken != code
    assert run_block(broken, tmp_path).returncode != 0


def normalized_commands(text: str) -> list[list[str]]:
    """Shell command lines as tokens, `python -m pip ...` as `pip ...`, `python -m pytest ...` as `pytest ...`,
    without -q."""
    commands = []
    for line in text.splitlines():
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:  # a line of a multi-line shell construct
            continue
        if not tokens:
            continue
        if "python" in pathlib.PurePath(tokens[0]).name.lower() and tokens[1:2] == ["-m"]:
            tokens = tokens[2:]
        commands.append([token for token in tokens if token != "-q"])
    return commands


def test_readme_test_command_is_what_ci_runs():
    (block,) = [block for block in BLOCKS if block["marker"] == "test-command"]
    readme_commands = normalized_commands(block["code"])
    assert readme_commands == [["pip", "install", "-e", ".[test]"], ["pytest", "tests"]]
    ci_commands = normalized_commands((REPOSITORY / ".ci" / "run").read_text())
    for command in readme_commands:
        assert command in ci_commands, f"README's `{shlex.join(command)}` is not run by .ci/run"
