"""Who may use whose memory: every combination of API keys, the trusted user header and
its gateway secret, loopback or not; admin access; constant-time comparisons."""

from __future__ import annotations

import hmac

import pytest

from inferscale.serve.access import (
    GATEWAY_SECRET_HEADER, AccessPolicy, DuplicateHeader, ServeError, is_loopback,
)

KEYS = {"key-ann": "ann", "key-bob": "bob"}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def user_for(policy: AccessPolicy, headers: dict[str, str], body_user: str | None):
    """Whose memory a request uses, as the app decides it."""
    return policy.identify(headers).resolve(body_user)


def test_beyond_loopback_without_keys_refuses_to_start():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("0.0.0.0")
    with pytest.raises(ServeError, match="API_KEYS"):
        AccessPolicy({}, "admin", None, loopback=False)
    with pytest.raises(ServeError, match="ADMIN_KEY"):
        AccessPolicy(KEYS, None, None, loopback=False)
    AccessPolicy(KEYS, "admin", None, loopback=False)  # keys: fine


def test_keys_only_decide_the_user():
    policy = AccessPolicy(KEYS, "admin", None, loopback=False)
    assert user_for(policy, bearer("key-ann"), None) == "ann"
    assert user_for(policy, bearer("key-ann"), "ann") == "ann"
    with pytest.raises(PermissionError, match="another user"):
        user_for(policy, bearer("key-ann"), "bob")
    for headers in (bearer("nope"), bearer("key-ann-x"), bearer("é")):
        with pytest.raises(PermissionError, match="^unknown API key"):
            user_for(policy, headers, "ann")
    # no key at all is told apart from a wrong one
    for headers in ({}, bearer(""), {"authorization": "Basic a2V5LWFubg=="}):
        with pytest.raises(PermissionError, match="^missing API key"):
            user_for(policy, headers, "ann")


def test_header_only_on_loopback_needs_no_secret():
    policy = AccessPolicy({}, None, "X-User", loopback=True)
    assert user_for(policy, {"x-user": "bob"}, None) == "bob"
    assert user_for(policy, {"x-user": "bob"}, "bob") == "bob"
    with pytest.raises(PermissionError, match="another user"):
        user_for(policy, {"x-user": "bob"}, "ann")  # the body cannot borrow ann's memory
    with pytest.raises(PermissionError, match="X-User"):
        user_for(policy, {}, "bob")


def test_header_beyond_loopback_without_secret_refuses_to_start():
    with pytest.raises(ServeError, match="GATEWAY_SECRET"):
        AccessPolicy({}, "admin", "X-User", loopback=False)
    with pytest.raises(ServeError, match="GATEWAY_SECRET"):
        AccessPolicy(KEYS, "admin", "X-User", loopback=False)
    with pytest.raises(ServeError, match="TRUSTED_USER_HEADER"):
        AccessPolicy({}, "admin", None, loopback=True, gateway_secret="s3cret")
    AccessPolicy({}, "admin", "X-User", loopback=False, gateway_secret="s3cret")


def test_wrong_or_missing_gateway_secret_is_refused():
    policy = AccessPolicy({}, "admin", "X-User", loopback=False, gateway_secret="s3cret")
    assert user_for(policy, {"x-user": "ann", GATEWAY_SECRET_HEADER: "s3cret"}, None) == "ann"
    for secret in (None, "", "s3cre", "s3cret ", "S3CRET", "sécret"):
        headers = {"x-user": "ann"}
        if secret is not None:
            headers[GATEWAY_SECRET_HEADER] = secret
        with pytest.raises(PermissionError, match="gateway secret"):
            user_for(policy, headers, None)
    # the secret is needed on loopback too once it is configured
    local = AccessPolicy({}, None, "X-User", loopback=True, gateway_secret="s3cret")
    with pytest.raises(PermissionError, match="gateway secret"):
        user_for(local, {"x-user": "ann"}, None)


def test_header_and_keys_the_key_is_always_checked():
    policy = AccessPolicy(KEYS, "admin", "X-User", loopback=True)
    with pytest.raises(PermissionError, match="missing API key"):
        user_for(policy, {"x-user": "ann"}, None)  # no key: the header alone gets nothing
    with pytest.raises(PermissionError, match="unknown API key"):
        user_for(policy, {"x-user": "ann", **bearer("nope")}, None)
    with pytest.raises(PermissionError, match="another user than the API key"):
        user_for(policy, {"x-user": "bob", **bearer("key-ann")}, None)  # key-ann + X-User: bob
    assert user_for(policy, {"x-user": "ann", **bearer("key-ann")}, None) == "ann"
    assert user_for(policy, bearer("key-ann"), None) == "ann"
    remote = AccessPolicy(KEYS, "admin", "X-User", loopback=False, gateway_secret="s3cret")
    with pytest.raises(PermissionError, match="gateway secret"):
        user_for(remote, {"x-user": "ann", **bearer("key-ann")}, None)
    assert user_for(remote, {"x-user": "ann", GATEWAY_SECRET_HEADER: "s3cret",
                            **bearer("key-ann")}, None) == "ann"


