"""The ZeRO partition (jobspec/shard_layout.py) that the sharded optimizer and resharding both use."""
from jobspec.shard_layout import LAYOUT_KEY, ShardLayout, state_key


def test_every_element_is_owned_by_exactly_one_rank_in_model_order():
    sizes = (7, 1, 300, 13, 64)
    for dp in (1, 2, 3, 4):
        shards = ShardLayout(sizes, dp, bucket_bytes=4 * 50)
        seen = []
        for k, (lo, hi) in enumerate(shards.buckets):
            assert hi - lo <= 50 and shards.chunks[k] * dp >= hi - lo > shards.chunks[k] * (dp - 1)
            for r in range(dp):
                a, b = shards.owned(k, r)
                assert b - a <= shards.chunks[k]
                seen += [(i, j) for i, x, y in shards.pieces(a, b) for j in range(x, y)]
        assert seen == [(i, j) for i, n in enumerate(sizes) for j in range(n)]
        assert shards.meta(dp - 1) == [dp, dp - 1, sum(sizes), len(shards.buckets)]


def test_the_state_keys_are_the_checkpoints():
    assert (LAYOUT_KEY, state_key("m", 3)) == ("shard.layout", "shard.m.3")
