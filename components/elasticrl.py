"""TorchX components of elasticrl: a job as a Ray head plus one app role per placement group
of model roles (actor, critic, reference, reward, rollout; colocated roles joined, as
``actor-reference`` or ``all``).

Registered under the ``torchx.components`` entry point as ``elasticrl`` (TorchX's ``dist``
and ``utils`` stay registered), so ``torchx run -s slurm elasticrl.job --spec my.yaml
--roles actor=1:4:0:8,rollout=1:2:0:8`` works as well as ``elasticrl launch``, which fills
the app roles from the planner (``elasticrl.plan.apps``).
"""
from __future__ import annotations

import base64
import re
import shlex
import sys

import torchx.specs as specs

from components import JOIN_TIMEOUT_S, LOST_S, OUTPUT

PYTHON = sys.executable
ENV = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}  # every node's


def _node_role(name: str, nodes: int, cpus: int, gpus: int, mem_gb: int, image: str, python: str,
               output: str, timeout_s: int, env: dict, max_restarts: int, lost_s: int,
               app_id: str = specs.macros.app_id) -> specs.Role:
    return specs.Role(
        name=name, image=image, entrypoint=python, num_replicas=nodes, max_retries=max_restarts,
        args=["-m", "launch.node", "worker", "--app-id", app_id, "--role", name,
              "--cpus", str(cpus), "--gpus", str(gpus),
              "--output", output, "--timeout-s", str(timeout_s), "--lost-s", str(lost_s)],
        resource=specs.Resource(cpu=cpus, gpu=gpus, memMB=mem_gb * 1024), env=dict(env))


def _sizes(roles: str) -> list[tuple[str, int, int, int, int]]:
    """``NAME=NODES:CPUS:GPUS:MEM_GB,...`` as (name, nodes, cpus, gpus, mem_gb) each."""
    out = []
    for item in filter(None, roles.split(",")):
        m = re.fullmatch(r"([a-z][a-z\-]*)=(\d+):(\d+):(\d+):(\d+)", item.strip())
        if not m or int(m.group(2)) < 1:
            raise ValueError(f"--roles {item!r}: expected NAME=NODES:CPUS:GPUS:MEM_GB, NODES >= 1 "
                             "(e.g. actor=2:8:1:64)")
        out.append((m.group(1), *map(int, m.groups()[1:])))
    if not out:
        raise ValueError("--roles: name at least one app role, e.g. actor=1:4:0:8")
    return out


def job(
    spec: str,
    roles: str = "actor=1:4:0:8",
    output: str = OUTPUT,
    sets: str = "",
    head_cpus: int = 1,
    head_mem_gb: int = 4,
    timeout_s: int = JOIN_TIMEOUT_S,
    max_restarts: int = 0,
    lost_s: int = LOST_S,
    image: str = "",
    python: str = PYTHON,
) -> specs.AppDef:
    """An elasticrl job: a Ray head that drives the job, then one app role per placement group
    of model roles.

    The head starts Ray, publishes its address beside its token in the job's folder (shared
    by every node) and runs the job; each app role's nodes join the head's Ray carrying its
    name, and the model roles of that placement group run there only (the spec gets
    ``placement.pools: per_role``). Every replica exits when the job ends.

    Args:
        spec: path of the job spec (YAML), relative to the job's working directory
        roles: the app roles after the head, NAME=NODES:CPUS:GPUS:MEM_GB (per node) each, comma-separated;
            NAME is a model role (actor, critic, reference, reward, rollout) or colocated ones joined
            (actor-reference, critic-reward, all); elasticrl launch and elasticrl plan print the job's
        output: the job's output folder (metrics, checkpoints, final model, node logs)
        sets: spec overrides, FIELD=VALUE items as ``elasticrl run --set`` takes them, in shell syntax
            (quote an item that holds spaces)
        head_cpus: CPUs of the head node (it runs the driver only)
        head_mem_gb: memory of the head node, GB
        timeout_s: seconds the head waits for every node to join
        max_restarts: times the scheduler restarts the whole app when a node or the driver dies (Slurm
            requeues it); the restarted job resumes from its newest checkpoint
        lost_s: seconds a node waits for a head that stopped answering before it fails
        image: the working directory (local_cwd, slurm) or container image (kubernetes)
        python: the Python that runs the nodes (default: the one building the app)
    """
    sizes = _sizes(roles)
    overrides = shlex.split(sets) + ["placement.pools=per_role"]
    env = ENV
    expect = 1 + sum(nodes for _, nodes, *_ in sizes)
    head_args = ["-m", "launch.node", "head", "--app-id", specs.macros.app_id, "--expect", str(expect),
                 "--spec", spec, "--output", output, "--cpus", "0", "--gpus", "0", "--timeout-s", str(timeout_s)]
    for item in overrides:
        # Slurm's script passes arguments unquoted: an item a shell would split travels encoded
        safe = re.fullmatch(r"[\w.\-+=/:,@%]+", item)
        head_args += ["--set", item] if safe else ["--set-b64", base64.urlsafe_b64encode(item.encode()).decode()]
    app_roles = [specs.Role(name="head", image=image, entrypoint=python, args=head_args, num_replicas=1,
                            max_retries=max_restarts,
                            resource=specs.Resource(cpu=head_cpus, gpu=0, memMB=head_mem_gb * 1024), env=dict(env))]
    for name, nodes, cpus, gpus, mem_gb in sizes:
        app_roles.append(_node_role(name, nodes, cpus, gpus, mem_gb, image, python, output, timeout_s, env,
                                    max_restarts, lost_s))
    return specs.AppDef(name="elasticrl", roles=app_roles)


def node(
    app_id: str,
    role: str = "rollout",
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
    Ray as a node of app role ``role`` and leaves when the app's job ends.

    Args:
        app_id: the running attempt's id, as its head published it (``.elasticrl/ray-address-ID``)
        role: the app role it serves (rollout: vLLM engines)
        cpus: CPUs of the node
        gpus: GPUs of the node
        mem_gb: memory of the node, GB
        output: the job's output folder (the node's logs go there)
        timeout_s: seconds it waits for the head's address
        lost_s: seconds it waits for a head that stopped answering before it fails
        image: the working directory (the one the app was launched from)
        python: the Python that runs the node
    """
    app_role = _node_role(role, 1, cpus, gpus, mem_gb, image, python, output, timeout_s,
                          ENV, 0, lost_s, app_id=app_id)
    return specs.AppDef(name=f"elasticrl-{role}-node", roles=[app_role])
