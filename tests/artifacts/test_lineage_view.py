"""Lineage presentation: artifact keys, asset keys, the version table."""

from __future__ import annotations

import json
import re

from builders import make_inputs
from inferscale.artifacts.lineage_view import (
    artifact_key, asset_key, fingerprint_slug, location_uri, version_markdown,
    version_of_rows, version_rows,
)
from inferscale.artifacts.publish import publish

KEY = re.compile(r"[a-z0-9-]+")


def test_artifact_keys_are_valid_and_distinct():
    users = ["maya", "Maya", "MAYA", "maya ", "a/b", "a\\b", "日本", "ユーザー", "",
             "x" * 300, "user.name@example.com", "-lead-", "a--b"]
    keys = [artifact_key(u, "B27B4F45006B49355CA7") for u in users]
    assert all(KEY.fullmatch(k) for k in keys), keys
    assert len(set(keys)) == len(users)
    assert artifact_key("maya", "b27b4f45006b49355ca7fe4d0ddba979") == "mem-maya-b27b4f45006b"
    assert all(len(k) < 80 for k in keys)
    assert fingerprint_slug("fp-lineage-test") == "fplineagetes"


def test_asset_keys():
    from prefect.types import ValidAssetKey  # what Prefect validates them with
    from pydantic import TypeAdapter

    check = TypeAdapter(ValidAssetKey).validate_python
    for uri in ["/tmp/a b/logs#1.jsonl", "s3://bucket/logs/day 1.jsonl", "file:///x/y%z",
                "S3://Bucket/k?x=1&y=[2]"]:
        key = asset_key(uri)
        assert check(key) == key
    assert asset_key("s3://bucket/users/maya/fp") == "s3://bucket/users/maya/fp"


def test_version_rows(local_store):
    mem, facts, lineage = make_inputs("maya", 3, seed=1)
    res = publish(local_store, "maya", mem, facts, lineage)
    rows = version_rows(local_store, res.manifest, previous="0" * 32)
    assert version_of_rows(rows) == res.version
    assert version_of_rows(json.dumps(rows)) == res.version
    assert version_of_rows("not json") is None and version_of_rows([{"a": 1}]) is None
    d = {r["field"]: r["value"] for r in rows}
    assert d["parent: log"] == lineage.log_hash and d["parent: facts"] == lineage.facts_hash
    assert d["previous version"] == "0" * 32
    assert d["files"] == location_uri(local_store, "maya", mem.model_fingerprint, res.version)
    assert d["files"].startswith("file://")
    for name, entry in res.manifest.files.items():
        assert str(entry.bytes) in d[name] and entry.xxh3_128 in d[name]
    assert json.loads(d["encoder config"]) == res.manifest.encoder_config
    md = version_markdown(local_store, res.manifest)
    assert res.version in md and "first version" in md


def test_location_uri_s3():
    from inferscale.artifacts.layout import StoreConfig, user_dirname

    store = StoreConfig("s3://bucket/prefix")
    assert location_uri(store, "maya", "fp1") == "s3://bucket/prefix/users/maya/fp1"
    assert location_uri(store, "Zoë", "fp1", "v1") == \
        f"s3://bucket/prefix/users/{user_dirname('Zoë')}/fp1/v1"


HOSTILE = ["**bold** _it_ <script>alert(1)</script>", "[click](javascript:alert(1))",
           "x`y``z` <img src=x onerror=alert(1)>", "![i](http://e/x.png) &amp; # h",
           "line\n# heading\n- item", "| a | b |", "\\*not*"]


def test_version_markdown_escapes_every_value_from_data():
    """User ids, parents, fingerprints, versions and the previous version come from data:
    rendered (CommonMark), none of them makes markup (HTML, links, images, emphasis,
    headings) and each reads back as its own text."""
    from markdown_it import MarkdownIt

    from inferscale.artifacts.layout import StoreConfig
    from storage_schemas.manifest import FileEntry, Manifest

    md = MarkdownIt("commonmark")
    md.validateLink = lambda url: True  # a permissive renderer: file: and javascript: links too
    for store in (StoreConfig("s3://bucket/prefix"), StoreConfig("/tmp/store")):
        for value in HOSTILE:
            # a user id passes the one user-id rule (no whitespace, no slashes), so the
            # hostile ones keep every other character
            user = re.sub(r"[\s/\\]+", "", value)
            m = Manifest(user=user, model_fingerprint=value, version=value,
                         encoder_config={}, parents={"log": value, "facts": value},
                         files={"facts.arrow": FileEntry(1, "0" * 32),
                                "kv.arrow": FileEntry(1, "0" * 32)},
                         counts={}, kv={}, created="2026-01-01T00:00:00+00:00")
            html = md.render(version_markdown(store, m, previous=value))
            for tag in ("<script", "<img", "<em>", "<h1", "<table", "href=\"javascript"):
                assert tag not in html, (value, html)
            assert html.count("<strong>") == 1 and html.count("<a ") == 2, (value, html)
            assert html.count("<ul>") == 1 and html.count("<li>") == 3, (value, html)
            text = re.sub(r"<[^>]+>", "", html)
            import html as html_lib

            plain = html_lib.unescape(text)
            assert value.replace("\n", " ") in plain, (value, plain)
