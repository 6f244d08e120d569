"""The test S3 server's credentials (moto accepts any) and the fsspec options that reach
it (``conftest.py`` starts it; tests that build their own stores use :func:`s3_options`)."""

from __future__ import annotations

S3_KEY = "testing"
S3_SECRET = "testing"
S3_REGION = "us-east-1"


def s3_options(endpoint: str) -> dict:
    return {"key": S3_KEY, "secret": S3_SECRET,
            "client_kwargs": {"endpoint_url": endpoint, "region_name": S3_REGION}}
