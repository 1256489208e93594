"""Device placement rules (pure): one host, then one switch, then fewest hosts."""

from jobs.placement import place, take


def test_prefers_the_tightest_single_host():
    free = {1: [10, 11, 12, 13], 2: [20, 21], 3: [30, 31, 32]}
    assert place(2, free, {}) == [20, 21]
    assert place(3, free, {}) == [30, 31, 32]
    assert place(4, free, {}) == [10, 11, 12, 13]


def test_single_switch_beats_fewer_hosts_across_switches():
    free = {1: [10, 11, 12], 2: [20, 21, 22], 3: [30, 31]}
    switches = {1: "sw1", 2: "sw2", 3: "sw2"}
    # Fewest hosts alone would take host 1 + host 2 (two switches); one switch keeps the gang on sw2.
    assert place(5, free, switches) == [20, 21, 22, 30, 31]


def test_falls_back_to_fewest_hosts_when_no_switch_fits():
    free = {1: [10], 2: [20, 21, 22], 3: [30, 31]}
    switches = {1: "sw1", 2: "sw2", 3: "sw3"}
    assert place(5, free, switches) == [20, 21, 22, 30, 31]


def test_hosts_without_switch_label_are_never_grouped():
    free = {1: [10, 11], 2: [20, 21]}
    assert place(3, free, {1: None, 2: None}) == [10, 11, 20]


def test_gang_is_all_or_nothing():
    free = {1: [10, 11], 2: [20]}
    assert place(4, free, {1: "sw", 2: "sw"}) is None
    assert place(3, free, {1: "sw", 2: "sw"}) == [10, 11, 20]


def test_zero_devices_needs_nothing():
    assert place(0, {}, {}) == []


def test_take_removes_the_chosen_devices_from_their_hosts_only():
    free = {1: [10, 11, 12], 2: [20, 21], 3: [30]}
    host_of = {10: 1, 11: 1, 12: 1, 20: 2, 21: 2, 30: 3}
    take(free, host_of, [11, 20, 21])
    assert free == {1: [10, 12], 2: [], 3: [30]}
    assert place(2, free, {}) == [10, 12]  # the next gang sees what is left


def test_a_home_share_stays_on_one_host_and_the_rest_goes_anywhere():
    from jobs.placement import place_with_home

    # place() alone would fill the fullest hosts: 2 + 2 + 1, no host holding the 3 of the trainer
    free = {1: [10, 11], 2: [20, 21, 22], 3: [30, 31]}
    assert place(5, {1: [10, 11], 2: [20, 21], 3: [30]}, {}) == [10, 11, 20, 21, 30]
    assert place_with_home(5, 3, {1: [10, 11], 2: [20, 21], 3: [30]}, {}) is None  # no host holds 3
    chosen = place_with_home(5, 3, free, {})
    assert chosen[:3] == [20, 21, 22] and sorted(chosen[3:]) == [10, 11]
    # when place()'s own choice keeps the share together it stands
    assert place_with_home(4, 2, free, {}) == place(4, free, {})
    # the home share alone (no remote roles): one host or nothing
    assert place_with_home(3, 3, free, {}) == [20, 21, 22]
    assert place_with_home(4, 4, free, {}) is None
    assert place_with_home(0, 0, {}, {}) == []
