"""The resource planner: fits a job's roles to a GPU inventory (``elasticrl plan``)."""
from elasticrl.plan.arch import Arch, arch_of
from elasticrl.plan.planner import Inventory, Plan, PlanError, plan_job, render

__all__ = ["Arch", "Inventory", "Plan", "PlanError", "arch_of", "plan_job", "render"]
