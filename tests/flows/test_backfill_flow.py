"""Backfill onto a new model: every user re-encoded for its fingerprint, bounded by the
global concurrency limit, one user's failure isolated and tabled, a rerun resumes."""

from __future__ import annotations

import pytest

from prefect_env import artifacts_with_key, table_rows, task_runs_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def new_model(tmp_path_factory, inferscale_home):
    """Another real checkpoint (a 2-layer Llama, random weights, SmolLM2's tokenizer)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from inferscale.models import resolve_checkpoint

    tok = AutoTokenizer.from_pretrained(resolve_checkpoint("embedded", inferscale_home))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=8192, tie_word_embeddings=True))
    path = tmp_path_factory.mktemp("new-model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _intervals(flow_run_id, prefixes):
    out = {}
    for r in task_runs_of(flow_run_id):
        if r.name.startswith(prefixes) and r.start_time and r.end_time:
            out.setdefault(r.name.rsplit("-", 1)[1], []).append((r.start_time, r.end_time))
    return out


def test_backfill_isolates_failures_and_resumes(flow_env, tmp_path, new_model):
    from prefect import get_client

    from flows.backfill import backfill_model
    from inferscale.artifacts.layout import StoreConfig
    from inferscale.artifacts.lineage_view import artifact_key, fingerprint_slug
    from inferscale.artifacts.read import list_versions, verify_version
    from inferscale.models import checkpoint_fingerprint
    from tasks.user import COMPUTE_LIMIT

    root = tmp_path / "artifacts"
    store = StoreConfig(str(root))
    fp = checkpoint_fingerprint(new_model)
    # a damaged store for tomas: a file where his folder should be
    (root / "users").mkdir(parents=True)
    (root / "users" / "tomas").write_text("not a folder")

    state = backfill_model(model=new_model, artifact_root=str(root), fact_mode="raw",
                           max_workers=2, concurrency_limit=1, return_state=True)
    assert state.is_failed() and "tomas" in state.message
    report = state.result(raise_on_failure=False).report  # flows.results.UsersFailed
    assert report["model_fingerprint"] == fp
    assert report["users"]["maya"]["status"] == "published"
    assert report["users"]["tomas"]["status"] == "failed"
    assert "NotADirectoryError" in report["users"]["tomas"]["error"]
    assert verify_version(store, "maya", fp).version == report["users"]["maya"]["version"]
    # the table of done and failed users
    key = f"inferscale-backfill-{fingerprint_slug(fp)}"
    rows = {r["user"]: r for r in table_rows(artifacts_with_key(key)[-1])}
    assert rows["maya"]["status"] == "published" and rows["tomas"]["status"] == "failed"
    assert "NotADirectoryError" in rows["tomas"]["error"]
    # the compute steps ran one user at a time (limit 1, two threads)
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name(COMPUTE_LIMIT).limit == 1
    spans = _intervals(state.state_details.flow_run_id, ("extract-facts", "encode-kv"))
    assert set(spans) == {"maya", "tomas"}
    for a0, a1 in spans["maya"]:
        for b0, b1 in spans["tomas"]:
            assert a1 <= b0 or b1 <= a0, "compute of two users overlapped"

    # repaired store, rerun: maya is skipped (already published for this model), tomas done
    (root / "users" / "tomas").unlink()
    again = backfill_model(model=new_model, artifact_root=str(root), fact_mode="raw",
                           concurrency_limit=2, return_state=True)
    assert again.is_completed(), again.message
    users = again.result()["users"]
    assert users["maya"]["status"] == "up-to-date"
    assert users["maya"]["version"] == report["users"]["maya"]["version"]
    assert users["tomas"]["status"] == "published"
    names = {r.name for r in task_runs_of(again.state_details.flow_run_id)}
    assert "encode-user-maya" not in names and "encode-user-tomas" in names
    for user in ("maya", "tomas"):
        assert [v.version for v in list_versions(store, user, fp)] == [users[user]["version"]]
        assert artifact_key(user, fp) == users[user]["artifact_key"]
    rows = {r["user"]: r for r in table_rows(artifacts_with_key(key)[-1])}
    assert rows["maya"]["status"] == "up-to-date" and rows["tomas"]["status"] == "published"
    assert len(artifacts_with_key(key)) == 2
