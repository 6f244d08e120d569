"""The event-loop lag probe (``inferscale.serve.loop_lag``): a loop held by a blocking
callback shows as one long sample, an idle one as short ones; the server's histogram
(``inferscale_event_loop_lag_seconds``) is fed by a probe the first request starts."""

from __future__ import annotations

import asyncio
import time

import pytest

from inferscale.serve.loop_lag import LoopLagProbe


def test_a_held_loop_shows_as_one_long_sample():
    samples: list[float] = []

    async def main():
        probe = LoopLagProbe(samples.append, interval_s=0.005)
        probe.start()
        probe.start()  # a no-op while it runs
        await asyncio.sleep(0.1)
        idle = len(samples)
        time.sleep(0.25)  # holds the loop, as work on it or a thread holding the GIL does
        await asyncio.sleep(0.05)
        probe.stop()
        await asyncio.sleep(0.02)
        assert not probe.running
        return idle

    idle = asyncio.run(main())
    assert idle >= 3 and len(samples) > idle
    assert max(samples) >= 0.2  # the stall, less at most one interval
    assert sorted(samples)[len(samples) // 2] < 0.05  # most wake-ups are on time
    assert min(samples) >= 0.0
    n = len(samples)
    time.sleep(0.03)
    assert len(samples) == n  # stopped


def test_a_probe_follows_its_server_to_a_new_loop():
    samples: list[float] = []
    probe = LoopLagProbe(samples.append, interval_s=0.002)

    async def run_a_while():
        probe.start()
        await asyncio.sleep(0.03)
        return probe.running

    assert asyncio.run(run_a_while())
    first = len(samples)
    assert not probe.running  # its loop closed (asyncio.run cancels what is left)
    assert asyncio.run(run_a_while()) and len(samples) > first
    probe.stop()  # its loop has closed: nothing to cancel, no error
    with pytest.raises(ValueError):
        LoopLagProbe(samples.append, interval_s=0)


def test_the_servers_histogram_counts_the_probes_samples():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from inferscale.serve.metrics import ServingMetrics

    metrics = ServingMetrics()

    async def main():
        metrics.loop_probe.start()
        await asyncio.sleep(0.05)
        time.sleep(0.12)
        await asyncio.sleep(0.03)
        metrics.loop_probe.stop()

    asyncio.run(main())
    text = generate_latest(metrics.registry).decode()
    samples = {(s.name, s.labels.get("le")): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name.startswith("inferscale_event_loop_lag_seconds")}
    count = samples[("inferscale_event_loop_lag_seconds_count", None)]
    assert count >= 3
    # the held 120 ms: above 100 ms (less one 10 ms interval at most), below 250 ms
    assert samples[("inferscale_event_loop_lag_seconds_bucket", "0.1")] < count
    assert samples[("inferscale_event_loop_lag_seconds_sum", None)] >= 0.1
