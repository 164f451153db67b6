"""Scripts and manifests around torchrun: `mmtrain launch slurm|k8s|local CONFIG.yaml ...`.

- `job`: what every launcher reads first: the run config (validated for nodes x ranks), the
  Python of this installation, the torchrun arguments all launchers share.
- `grace`: how long before a time limit the ranks must be told to stop (the planner's
  checkpoint size over a write rate, with a margin): Slurm's `--signal`, Kubernetes'
  termination grace period, torchrun's shutdown timeout.
- `slurm`: an sbatch script (one torchrun per node through srun, c10d rendezvous on the head
  node, USR1 -> checkpoint -> `scontrol requeue`).
- `k8s`: a Kubeflow PyTorchJob manifest (static or elastic rendezvous) or a JobSet.
- `local`: several torchrun agents ("nodes") on one host, or one agent of a multi-host job.
- `address`, `worker`: the two small programs the generated scripts run on each node (no torch
  import in `address`).

The trainer reads only the standard environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
LOCAL_RANK that torchrun sets); see docs/MULTINODE.md.
"""