def test_a_request_for_nobodys_memory_needs_the_same_credentials():
    """``GET /v1/models``: a known key when keys are set, the gateway secret when one is,
    open otherwise; never a user."""
    keys = AccessPolicy(KEYS, "admin", None, loopback=True)
    keys.check_client(bearer("key-bob"))
    with pytest.raises(PermissionError, match="^missing API key"):
        keys.check_client({})
    with pytest.raises(PermissionError, match="^unknown API key"):
        keys.check_client(bearer("nope"))
    gateway = AccessPolicy({}, "admin", "X-User", loopback=False, gateway_secret="s3cret")
    gateway.check_client({GATEWAY_SECRET_HEADER: "s3cret"})  # no X-User needed
    with pytest.raises(PermissionError, match="gateway secret"):
        gateway.check_client({"x-user": "ann"})
    AccessPolicy({}, None, None, loopback=True).check_client({})
    AccessPolicy({}, None, "X-User", loopback=True).check_client({})


def test_malformed_user_ids_are_refused():
    from inferscale.types import InvalidUserIdError

    header = AccessPolicy({}, None, "X-User", loopback=True)
    with pytest.raises(InvalidUserIdError):
        user_for(header, {"x-user": "bob\n"}, None)
    body = AccessPolicy({}, None, None, loopback=True)
    with pytest.raises(InvalidUserIdError):
        user_for(body, {}, "\u202ebob")
    with pytest.raises(ServeError, match="API_KEYS"):
        AccessPolicy({"k": "bob\n"}, "admin", None, loopback=False)
    with pytest.raises(ServeError, match="empty key"):
        AccessPolicy({"": "bob"}, "admin", None, loopback=False)


def test_loopback_without_keys_trusts_the_body():
    policy = AccessPolicy({}, None, None, loopback=True)
    assert user_for(policy, {}, "ann") == "ann"
    assert user_for(policy, {}, None) is None
    policy.check_admin({})  # admin open on loopback only


def test_admin_key():
    policy = AccessPolicy(KEYS, "admin", None, loopback=False)
    policy.check_admin(bearer("admin"))
    for headers in ({}, bearer("key-ann"), bearer("admi"), bearer("admin2"), bearer("ädmin")):
        with pytest.raises(PermissionError, match="admin key"):
            policy.check_admin(headers)


def test_keys_and_admin_key_are_compared_in_constant_time(monkeypatch):
    """Every API key and the admin key go through ``hmac.compare_digest`` (no ``==``
    whose time depends on the common prefix)."""
    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a, b):
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    policy = AccessPolicy(KEYS, "admin", None, loopback=False)
    assert user_for(policy, bearer("key-bob"), None) == "bob"
    assert {b for _, b in seen} == {b"key-ann", b"key-bob"}  # every key compared
    seen.clear()
    policy.check_admin(bearer("admin"))
    assert seen == [(b"admin", b"admin")]


def test_api_keys_without_an_admin_key_refuse_to_start_on_loopback_too():
    """With API keys the operator wants every caller authenticated: admin endpoints open
    to anything on the host (a reverse proxy in front of a loopback server) would hand
    out the user list. Keys without an admin key do not start, wherever they bind."""
    for loopback in (True, False):
        with pytest.raises(ServeError, match="ADMIN_KEY"):
            AccessPolicy(KEYS, None, None, loopback=loopback)
        with pytest.raises(ServeError, match="ADMIN_KEY"):
            AccessPolicy(KEYS, None, "X-User", loopback=loopback, gateway_secret="s3cret")
    keyed = AccessPolicy(KEYS, "admin", None, loopback=True)
    with pytest.raises(PermissionError, match="admin key"):
        keyed.check_admin({})  # on loopback too
    AccessPolicy({}, None, None, loopback=True).check_admin({})  # no keys: open on loopback


def test_a_repeated_identity_header_is_refused():
    """Two Authorization, trusted-header or gateway-secret headers: which one a proxy or
    the server reads is a guess, so the request is refused (whatever the values)."""
    policy = AccessPolicy(KEYS, "admin", "X-User", loopback=True, gateway_secret="s3cret")
    good = [("authorization", "Bearer key-ann"), ("x-user", "ann"),
            (GATEWAY_SECRET_HEADER, "s3cret")]
    assert policy.single_headers(good + [("x-other", "1"), ("x-other", "2")]) == {
        **dict(good), "x-other": "2"}
    for name, value in good:
        for extra in (value, "bob", ""):
            with pytest.raises(DuplicateHeader, match=f"(?i){name}"):
                policy.single_headers([*good, (name.upper(), extra)])


def test_only_an_api_key_authenticates_its_user():
    """An API key's user is ``authenticated`` (a closed set: never shed under load); a
    user named by a gateway's header or by the body on loopback is not."""
    keys = AccessPolicy(KEYS, "admin", "X-User", loopback=True)
    assert keys.identify({"x-user": "ann", **bearer("key-ann")}).authenticated
    header = AccessPolicy({}, "admin", "X-User", loopback=False, gateway_secret="s3cret")
    assert not header.identify({"x-user": "ann", GATEWAY_SECRET_HEADER: "s3cret"}).authenticated
    assert not AccessPolicy({}, None, None, loopback=True).identify({}).authenticated
