"""`--redis-url` for each topology, and the hash tags that keep each operation in one cluster slot."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from redis.crc import key_slot

import llmfleet
from shared import keys
from shared.redis_pool import RedisTarget, parse_url, with_ca_file

pytestmark = pytest.mark.topology


@pytest.mark.parametrize("url, expected", [
    ("redis://127.0.0.1:6379/0", RedisTarget("server", "redis://127.0.0.1:6379/0")),
    ("rediss://:pw@cache.example:6380/2?ssl_ca_certs=/ca.pem",
     RedisTarget("server", "rediss://:pw@cache.example:6380/2?ssl_ca_certs=/ca.pem")),
    ("redis+sentinel://:p%40ss@10.0.0.1:26379,10.0.0.2,[::1]:26380/mymaster/3?sentinel_password=sp",
     RedisTarget("sentinel", "redis+sentinel://:p%40ss@10.0.0.1:26379,10.0.0.2,[::1]:26380/mymaster/3?"
                 "sentinel_password=sp", nodes=(("10.0.0.1", 26379), ("10.0.0.2", 26379), ("::1", 26380)),
                 service_name="mymaster", db=3, password="p@ss", sentinel_password="sp")),
    ("redis+cluster://fleet:pw@n1:7000,n2:7001",
     RedisTarget("cluster", "redis+cluster://fleet:pw@n1:7000,n2:7001", nodes=(("n1", 7000), ("n2", 7001)),
                 username="fleet", password="pw")),
])
def test_each_topology_is_read_from_its_url(url, expected):
    assert parse_url(url) == expected


@pytest.mark.parametrize("url, message", [
    ("http://127.0.0.1:6379", "unsupported Redis URL scheme 'http'"),
    ("127.0.0.1:6379", "unsupported Redis URL scheme"),
    ("redis+sentinel://:secret@h1:26379", "ends in /service_name"),
    ("redis+sentinel://h1:26379/a/b/c", "ends in /service_name"),
    ("redis+sentinel://h1:26379/master?colour=blue", "unknown option(s) colour"),
    ("redis+cluster://h1:7000/1", "only database 0"),
    ("redis+cluster://h1:x", "expected host:port, got 'h1:x'"),
    ("redis+cluster://", "expected host:port"),
])
def test_a_bad_url_says_what_is_wrong_and_hides_the_password(url, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as caught:
        parse_url(url)
    assert "secret" not in str(caught.value)


def test_the_ca_file_joins_a_tls_url_only():
    assert (with_ca_file("rediss://h:6380/0", "/etc/ca dir/ca.pem")
            == "rediss://h:6380/0?ssl_ca_certs=/etc/ca%20dir/ca.pem")
    assert with_ca_file("rediss://h/0?x=1", "/ca.pem") == "rediss://h/0?x=1&ssl_ca_certs=/ca.pem"
    assert with_ca_file("redis://h/0", None) == "redis://h/0"
    with pytest.raises(ValueError, match="needs a rediss:// URL"):
        with_ca_file("redis://h/0", "/ca.pem")
    with pytest.raises(ValueError, match="names a CA file"):
        with_ca_file("rediss://h/0?ssl_ca_certs=/a.pem", "/b.pem")


def test_the_cli_refuses_a_bad_url_before_starting(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("not used")
    runner = CliRunner()
    result = runner.invoke(llmfleet.main, ["gateway", "--redis-url", "redis+cluster://h:7000/2"])
    assert result.exit_code == 2 and "only database 0" in result.output
    result = runner.invoke(llmfleet.main, ["worker", "--model", "m", "--redis-url", "redis://h/0",
                                           "--redis-ca-file", str(ca)])
    assert result.exit_code == 2 and "needs a rediss:// URL" in result.output


ODD_VALUES = ["abc", "a}b", "}abc", "}", "", "{x}", "{", "a{b}c", "ü-model/7b:latest"]


@pytest.mark.parametrize("value", ODD_VALUES)
def test_the_keys_of_each_operation_share_a_slot(value):
    """What Redis Cluster requires of every multi-key command and script llmfleet sends."""
    group = keys.cancel_group("tenant", cancel_id=value)
    operations = {
        "register / cancel by group": [keys.cancel_id_key(group), keys.early_cancel_key(group)],
        "cancel by id: the run's tenant, its stash": [keys.run_key(value), keys.cancelled_key(value)],
        "lease, stash, streamed; their DEL": [keys.lease_key(value), keys.cancelled_key(value),
                                              keys.streamed_key(value)],
        "dead letter, XACK, XDEL": [keys.request_stream(value), keys.dead_letter_stream(value)],
        "MGET of heartbeats": [keys.worker_key(value), keys.worker_key("another-worker")],
    }
    for operation, names in operations.items():
        assert len({key_slot(name.encode()) for name in names}) == 1, (operation, names)


def test_tags_spread_requests_over_slots_and_names_stay_distinct():
    slots = {key_slot(keys.lease_key(f"{n:032x}").encode()) for n in range(200)}
    assert len(slots) > 150  # not one hot slot
    names = [keys.cancel_id_key(keys.cancel_group(tenant, **{kind: value}))
             for value in ODD_VALUES + ["da39a3ee5e6b4b0d}"] for tenant in ("", "a", "b")
             for kind in ("cancel_id", "session_id")]
    assert len(set(names)) == len(names)
