"""Placement: Ray sessions, role groups (N actors of one role on a placement group) and the
job's roles placed on them."""
from elasticrl.cluster.group import RoleError, RoleGroup, Unplaceable
from elasticrl.cluster.placement import Placement
from elasticrl.cluster.session import ray_session

__all__ = ["Placement", "RoleError", "RoleGroup", "Unplaceable", "ray_session"]
