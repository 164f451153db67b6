"""`mmtrain launch k8s`: a Kubeflow PyTorchJob manifest, or (`--jobset`) a JobSet.

Every pod runs one torchrun agent (container `pytorch`, the name the training operator looks
for) that starts the node's ranks; how the agents find each other depends on the object:

- PyTorchJob, static rendezvous: a Master replica and N - 1 Workers. The operator gives every
  pod MASTER_ADDR (the master's service), MASTER_PORT and RANK (the pod's index: master 0,
  worker i -> i + 1); these mean the same in every operator version, so the agent's arguments
  are built from them alone (Kubernetes expands `$(VAR)` in `args`). WORLD_SIZE is not used:
  its meaning changed between operator versions (docs/MULTINODE.md); `--nnodes` is known here.
- PyTorchJob with `elasticPolicy` (c10d): Workers only; the operator sets PET_RDZV_ENDPOINT
  (worker 0's service), PET_RDZV_BACKEND and PET_NNODES, which torchrun reads itself; worker 0
  hosts the store (its host name is the endpoint's).
- JobSet: one replicated Job of N indexed pods; the manifest sets the PET_* variables itself,
  the node rank from the pod's completion index and the master address from JobSet's stable
  pod host names (`NAME-node-0-0.NAME`).

Every pod: the agent's address is the pod IP (`--local-addr`; the ranks' MASTER_ADDR is the
address of the agent holding rank 0, and a pod's own host name need not resolve elsewhere), a
memory-backed /dev/shm (DataLoader workers share batches through it; the default 64 MB kills
them), restart on failure (the rerun resumes from the newest checkpoint on the volume), and a
termination grace period long enough to checkpoint: Kubernetes sends SIGTERM to torchrun,
which passes it to the ranks once and waits for them (PET_SHUTDOWN_TIMEOUT).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from mmtrain.launch.grace import Grace
from mmtrain.launch.job import Job

CONTAINER = "pytorch"  # the training operator finds its container by this name
PORT_NAME = "pytorchjob-port"  # and the rendezvous port by this one
PORT = 23456
JOBSET_JOB = "node"


@dataclass(frozen=True)
class K8sOptions:
    image: str
    config_path: str  # the config's path inside the container
    namespace: str = "default"
    name: str | None = None
    gpus_per_node: int | None = None
    pvc: str | None = None
    mount: str = "/workspace"
    workdir: str | None = None
    elastic: bool = False
    max_restarts: int = 3
    shm_gb: float | None = None


def _name(job: Job, options: K8sOptions) -> str:
    return (options.name or job.name).lower()


def _rank_args(job: Job, options: K8sOptions) -> list[str]:
    return ["-m", "mmtrain", *job.train_argv(options.config_path)]


def _env(grace: Grace) -> list[dict[str, Any]]:
    return [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "PET_SHUTDOWN_TIMEOUT", "value": str(grace.seconds)},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]


def _container(job: Job, options: K8sOptions, grace: Grace, args: list[str], env=()) -> dict:
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": options.image,
        "command": ["python", "-m", "torch.distributed.run"],
        "args": args,
        "env": [*_env(grace), *env],
        "ports": [{"name": PORT_NAME, "containerPort": PORT}],
        "resources": {"requests": {"cpu": str(job.cpus_per_node())}},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if options.gpus_per_node:
        gpus = str(options.gpus_per_node)
        container["resources"]["limits"] = {"nvidia.com/gpu": gpus}
    if options.pvc:
        container["volumeMounts"].append({"name": "work", "mountPath": options.mount})
    if options.workdir:
        container["workingDir"] = options.workdir
    return container


def _pod_spec(container: dict, options: K8sOptions, grace: Grace, restart: str) -> dict:
    shm: dict[str, Any] = {"medium": "Memory"}
    if options.shm_gb:
        shm["sizeLimit"] = f"{options.shm_gb:g}Gi"
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": shm}]
    if options.pvc:
        volumes.append({"name": "work", "persistentVolumeClaim": {"claimName": options.pvc}})
    return {
        "restartPolicy": restart,
        "terminationGracePeriodSeconds": grace.seconds,
        "containers": [container],
        "volumes": volumes,
    }


def _replica(count: int, pod: dict) -> dict:
    return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": pod}}


def pytorchjob(job: Job, grace: Grace, options: K8sOptions) -> dict:
    """A kubeflow.org/v1 PyTorchJob."""
    name = _name(job, options)
    common = [f"--nproc-per-node={job.procs_per_node}", "--local-addr=$(POD_IP)"]
    spec: dict[str, Any] = {"nprocPerNode": str(job.procs_per_node)}
    if options.elastic:
        # torchrun reads PET_RDZV_ENDPOINT, PET_RDZV_BACKEND, PET_NNODES and PET_MAX_RESTARTS
        # (restarts in place; the ranks resume from the newest checkpoint) from the operator.
        args = [*common, f"--rdzv-id={name}", *_rank_args(job, options)]
        pod = _pod_spec(_container(job, options, grace, args), options, grace, "OnFailure")
        spec["elasticPolicy"] = {
            "rdzvBackend": "c10d",
            "minReplicas": job.nodes,
            "maxReplicas": job.nodes,
            "maxRestarts": options.max_restarts,
        }
        spec["pytorchReplicaSpecs"] = {"Worker": _replica(job.nodes, pod)}
    else:
        args = [
            *common,
            f"--nnodes={job.nodes}",
            "--node-rank=$(RANK)",
            "--master-addr=$(MASTER_ADDR)",
            "--master-port=$(MASTER_PORT)",
            "--max-restarts=0",
            *_rank_args(job, options),
        ]
        pod = _pod_spec(_container(job, options, grace, args), options, grace, "OnFailure")
        replicas = {"Master": _replica(1, pod)}
        if job.nodes > 1:
            replicas["Worker"] = _replica(job.nodes - 1, pod)
        spec["pytorchReplicaSpecs"] = replicas
    spec["runPolicy"] = {"backoffLimit": options.max_restarts, "cleanPodPolicy": "None"}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": options.namespace},
        "spec": spec,
    }


def jobset(job: Job, grace: Grace, options: K8sOptions) -> dict:
    """A jobset.x-k8s.io/v1alpha2 JobSet: one indexed Job of `nodes` pods."""
    name = _name(job, options)
    env = [
        {"name": "PET_NNODES", "value": str(job.nodes)},
        {"name": "PET_NPROC_PER_NODE", "value": str(job.procs_per_node)},
        {
            "name": "PET_NODE_RANK",
            "valueFrom": {
                "fieldRef": {
                    "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
                }
            },
        },
        # JobSet gives pod i of replicated job J the host name NAME-J-0-i under subdomain NAME.
        {"name": "PET_MASTER_ADDR", "value": f"{name}-{JOBSET_JOB}-0-0.{name}"},
        {"name": "PET_MASTER_PORT", "value": str(PORT)},
    ]
    args = ["--local-addr=$(POD_IP)", "--max-restarts=0", *_rank_args(job, options)]
    pod = _pod_spec(_container(job, options, grace, args, env), options, grace, "Never")
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": options.namespace},
        "spec": {
            "failurePolicy": {"maxRestarts": options.max_restarts},
            "network": {"enableDNSHostnames": True},
            "replicatedJobs": [
                {
                    "name": JOBSET_JOB,
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "parallelism": job.nodes,
                            "completions": job.nodes,
                            "completionMode": "Indexed",
                            "backoffLimit": 0,  # a failed pod restarts the whole JobSet
                            "template": {"spec": pod},
                        }
                    },
                }
            ],
        },
    }


def to_yaml(manifest: dict) -> str:
    return yaml.safe_dump(manifest, sort_keys=False)
