"""Every row lock of the platform, in one place.

Lock order, everywhere: the resource group row first (the serialisation point
of admission and release for that group), then its quota rows by pk. Runs are
never locked: they move by conditional UPDATE (jobs.handler). Keeping one
order means two transactions can wait for each other but never deadlock.
Call these inside ``transaction.atomic()``.
"""

from __future__ import annotations

from rlplatform.models import Membership, Quota, ResourceGroup


def lock_group(group_id: int) -> ResourceGroup:
    """Lock one resource group row; admissions and releases of the group queue behind it."""
    return ResourceGroup.objects.select_for_update().get(pk=group_id)


def lock_groups(group_ids) -> list[ResourceGroup]:
    return list(ResourceGroup.objects.select_for_update().filter(pk__in=list(group_ids)).order_by("pk"))


def lock_group_quotas(group_id: int) -> dict[int, Quota]:
    """Lock every quota of a group (after its group row), by pk."""
    return {q.pk: q for q in Quota.objects.select_for_update().filter(group_id=group_id).order_by("pk")}


def lock_quota(quota_id: int) -> Quota:
    """Lock one quota (after its group row)."""
    return Quota.objects.select_for_update().get(pk=quota_id)


def lock_membership(team_id: int, user_id: int) -> Membership | None:
    return Membership.objects.select_for_update().filter(team_id=team_id, user_id=user_id).first()
