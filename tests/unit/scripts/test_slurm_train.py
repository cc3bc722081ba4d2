"""scripts/slurm_train.sbatch without SLURM: it parses, refuses to run outside a job, and with
stand-in srun / scontrol hands run_train.sh the rendezvous of the job's first node."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SBATCH = ROOT / "scripts/slurm_train.sbatch"


def _executable(path: Path, text: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + text)
    path.chmod(0o755)


def test_parses_and_is_executable():
    assert os.access(SBATCH, os.X_OK)
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)


def test_outside_a_job_is_one_line_and_exit_2():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True)
    assert result.returncode == 2
    assert "not inside a SLURM job" in result.stderr and len(result.stderr.splitlines()) == 1


def test_each_node_gets_its_rank_and_the_first_node_address(tmp_path):
    bin_dir, repo = tmp_path / "bin", tmp_path / "repo"
    bin_dir.mkdir()
    repo.mkdir()
    _executable(bin_dir / "scontrol", 'printf "node-a\\nnode-b\\n"\n')
    # srun: run the task once per node, as SLURM would (each with its own SLURM_NODEID).
    _executable(bin_dir / "srun", 'for n in 0 1; do SLURM_NODEID=$n "${@:3}"; done\n')
    _executable(
        repo / "run_train.sh",
        'echo "$NNODES $NODE_RANK $MASTER_ADDR $MASTER_PORT $NGPU $CONFIG_FILE $*"\n',
    )
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_NNODES": "2",
        "SLURM_SUBMIT_DIR": str(repo),
        "SLURM_GPUS_ON_NODE": "4",
        "CONFIG_FILE": "x.toml",
    }
    result = subprocess.run(
        ["bash", str(SBATCH), "--training.steps", "5", "--job.description", "a b"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()[1:]  # after the summary line
    assert lines == [
        "2 0 node-a 29500 4 x.toml --training.steps 5 --job.description a b",
        "2 1 node-a 29500 4 x.toml --training.steps 5 --job.description a b",
    ]
