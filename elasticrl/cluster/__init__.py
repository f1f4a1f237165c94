"""Placement: Ray sessions and role groups (N actors of one role on a placement group)."""
from elasticrl.cluster.group import RoleError, RoleGroup
from elasticrl.cluster.session import ray_session

__all__ = ["RoleError", "RoleGroup", "ray_session"]
