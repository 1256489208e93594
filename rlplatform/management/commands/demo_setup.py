"""Seed a laptop demo: an admin, a team, a local CPU resource group, a quota
and an experiment. Idempotent: running it twice changes nothing."""

import os

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

from jobs.models import Experiment
from rlplatform.models import Device, DeviceKind, Host, Membership, Quota, ResourceGroup, Role, Team

DEMO_USER = "demo"
DEMO_PASSWORD = "demo-password"


class Command(BaseCommand):
    help = "Create the demo admin, team, local CPU resource group, quota and experiment."

    def add_arguments(self, parser):
        parser.add_argument("--devices", type=int, default=os.cpu_count() or 1, help="CPU 'devices' of the local host")

    @transaction.atomic
    def handle(self, *args, devices: int, **options):
        user, created = get_user_model().objects.get_or_create(
            username=DEMO_USER, defaults={"is_staff": True, "is_superuser": True}
        )
        if created:
            user.set_password(DEMO_PASSWORD)
            user.save()
        team, _ = Team.objects.get_or_create(name="demo", defaults={"description": "Demo team"})
        Membership.objects.get_or_create(team=team, user=user, defaults={"role": Role.ADMIN})
        group, _ = ResourceGroup.objects.get_or_create(
            name="local-cpu",
            defaults={"kind": DeviceKind.CPU, "device_model": "x86-64", "description": "This machine's CPU"},
        )
        group.teams.add(team)
        host, _ = Host.objects.get_or_create(
            name="local", defaults={"group": group, "address": "127.0.0.1", "queue": "host.local"}
        )
        for index in range(devices):
            Device.objects.get_or_create(host=host, index=index, defaults={"kind": DeviceKind.CPU, "model": "x86-64"})
        quota, _ = Quota.objects.get_or_create(
            team=team, group=group, name="demo", defaults={"max_devices": devices, "max_concurrent_runs": 2}
        )
        Experiment.objects.get_or_create(
            team=team, name="demo", defaults={"group": group, "quota": quota, "created_by": user}
        )
        self.stdout.write(
            f"demo user: {DEMO_USER} / {DEMO_PASSWORD} (team 'demo', group 'local-cpu', {devices} devices)"
        )
