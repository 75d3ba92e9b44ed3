"""Process groups and the per-micro-batch CP group decision."""

from relax_gdn.parallel.cp_group import CPGroup, resolve_cp_group

__all__ = ["CPGroup", "resolve_cp_group"]
