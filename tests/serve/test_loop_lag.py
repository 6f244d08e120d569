"""The event-loop lag probe (``inferscale.serve.loop_lag``): a loop held by a blocking
callback shows as one long sample, an idle one as short ones; the server's histogram
(``inferscale_event_loop_lag_seconds``) is fed by a probe the first request starts."""

from __future__ import annotations

import asyncio
import gc
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


def test_a_stall_is_reported_once_with_the_loops_stack():
    """The watchdog thread sees a loop that has not woken for ``stall_s`` and hands over
    the loop thread's stack, naming the function that holds it, once per stall."""
    stalls: list[tuple[float, str]] = []

    def holds_the_loop_for_a_while():
        time.sleep(0.3)

    async def main():
        probe = LoopLagProbe(lambda _: None, interval_s=0.005, stall_s=0.05,
                             on_stall=lambda s, stack: stalls.append((s, stack)))
        probe.start()
        await asyncio.sleep(0.1)
        assert not stalls  # an idle loop wakes on time
        holds_the_loop_for_a_while()
        await asyncio.sleep(0.1)
        probe.stop()

    asyncio.run(main())
    assert len(stalls) == 1
    held, stack = stalls[0]
    assert 0.05 <= held < 0.3 and "holds_the_loop_for_a_while" in stack


def test_every_stall_is_counted_once_whether_the_watchdog_saw_it_or_not():
    """Stalls just over ``stall_s``: the watchdog (looking every ``stall_s / 4``) sees some
    and hands over their stacks; the probe reports the others when the loop wakes. Each
    once."""
    stalls: list[tuple[float, str]] = []
    lags: list[float] = []

    async def main():
        probe = LoopLagProbe(lags.append, interval_s=0.005, stall_s=0.05,
                             on_stall=lambda s, stack: stalls.append((s, stack)))
        probe.start()
        for _ in range(10):
            await asyncio.sleep(0.03)
            time.sleep(0.06)  # holds the loop
        await asyncio.sleep(0.03)
        probe.stop()

    asyncio.run(main())
    # one report per sample of a stall (a loaded machine may add a stall of its own)
    assert len(stalls) == sum(lag >= 0.05 for lag in lags) >= 10
    assert all(held >= 0.05 for held, _ in stalls)


def test_a_stall_the_watchdog_never_saw_is_reported_by_the_probe():
    stalls: list[tuple[float, str]] = []
    lags: list[float] = []

    async def main():
        probe = LoopLagProbe(lags.append, interval_s=0.005, stall_s=0.05,
                             on_stall=lambda s, stack: stalls.append((s, stack)))
        probe._watchdog = lambda stopped: None  # a watchdog kept out (a thread in C)
        probe.start()
        await asyncio.sleep(0.05)
        for _ in range(3):
            time.sleep(0.08)
            await asyncio.sleep(0.02)
        probe.stop()

    asyncio.run(main())
    assert len(stalls) == sum(lag >= 0.05 for lag in lags) >= 3
    assert all(stack == "" for _, stack in stalls)
    assert sum(held >= 0.07 for held, _ in stalls) >= 3  # 80 ms less the probe's own 5


def test_long_garbage_collections_are_reported():
    """``gc.callbacks`` time every collection; one of ``stall_s`` or more is reported
    with its generation, a short one is not, and a stopped probe stops listening."""
    import gc

    pauses: list[tuple[float, int]] = []
    probe = LoopLagProbe(lambda _: None, stall_s=0.02, on_gc=lambda s, g: pauses.append((s, g)))

    async def main():
        probe.start()
        gc.collect(0)  # quick
        probe._gc("start", {"generation": 2})  # a collection that takes 30 ms
        time.sleep(0.03)
        probe._gc("stop", {"generation": 2})
        probe.stop()

    asyncio.run(main())
    assert [g for _, g in pauses] == [2] and pauses[0][0] >= 0.02
    assert probe._gc not in gc.callbacks
    with pytest.raises(ValueError):
        LoopLagProbe(lambda _: None, interval_s=0.01, stall_s=0.005)


def test_a_probe_whose_loop_ended_unstopped_reports_nothing_more():
    """A server's loop that closed without ``stop()`` (tests, a crashed server): its
    watchdog exits and its collector callback stays silent, rather than report a stall
    that was only the loop's end."""
    import gc

    events: list = []
    probe = LoopLagProbe(lambda _: None, interval_s=0.005, stall_s=0.02,
                         on_stall=lambda *a: events.append(a), on_gc=lambda *a: events.append(a))

    async def main():
        probe.start()
        await asyncio.sleep(0.05)

    asyncio.run(main())  # cancels the probe's task; stop() never called
    time.sleep(0.1)
    probe._gc("start", {"generation": 2})
    time.sleep(0.03)
    probe._gc("stop", {"generation": 2})
    assert events == []
    probe.stop()
    assert probe._gc not in gc.callbacks


def test_a_probe_whose_loop_stopped_with_its_task_pending_reports_nothing():
    """A loop that stops without cancelling the probe's task (a server thread's loop at
    interpreter exit): the task stays pending, yet the probe is not running and its
    collector callback stays silent (it used to log each exit-time collection into
    closed streams)."""
    events: list = []
    probe = LoopLagProbe(lambda _: None, interval_s=0.005, stall_s=0.02,
                         on_stall=lambda *a: events.append(a), on_gc=lambda *a: events.append(a))
    loop = asyncio.new_event_loop()

    async def main():
        probe.start()
        await asyncio.sleep(0.03)
        return probe.running

    try:
        assert loop.run_until_complete(main())
        assert probe._task is not None and not probe._task.done()  # pending, loop stopped
        assert not probe.running
        probe._gc("start", {"generation": 2})
        time.sleep(0.03)
        probe._gc("stop", {"generation": 2})
        time.sleep(0.03)  # the watchdog's turn too
        assert events == []
    finally:
        probe.stop()
        loop.close()
    assert probe._gc not in gc.callbacks


def test_the_servers_stall_counters_start_at_zero_and_count():
    """``/metrics`` exports both counters from the start (a load row tells 0 from a
    server without them), and the probe's reports move them."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from inferscale.serve.metrics import ServingMetrics

    def samples(m: ServingMetrics) -> dict[tuple[str, str], float]:
        text = generate_latest(m.registry).decode()
        return {(s.name, s.labels.get("generation", "")): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name in ("inferscale_event_loop_stalls_total", "inferscale_gc_pauses_total")}

    m = ServingMetrics()
    assert samples(m) == {("inferscale_event_loop_stalls_total", ""): 0.0,
                          **{("inferscale_gc_pauses_total", g): 0.0 for g in "012"}}
    m._stalled(0.2, "stack")
    m._gc_paused(0.15, 2)
    got = samples(m)
    assert got[("inferscale_event_loop_stalls_total", "")] == 1.0
    assert got[("inferscale_gc_pauses_total", "2")] == 1.0
    assert got[("inferscale_gc_pauses_total", "0")] == 0.0
