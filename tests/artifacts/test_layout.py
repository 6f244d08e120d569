"""Where artifacts live: user-id folder names, the store config (local, S3) and its settings."""

from __future__ import annotations

import os

import pytest

from inferscale.artifacts.layout import (
    InvalidStoreConfig, InvalidUserId, StoreConfig, user_dirname,
)
from inferscale.types import InvalidUserIdError


@pytest.mark.parametrize("user", [
    "alice", "bob.smith_2-x", "Alice", "名前", "émile", "x" * 100, "x" * 101, "é" * 60,
    "é" * 61, "u" * 128, "~home", "_b32", "__hash", "con", "o'brien", "a@b.c",
])
def test_user_dirnames_stay_in_their_folder(user):
    name = user_dirname(user)
    assert "/" not in name and "\\" not in name and "\x00" not in name
    assert not name.startswith(".") and name not in ("", ".", "..")
    assert len(name.encode()) <= 200
    assert name == name.lower() or name == user  # case-insensitive filesystems are safe


def test_user_dirnames_do_not_collide():
    users = ["alice", "Alice", "ALICE", "_alice", "a_b", "a-b", "é" * 61, "é" * 62, "x" * 101]
    assert len({user_dirname(u) for u in users}) == len(users)


@pytest.mark.parametrize("user", ["", "a\x00b", "\ud800", "u" * 129, None, 7, "../../etc",
                                  "..", ".", "a/b", "a\\b", "/abs", " space", "a\nb",
                                  "ann smith"])
def test_ids_outside_the_user_id_rule_name_no_folder(user):
    with pytest.raises(InvalidUserId) as err:
        user_dirname(user)
    assert isinstance(err.value, InvalidUserIdError)  # the one rule's error


def test_store_config():
    s = StoreConfig("relative/dir")
    assert os.path.isabs(s.root) and s.is_local and s.protocol == "file"
    assert StoreConfig("file:///tmp/x/").root == "/tmp/x"
    s3 = StoreConfig("s3://bucket/prefix/", {"key": "k", "secret": "s", "client_kwargs": {
        "endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"}})
    assert s3.root == "s3://bucket/prefix" and not s3.is_local
    assert s3.lance_storage_options() == {
        "endpoint": "http://127.0.0.1:9000", "allow_http": "true", "region": "eu-west-1",
        "aws_access_key_id": "k", "aws_secret_access_key": "s"}
    for bad in ("", "   ", "nosuchproto://x", "s3://"):
        with pytest.raises(InvalidStoreConfig):
            StoreConfig(bad)


def test_store_config_from_settings(monkeypatch, tmp_path):
    from inferscale.settings import Settings

    monkeypatch.setenv("INFERSCALE_ARTIFACT_ROOT", "s3://b/p")
    monkeypatch.setenv("INFERSCALE_S3_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("INFERSCALE_S3_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("INFERSCALE_S3_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("INFERSCALE_S3_REGION", "us-east-1")
    s = StoreConfig.from_settings(Settings(_env_file=None))
    assert s.root == "s3://b/p"
    assert s.storage_options == {"key": "k", "secret": "s", "client_kwargs": {
        "endpoint_url": "http://127.0.0.1:9000", "region_name": "us-east-1"}}
    monkeypatch.delenv("INFERSCALE_ARTIFACT_ROOT")
    monkeypatch.setenv("INFERSCALE_HOME", str(tmp_path))
    assert StoreConfig.from_settings(Settings(_env_file=None)).root == str(tmp_path / "artifacts")
