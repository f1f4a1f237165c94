"""TorchX components of elasticrl: an RL (or SFT/RM) job as Ray node pools.

Registered under the ``torchx.components`` entry point as ``elasticrl`` (TorchX's ``dist``
and ``utils`` stay registered), so ``torchx run -s slurm elasticrl.job --spec my.yaml``
works as well as ``elasticrl launch``, which fills the pool sizes from the planner.
"""
from __future__ import annotations

import base64
import re
import shlex
import sys

import torchx.specs as specs

from launch import JOIN_TIMEOUT_S, LOST_S, OUTPUT

PYTHON = sys.executable
ENV = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}  # every node's


def _pool_role(name: str, nodes: int, cpus: int, gpus: int, mem_gb: int, image: str, python: str,
               output: str, timeout_s: int, env: dict, max_restarts: int, lost_s: int,
               app_id: str = specs.macros.app_id) -> specs.Role:
    return specs.Role(
        name=name, image=image, entrypoint=python, num_replicas=nodes, max_retries=max_restarts,
        args=["-m", "launch.node", "worker", "--app-id", app_id, "--pool", name,
              "--cpus", str(cpus), "--gpus", str(gpus),
              "--output", output, "--timeout-s", str(timeout_s), "--lost-s", str(lost_s)],
        resource=specs.Resource(cpu=cpus, gpu=gpus, memMB=mem_gb * 1024), env=dict(env))


def job(
    spec: str,
    output: str = OUTPUT,
    sets: str = "",
    head_cpus: int = 1,
    head_mem_gb: int = 4,
    train_nodes: int = 1,
    train_cpus: int = 4,
    train_gpus: int = 0,
    train_mem_gb: int = 8,
    rollout_nodes: int = 0,
    rollout_cpus: int = 2,
    rollout_gpus: int = 0,
    rollout_mem_gb: int = 8,
    timeout_s: int = JOIN_TIMEOUT_S,
    max_restarts: int = 0,
    lost_s: int = LOST_S,
    image: str = "",
    python: str = PYTHON,
) -> specs.AppDef:
    """An elasticrl job: a Ray head that drives the job, then one role per node pool.

    The head starts Ray, publishes its address beside its token in the job's folder (shared
    by every node) and runs the job; the ``train`` pool's nodes host the trained
    and frozen models, the ``rollout`` pool's the vLLM engines (``rollout_nodes: 0`` puts
    them on the train pool too). Each worker node joins the head's Ray carrying its pool
    name, and every replica exits when the job ends.

    Args:
        spec: path of the job spec (YAML), relative to the job's working directory
        output: the job's output folder (metrics, checkpoints, final model, node logs)
        sets: spec overrides, FIELD=VALUE items as ``elasticrl run --set`` takes them, in shell syntax
            (quote an item that holds spaces)
        head_cpus: CPUs of the head node (it runs the driver only)
        head_mem_gb: memory of the head node, GB
        train_nodes: nodes of the train pool (actor, critic, reference, reward models)
        train_cpus: CPUs per train node
        train_gpus: GPUs per train node
        train_mem_gb: memory per train node, GB
        rollout_nodes: nodes of the rollout pool (vLLM engines); 0: engines on the train pool
        rollout_cpus: CPUs per rollout node
        rollout_gpus: GPUs per rollout node
        rollout_mem_gb: memory per rollout node, GB
        timeout_s: seconds the head waits for every node to join
        max_restarts: times the scheduler restarts the whole app when a node or the driver dies (Slurm
            requeues it); the restarted job resumes from its newest checkpoint
        lost_s: seconds a pool node waits for a head that stopped answering before it fails
        image: the working directory (local_cwd, slurm) or container image (kubernetes)
        python: the Python that runs the nodes (default: the one building the app)
    """
    overrides = shlex.split(sets)
    if rollout_nodes:
        overrides.append("placement.pools=split")
    env = ENV
    expect = 1 + train_nodes + rollout_nodes
    head_args = ["-m", "launch.node", "head", "--app-id", specs.macros.app_id, "--expect", str(expect),
                 "--spec", spec, "--output", output, "--cpus", "0", "--gpus", "0", "--timeout-s", str(timeout_s)]
    for item in overrides:
        # Slurm's script passes arguments unquoted: an item a shell would split travels encoded
        safe = re.fullmatch(r"[\w.\-+=/:,@%]+", item)
        head_args += ["--set", item] if safe else ["--set-b64", base64.urlsafe_b64encode(item.encode()).decode()]
    roles = [specs.Role(name="head", image=image, entrypoint=python, args=head_args, num_replicas=1,
                        max_retries=max_restarts,
                        resource=specs.Resource(cpu=head_cpus, gpu=0, memMB=head_mem_gb * 1024), env=dict(env))]
    roles.append(_pool_role("train", train_nodes, train_cpus, train_gpus, train_mem_gb, image, python, output,
                            timeout_s, env, max_restarts, lost_s))
    if rollout_nodes:
        roles.append(_pool_role("rollout", rollout_nodes, rollout_cpus, rollout_gpus, rollout_mem_gb, image,
                                python, output, timeout_s, env, max_restarts, lost_s))
    return specs.AppDef(name="elasticrl", roles=roles)


def node(
    app_id: str,
    pool: str = "rollout",
    cpus: int = 1,
    gpus: int = 0,
    mem_gb: int = 8,
    output: str = OUTPUT,
    timeout_s: int = JOIN_TIMEOUT_S,
    lost_s: int = LOST_S,
    image: str = "",
    python: str = PYTHON,
) -> specs.AppDef:
    """One more node of a running elasticrl app (``elasticrl scale --join``): it joins the app's
    Ray as a node of ``pool`` and leaves when the app's job ends.

    Args:
        app_id: the running attempt's id, as its head published it (``.elasticrl/ray-address-ID``)
        pool: the node pool it serves (rollout: vLLM engines)
        cpus: CPUs of the node
        gpus: GPUs of the node
        mem_gb: memory of the node, GB
        output: the job's output folder (the node's logs go there)
        timeout_s: seconds it waits for the head's address
        lost_s: seconds it waits for a head that stopped answering before it fails
        image: the working directory (the one the app was launched from)
        python: the Python that runs the node
    """
    role = _pool_role(pool, 1, cpus, gpus, mem_gb, image, python, output, timeout_s,
                      ENV, 0, lost_s, app_id=app_id)
    return specs.AppDef(name=f"elasticrl-{pool}-node", roles=[role])
