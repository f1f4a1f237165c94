"""What ``elasticrl launch`` asks a scheduler for, after the head: one app role per placement
group of model roles (``roles.app_roles``), each with its nodes and, per node, CPUs, GPUs and
memory. With a plan (``--gpus``): each placement group's GPUs in whole nodes (an app role that
asks for less than a node shares one with others where the scheduler packs jobs, as Slurm's
cons_tres does), CPUs and memory in proportion, plus the host memory the plan counts for its
roles (offloaded states, checkpoint staging, the in-memory copy). Without: the CPUs its ranks
take, on one node or on as many as asked. ``elasticrl plan`` prints the same table.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from elasticrl.plan.memory import GB
from elasticrl.plan.roles import app_role_cpus, app_roles

CPUS_PER_GPU = 8     # host CPUs a node offers each of its GPUs' ranks (data loading, the engine's scheduler)
NODE_MEM_GB = 8      # a node's own processes (Ray, Python) besides what the plan counts
MEM_PER_GPU_GB = 16  # host memory of a GPU's rank process (CUDA context, model load) besides the plan's


class AppRole(NamedTuple):
    name: str
    roles: list    # the model roles on its nodes
    nodes: int
    cpus: int      # per node
    gpus: int      # per node
    mem_gb: int    # per node


def app_role_sizes(spec, plan=None, nodes: dict[str, int] | None = None) -> list[AppRole]:
    """The job's app roles in launch order. ``spec`` carries the plan's settings when there is
    a plan; ``nodes`` (without a plan): app role -> nodes its CPUs are spread over (default 1)."""
    apps, nodes = app_roles(spec), dict(nodes or {})
    for name in nodes:
        if name not in apps:
            raise ValueError(f"--role-nodes {name}: this job's app roles are {', '.join(apps)}")
    if plan is not None and nodes:
        raise ValueError("--role-nodes: with --gpus the planner sizes every app role (set --nodes)")
    out = []
    for name, members in apps.items():
        if plan is None:
            n = nodes.get(name, 1)
            out.append(AppRole(name, members, n, math.ceil(app_role_cpus(spec)[name] / n), 0, NODE_MEM_GB))
            continue
        planned = [plan.roles[r] for r in members if r in plan.roles]
        gpus, per_node = max(r["gpus"] for r in planned), plan.inventory.per_node
        n = math.ceil(gpus / per_node)
        host = sum(r["host"] for r in planned)
        on_one = min(gpus, per_node)
        mem = NODE_MEM_GB + MEM_PER_GPU_GB * on_one + math.ceil(host / n / GB)
        out.append(AppRole(name, members, n, CPUS_PER_GPU * on_one, on_one, mem))
    return out


def render_apps(apps: list[AppRole]) -> str:
    """The app roles as ``elasticrl plan`` and ``elasticrl launch`` print them."""
    w = max(len(a.name) for a in apps) + 2
    lines = ["app roles after the head (per node: CPUs, GPUs, memory):"]
    lines += [f"  {a.name:{w}} {a.nodes} node(s) x cpu {a.cpus}, gpu {a.gpus}, {a.mem_gb} GB   "
              f"model roles: {', '.join(a.roles)}" for a in apps]
    return "\n".join(lines)
