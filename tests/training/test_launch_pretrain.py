"""scripts/launch_pretrain.sh: the torchrun command it starts, seen through a stub `torchrun` on PATH that prints its
arguments (nothing is launched)."""
import os
import subprocess

import pytest
from repo_paths import CONFIGS, ROOT, SCRIPTS


def _launch(tmp_path, **env):
    stub = tmp_path / "bin" / "torchrun"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text('#!/bin/sh\necho "torchrun $*"\n')
    stub.chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if k != "GPUS_PER_NODE"}
    environ.update(PATH=f"{stub.parent}{os.pathsep}{os.environ['PATH']}", CONFIG=os.path.join(CONFIGS, "tiny.yaml"),
                   RUN_DIR=str(tmp_path / "run"), **env)
    return subprocess.run(["bash", os.path.join(SCRIPTS, "launch_pretrain.sh")], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("gpus", ["0", "-3", "1.5", "2 4", "two"])
def test_gpus_per_node_must_be_a_positive_integer(tmp_path, gpus):
    """0, -3 and 1.5 once launched one process, "2 4" printed a bash syntax error and launched one too."""
    result = _launch(tmp_path, GPUS_PER_NODE=gpus)
    assert result.returncode == 2 and "torchrun" not in result.stdout, result.stdout + result.stderr
    assert result.stderr.strip() == f"GPUS_PER_NODE must be a positive integer (processes per node), got '{gpus}'"


def test_gpus_per_node_sets_the_processes_per_node(tmp_path):
    result = _launch(tmp_path, GPUS_PER_NODE="2")
    assert result.returncode == 0, result.stderr
    assert "--nproc-per-node 2 " in result.stdout and "-m megatron_int8.pretrain --config" in result.stdout


@pytest.mark.parametrize("env, message", [
    (dict(NNODES="0"), "NNODES must be a positive integer and NODE_RANK one of 0 to NNODES - 1, got NNODES='0' "
                       "NODE_RANK='0'"),
    (dict(NNODES="2", NODE_RANK="2"), "got NNODES='2' NODE_RANK='2'"),
    (dict(NODE_RANK="-1"), "got NNODES='1' NODE_RANK='-1'"),
    (dict(MASTER_PORT="70000"), "MASTER_PORT must be a port number (1 to 65535), got '70000'"),
    (dict(MASTER_PORT="port"), "got 'port'"),
])
def test_nodes_and_port_are_checked_before_torchrun(tmp_path, env, message):
    """A NODE_RANK beyond NNODES (a node the job does not have), NNODES 0 or a port out of range reached torchrun."""
    result = _launch(tmp_path, GPUS_PER_NODE="1", **env)
    assert result.returncode == 2 and "torchrun" not in result.stdout, result.stdout + result.stderr
    assert message in result.stderr


def test_a_second_node_launches_with_its_rank(tmp_path):
    result = _launch(tmp_path, GPUS_PER_NODE="1", NNODES="2", NODE_RANK="1", MASTER_PORT="29500")
    assert result.returncode == 0, result.stderr
    assert "--nnodes 2 --node-rank 1 " in result.stdout and "--master-port 29500" in result.stdout
