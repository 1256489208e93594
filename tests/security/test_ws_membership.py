"""Open live-UI WebSockets follow membership changes (issue 13, cross-team access 3).

A socket was authorised only when it connected: a member removed from the team
kept receiving the run's stream. Now a membership change tells the user's
sockets to re-check at once (closed with 4404 when the team is lost), and a
timer (TANDEM_WS_ACCESS_RECHECK_S) catches changes made elsewhere.

Through WebsocketCommunicator on the real ASGI application with the Redis
channel layer (tests/live/helpers.py).
"""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync, sync_to_async

from jobs import handler, stream
from jobs.states import RunState
from rlplatform import memberships
from rlplatform.models import Membership
from tests.live.helpers import communicator, receive_until_live

pytestmark = pytest.mark.django_db(transaction=True)

CLOSED_NOT_FOUND = {"type": "websocket.close", "code": 4404}
CLOSED_SIGNED_OUT = {"type": "websocket.close", "code": 4401}


@pytest.fixture
def slow_timer(settings):
    """Only the membership change's own message can close a socket within these tests."""
    settings.TANDEM_WS_ACCESS_RECHECK_S = 3600.0


async def _subscribed(run, cookie):
    comm = communicator(f"/ws/runs/{run.pk}/", cookie)
    connected, _ = await comm.connect()
    assert connected
    await comm.send_json_to({"type": "subscribe", "after": 0})
    await receive_until_live(comm)
    return comm


def test_a_removed_member_is_closed_with_4404_and_gets_nothing_more_while_a_member_who_stays_does(
    run, team_a, owner, viewer, cookie_for, flush_layer, slow_timer
):
    cookies = cookie_for(owner), cookie_for(viewer)

    async def scenario():
        stays, removed = await _subscribed(run, cookies[0]), await _subscribed(run, cookies[1])
        # When the viewer is removed from the team
        await sync_to_async(memberships.remove_member)(team_a, viewer, actor=owner)
        closed = await removed.receive_output(timeout=5)
        # Then nothing of the run reaches the removed socket: no live entry, no backlog on a new subscribe
        seq = await sync_to_async(stream.append)(run.pk, "event", {"kind": "after-removal", "payload": {}})
        kept = await stays.receive_json_from(timeout=5)
        await removed.send_json_to({"type": "subscribe", "after": 0})
        quiet = await removed.receive_nothing(timeout=0.3)
        for comm in (stays, removed):
            await comm.disconnect()
        return closed, seq, kept, quiet

    closed, seq, kept, quiet = async_to_sync(scenario)()
    assert closed == CLOSED_NOT_FOUND
    assert kept == {"seq": seq, "type": "event", "data": {"kind": "after-removal", "payload": {}}}
    assert quiet
    assert not Membership.objects.filter(team=team_a, user=viewer).exists()


def test_a_membership_deleted_in_the_django_admin_closes_the_members_socket(
    run, team_a, viewer, superuser, cookie_for, flush_layer, slow_timer
):
    from django.test import Client

    admin = Client()
    admin.force_login(superuser)
    membership = Membership.objects.get(team=team_a, user=viewer)
    cookie = cookie_for(viewer)

    async def scenario():
        comm = await _subscribed(run, cookie)
        resp = await sync_to_async(admin.post)(f"/admin/rlplatform/membership/{membership.pk}/delete/", {"post": "yes"})
        closed = await comm.receive_output(timeout=5)
        await comm.disconnect()
        return resp.status_code, closed

    status, closed = async_to_sync(scenario)()
    assert status == 302  # deleted, back to the list
    assert closed == CLOSED_NOT_FOUND
    assert not Membership.objects.filter(pk=membership.pk).exists()


def test_a_downgraded_member_who_may_still_view_keeps_receiving(
    run, team_a, owner, cookie_for, flush_layer, slow_timer
):
    cookie = cookie_for(owner)

    async def scenario():
        comm = await _subscribed(run, cookie)
        # When the admin is made a viewer (their sockets re-check: a viewer may still watch)
        await sync_to_async(memberships.set_member)(team_a, owner, "viewer")
        seq = await sync_to_async(stream.append)(run.pk, "event", {"kind": "after-downgrade", "payload": {}})
        message = await comm.receive_json_from(timeout=5)
        await comm.disconnect()
        return seq, message

    seq, message = async_to_sync(scenario)()
    assert message == {"seq": seq, "type": "event", "data": {"kind": "after-downgrade", "payload": {}}}
    assert Membership.objects.get(team=team_a, user=owner).role == "viewer"


@pytest.mark.parametrize(
    "change, closed",
    [
        ("membership deleted in the database", CLOSED_NOT_FOUND),
        ("user deactivated", CLOSED_SIGNED_OUT),
        ("user deleted", CLOSED_SIGNED_OUT),
    ],
)
def test_the_timer_closes_a_socket_whose_access_was_lost_outside_the_membership_handler(
    run, team_a, viewer, django_user_model, cookie_for, flush_layer, settings, change, closed
):
    settings.TANDEM_WS_ACCESS_RECHECK_S = 0.2
    cookie = cookie_for(viewer)

    def lose_access():
        # Straight to the database: no membership handler runs, so no message tells the socket.
        if change == "membership deleted in the database":
            Membership.objects.filter(team=team_a, user=viewer).delete()
        elif change == "user deactivated":
            django_user_model.objects.filter(pk=viewer.pk).update(is_active=False)
        else:
            django_user_model.objects.filter(pk=viewer.pk).delete()

    async def scenario():
        comm = await _subscribed(run, cookie)
        await sync_to_async(lose_access)()
        message = await comm.receive_output(timeout=5)  # the next re-check closes it
        await sync_to_async(stream.append)(run.pk, "event", {"kind": "after", "payload": {}})
        quiet = await comm.receive_nothing(timeout=0.3)
        await comm.disconnect()
        return message, quiet

    message, quiet = async_to_sync(scenario)()
    assert message == closed
    assert quiet


def test_a_removed_members_runs_list_socket_is_closed_with_4404_and_hears_no_more_changes(
    run, team_a, owner, viewer, cookie_for, flush_layer, slow_timer
):
    cookie = cookie_for(viewer)

    async def scenario():
        comm = communicator("/ws/runs/", cookie)
        connected, _ = await comm.connect()
        snapshot = [await comm.receive_json_from(timeout=5) for _ in range(2)]  # the run, then the group's usage
        await sync_to_async(memberships.remove_member)(team_a, viewer, actor=owner)
        closed = await comm.receive_output(timeout=5)
        await sync_to_async(handler.transition)(run, RunState.PAUSED)  # a change of the lost team's run
        quiet = await comm.receive_nothing(timeout=0.3)
        await comm.disconnect()
        return connected, snapshot, closed, quiet

    connected, snapshot, closed, quiet = async_to_sync(scenario)()
    assert connected
    assert [m["type"] for m in snapshot] == ["run", "cluster"]
    assert snapshot[0]["data"]["id"] == run.pk
    assert closed == CLOSED_NOT_FOUND
    assert quiet
