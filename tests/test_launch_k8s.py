"""`mmtrain launch k8s`: the manifests' structure, and their pods run here with exactly the
environment the Kubeflow training operator (v1.7+, PR kubeflow/training-operator#1840) gives
each pod, which is what `$(VAR)` in the container's args expands from.

What differs from a cluster, and only that: the master's service name resolves to nothing here,
so MASTER_ADDR is 127.0.0.1 (the address that name would resolve to), and the pod IP is
127.0.0.1; the rendezvous port is a free one, written into the manifest's container port as a
user would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from launch_helpers import (
    REPO,
    STEPS,
    THREAD_ENV,
    free_port,
    reference_weights,
    shards_in,
    step_rows,
    wait_all,
    write_run,
)

IMAGE = "registry.example/mmtrain:1"


def _manifest(config, *extra) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "mmtrain", "launch", "k8s", str(config), "--nodes", "2"]
        + ["--procs-per-node", "1", "--image", IMAGE, *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def _container(pod_spec: dict) -> dict:
    (container,) = pod_spec["containers"]
    return container


def test_pytorchjob_has_master_worker_shm_restart_and_grace(tmp_path):
    config = write_run(tmp_path, shards_in(tmp_path / "shards"))
    job = _manifest(config, "--pvc", "data", "--name", "clip")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert job["metadata"] == {"name": "clip", "namespace": "default"}
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert [(k, v["replicas"]) for k, v in replicas.items()] == [("Master", 1), ("Worker", 1)]
    assert job["spec"]["nprocPerNode"] == "1"
    for replica in replicas.values():
        assert replica["restartPolicy"] == "OnFailure"
        pod = replica["template"]["spec"]
        container = _container(pod)
        assert container["name"] == "pytorch" and container["image"] == IMAGE
        assert {"name": "pytorchjob-port", "containerPort": 23456} in container["ports"]
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert {"name": "work", "mountPath": "/workspace"} in container["volumeMounts"]
        assert container["workingDir"] == "/workspace"
        assert pod["terminationGracePeriodSeconds"] >= 120
        args = container["args"]
        # Only variables every operator version sets the same way; never WORLD_SIZE.
        assert "--node-rank=$(RANK)" in args and "--master-addr=$(MASTER_ADDR)" in args
        assert "--nnodes=2" in args and not any("WORLD_SIZE" in a for a in args)
        assert args[-3:] == ["mmtrain", "train", str(config)]


def test_elastic_pytorchjob_and_jobset(tmp_path):
    config = write_run(tmp_path, shards_in(tmp_path / "shards"))
    elastic = _manifest(config, "--elastic", "--max-restarts", "5")["spec"]
    assert elastic["elasticPolicy"] == {
        "rdzvBackend": "c10d",
        "minReplicas": 2,
        "maxReplicas": 2,
        "maxRestarts": 5,
    }
    assert list(elastic["pytorchReplicaSpecs"]) == ["Worker"]
    assert elastic["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2

    jobset = _manifest(config, "--jobset", "--name", "clip")
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (2, 2, "Indexed")
    env = {e["name"]: e for e in _container(job["template"]["spec"])["env"]}
    assert env["PET_NNODES"]["value"] == "2" and env["PET_NPROC_PER_NODE"]["value"] == "1"
    assert env["PET_MASTER_ADDR"]["value"] == "clip-node-0-0.clip"
    assert "job-completion-index" in env["PET_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]


def _operator_env(job: dict, replica: str, index: int, port: int) -> dict[str, str]:
    """What training-operator v1.7+ adds to a pod of a PyTorchJob with a Master (envvar.go:
    PYTHONUNBUFFERED, MASTER_*, PET_MASTER_*, WORLD_SIZE = replicas x nprocPerNode, RANK = pod
    index, +1 for workers, PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK)."""
    replicas = job["spec"]["pytorchReplicaSpecs"]
    nodes = sum(r["replicas"] for r in replicas.values())
    nproc = int(job["spec"]["nprocPerNode"])
    rank = index + (1 if replica == "Worker" else 0)
    return {
        "PYTHONUNBUFFERED": "0",
        "MASTER_ADDR": "127.0.0.1",  # the service f"{name}-master-0" resolves to its pod
        "MASTER_PORT": str(port),
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(port),
        "WORLD_SIZE": str(nodes * nproc),
        "RANK": str(rank),
        "PET_NNODES": str(nodes),
        "PET_NPROC_PER_NODE": str(nproc),
        "PET_NODE_RANK": str(rank),
    }


def _pod_env(container: dict, operator: dict[str, str]) -> dict[str, str]:
    env = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        elif item["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP":
            env[item["name"]] = "127.0.0.1"
    return {**env, **operator}


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion in command and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


@pytest.mark.slow
def test_pytorchjob_pods_train_with_the_operators_environment(tmp_path, tmp_path_factory):
    shards = shards_in(tmp_path / "shards")
    reference = reference_weights(tmp_path_factory.getbasetemp(), shards)
    config = write_run(tmp_path / "job", shards)
    job = _manifest(config)
    port = free_port()
    pods = []
    for replica, spec in job["spec"]["pytorchReplicaSpecs"].items():
        for index in range(spec["replicas"]):
            container = _container(spec["template"]["spec"])
            container["ports"][0]["containerPort"] = port
            env = _pod_env(container, _operator_env(job, replica, index, port))
            command = [_expand(a, env) for a in container["command"] + container["args"]]
            assert command[0] == "python"
            command[0] = sys.executable  # the image's python is this installation here
            log = open(tmp_path / f"{replica}-{index}.log", "ab")  # noqa: SIM115
            clean = {k: v for k, v in os.environ.items() if k not in env}
            pods.append(
                subprocess.Popen(
                    command,
                    env={**clean, **THREAD_ENV, **env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=container.get("workingDir", REPO),
                )
            )
            log.close()
    codes = wait_all(pods)
    logs = "".join(p.read_text(errors="replace") for p in sorted(tmp_path.glob("*.log")))
    assert codes == [0, 0], logs
    assert "2 ranks x 4 micro-batch" in logs, logs
    run = tmp_path / "job" / "run"
    assert step_rows(run) == list(range(1, STEPS + 1))
    assert (run / "model.safetensors").read_bytes() == reference
