"""The models and their migrations agree."""

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_makemigrations_check_is_clean():
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)
