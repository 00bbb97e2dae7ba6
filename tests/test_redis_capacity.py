"""The pure parts of bench.redis_capacity against a real redis-server: reading its counters,
telling script calls and key slots apart in MONITOR, redis-benchmark's CSV, and the fits."""

from __future__ import annotations

import pytest
import redis

from bench import redis_capacity
from tests.procs import start_redis

SET_IN_A_SCRIPT = "return redis.call('SET', KEYS[1], ARGV[1])"


@pytest.fixture(scope="module")
def client():
    proc = start_redis()  # its own: the test resets its statistics and watches every command
    try:
        yield redis.Redis.from_url(proc.url)
    finally:
        proc.stop()


def test_command_stats_count_script_calls_on_their_own_lines(client):
    sha = client.script_load(SET_IN_A_SCRIPT)
    client.config_resetstat()
    client.set("llmfleet:run:{r1}", "x")
    client.evalsha(sha, 1, "llmfleet:run:{r2}", "y")
    raw = client.info("commandstats")
    stats = redis_capacity.command_stats(raw)
    assert stats["set"][0] == 2 and stats["evalsha"][0] == 1
    assert "config|resetstat" not in stats and "info" not in stats
    # The time is Redis's own figure, read from its line (the set's includes the script's set).
    assert stats["evalsha"][1] == raw["cmdstat_evalsha"]["usec"] and stats["set"][1] == raw["cmdstat_set"]["usec"]


def test_counters_and_monitor_tell_senders_scripts_and_slots(client, tmp_path):
    sha = client.script_load(SET_IN_A_SCRIPT)

    def load():
        client.client_setname("gateway-test")
        client.set("llmfleet:run:{r1}", "x", ex=60)
        client.evalsha(sha, 1, "llmfleet:requests:{m}", "y")
        client.xadd("llmfleet:replies:{g}", {"e": "z"})
        client.publish("llmfleet:cancel", "c")
        return 1, 0, None

    counts, returned = redis_capacity.monitor_sample(client, load, roles=True)
    assert returned == (1, 0, None)
    assert counts["top:set"] == 1 and counts["lua:set"] == 1 and counts["top:evalsha"] == 1
    assert counts["slot:request"] == 1 and counts["slot:model"] == 1
    assert counts["slot:gateway"] == 1 and counts["slot:broadcast"] == 1
    assert counts["role:gateway:xadd"] == 1 and counts["role:gateway:publish"] == 1
    window = redis_capacity.measure(client, {}, load)
    assert window.requests == 1 and window.counters["calls:set"] == 2 and window.counters["net_in"] > 0

    def busy_load():  # 20,000 commands: Redis's own rusage must see them
        client.eval("for i = 1, 20000 do redis.call('SET', KEYS[1], i) end", 1, "llmfleet:run:{r3}")
        return 1, 0, None

    assert redis_capacity.measure(client, {}, busy_load).counters["cpu_us:redis_rusage"] > 0


def test_benchmark_csv(client):
    port = client.connection_pool.connection_kwargs["port"]
    ops = redis_capacity.redis_benchmark(port, ["SET", "k", "v"], 2000, 4, 1)
    assert ops > 0
    assert client.get("k") == b"v"


def test_fits_recover_known_costs():
    a, b, w = 40.0, 0.5, 90.0
    cost = {16: a + b * 16, 256: a + b * 256}
    fitted = redis_capacity.fit({"cpu": cost[16]}, {"cpu": cost[256]}, 16, 256)
    assert fitted["cpu"] == pytest.approx((a, b))
    streams = [{"tokens": t, "top": {"xadd": n}, "per_request": {"cpu": a + w * n + b * t}}
               for t, n in ((16, 0.1), (256, 0.5), (256, 15.0))]
    assert redis_capacity.fit_writes(streams, ["cpu"])["cpu"] == pytest.approx((a, w, b))
