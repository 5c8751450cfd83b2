"""Loader and batch tuning under DDP: 2 CPU ranks (gloo), each fit run as a separate process
(see scripts/ddp_fit.py)."""

from pathlib import Path

from tests.helpers import run_ddp

SCRIPT = Path(__file__).parent / "scripts" / "ddp_fit.py"


def run(out: Path, mode: str) -> list[dict]:
    return run_ddp(SCRIPT, out, mode)


def test_both_ranks_apply_the_same_settings_and_see_what_they_would_have(tmp_path):
    plain = run(tmp_path, "plain")
    tuned = run(tmp_path, "pipeopt")
    for rank in (0, 1):  # the DistributedSampler's shard, in its order, epoch after epoch
        assert tuned[rank]["seen"] == plain[rank]["seen"]
    assert tuned[0]["trials"] == tuned[1]["trials"] and len(tuned[0]["trials"]) >= 2
    assert not any("ended before loader tuning finished" in n for n in tuned[0]["notes"]), tuned[0]["notes"]
    assert tuned[0]["changes"] == tuned[1]["changes"] and tuned[0]["changes"]  # the script's world: workers win
    kept = dict(tuned[0]["changes"])
    for rank in (0, 1):  # applied on both ranks
        assert (tuned[rank]["num_workers"], tuned[rank]["persistent_workers"]) == (
            kept["num_workers"], kept.get("persistent_workers", False))
    assert len(list((tmp_path / "reports").glob("*.json"))) == 1  # written once, by rank zero


def test_both_ranks_run_the_same_batch_plan_with_the_users_effective_batch(tmp_path):
    plain = run(tmp_path, "plain")
    tuned = run(tmp_path, "batch")
    for rank in (0, 1):  # each rank's shard, in its order, re-cut into micro-batches of 4
        assert tuned[rank]["seen"] == plain[rank]["seen"]  # every sample once, in order: nothing probed or repeated
        assert tuned[rank]["accumulate"] == 2 and tuned[rank]["samples_per_step"] == plain[rank]["samples_per_step"]
    assert set(plain[0]["samples_per_step"]) == {8}
    assert ["batch_size", 4] in tuned[0]["changes"] and tuned[0]["changes"] == tuned[1]["changes"]


def test_the_ranks_of_a_node_fill_one_store_and_both_keep_the_cache(tmp_path):
    plain = run(tmp_path, "plain")
    tuned = run(tmp_path, "cache")
    for rank in (0, 1):
        assert tuned[rank]["seen"] == plain[rank]["seen"]  # the DistributedSampler's shard, in its order
        assert tuned[rank]["changes"] == [["cache", True]], tuned[rank]["notes"]
        cache = tuned[rank]["cache"]
        # each rank stored what its sampler gave it (its shard changes every epoch): together the whole data set,
        # less at most the one batch each rank's own loader had in flight when the filling loader took over
        assert 768 - 2 * 8 <= cache["stored"] <= 768 and cache["kept"], cache
        assert cache["last_hit_rate"] == 1.0
    assert tuned[0]["cache"]["directory"] == tuned[1]["cache"]["directory"]  # one store for the node
