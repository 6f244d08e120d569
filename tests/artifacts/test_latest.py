"""LATEST names the publish of the newest inputs; rollbacks; what gives way."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from builders import make_inputs
from inferscale.artifacts.blobs import Location
from inferscale.artifacts.layout import InvalidArtifactInput, latest_bytes
from inferscale.artifacts.publish import publish
from inferscale.artifacts.read import latest_version, verify_version

FP = "fp-test"


def test_latest_follows_the_newest_inputs(store):
    t = datetime(2026, 3, 1, tzinfo=timezone.utc)
    old, new = make_inputs("lena", 2, seed=1), make_inputs("lena", 3, seed=2)
    rn = publish(store, "lena", *new, inputs_at=t + timedelta(hours=1))
    ro = publish(store, "lena", *old, inputs_at=t)  # older inputs, finished later
    assert ro.created and ro.latest == rn.version == latest_version(store, "lena", FP)
    verify_version(store, "lena", FP, ro.version)  # complete all the same
    # the old inputs read again, later (a log reverted): LATEST moves back to them
    back = publish(store, "lena", *old, inputs_at=t + timedelta(hours=2))
    assert (back.version, back.created, back.latest) == (ro.version, False, ro.version)
    # a rollback (the newer inputs read again, later) wins over every earlier publish
    assert publish(store, "lena", *new, inputs_at=t + timedelta(hours=4)).latest == rn.version
    assert publish(store, "lena", *old, inputs_at=t + timedelta(hours=3)).latest == rn.version
    with pytest.raises(InvalidArtifactInput, match="timezone"):
        publish(store, "lena", *old, inputs_at=datetime(2026, 3, 1))
    # a LATEST without a time (older InferScale) or naming a removed version gives way
    loc = Location(store, "lena", FP)
    loc.blobs.replace(loc.latest, (rn.version + "\n").encode())
    assert publish(store, "lena", *old, inputs_at=t).latest == ro.version
    loc.blobs.replace(loc.latest, latest_bytes("f" * 32, t + timedelta(days=9)))
    assert publish(store, "lena", *new, inputs_at=t).latest == rn.version
