"""Layout checks and group membership (pure Python, no workers)."""
import pytest

from finetune.dist import check_world, dp_group_ranks, group_name, init_distributed, tp_group_ranks
from jobspec.layout import Layout, LayoutRequest, decide, world_problems


def _decide(tp: int, dp: int, world: int, overlap: bool = True) -> Layout:
    return decide(LayoutRequest(world=world, device="cpu", tp=tp, dp=dp, overlap_grad_reduce=overlap, seq_len=8))


def test_the_layout_is_derived_once_and_the_worker_only_checks():
    assert _decide(2, 0, 8).dp == 4
    assert _decide(2, 2, 4).dp == 2
    # the gradient reduction overlaps the backward only where there is a DP reduction
    assert [_decide(2, 0, w).overlap_grad_reduce for w in (2, 4)] == [False, True]
    assert _decide(1, 0, 4, overlap=False).overlap_grad_reduce is False
    assert "TP=2 x DP=4 x PP=1 = 8 != world 4" in world_problems(2, 4, 1, 4)[0].message
    assert "TP x PP = 3 does not divide the 4 worker(s)" in world_problems(3, 0, 1, 4)[0].message
    check_world(8, Layout(tp=2, dp=4))
    with pytest.raises(ValueError, match=r"made for 8 worker\(s\) on cpu \(TP 2 x DP 4 x PP 1\), this job has 4.*plan"):
        check_world(4, Layout(tp=2, dp=4))


def test_tp_groups_are_contiguous_and_dp_groups_share_the_tp_rank():
    # world 8 = tp 2 x dp 4: TP pairs (0,1) (2,3) ...; DP groups: even ranks, odd ranks
    assert [tp_group_ranks(r, 2) for r in (0, 1, 5)] == [[0, 1], [0, 1], [4, 5]]
    assert dp_group_ranks(5, 2, 4) == [1, 3, 5, 7] and dp_group_ranks(2, 2, 4) == [0, 2, 4, 6]
    assert group_name("tp", [2, 3]) == "tp-2-3"
    every = sorted(r for g in {tuple(dp_group_ranks(r, 4, 2)) for r in range(8)} for r in g)
    assert every == list(range(8))


def test_single_process_needs_no_collectives_and_refuses_a_split(monkeypatch):
    monkeypatch.delenv("MS_ROLE", raising=False)
    rank = init_distributed(Layout())
    assert (rank.world_size, rank.tp, rank.dp, rank.dp_group, rank.is_main) == (1, 1, 1, None, True)
    with pytest.raises(ValueError, match="made for 2 worker"):
        init_distributed(Layout(tp=2))


def test_parallel_zero_maps_onto_the_sharded_optimizer_and_refuses_what_is_not_built():
    from jobspec.config import ConfigError
    from jobspec.recipe_load import load_recipe

    def layout(over, world=4):
        return load_recipe("tiny-cpu", over).resolved(world, "cpu").decided_layout

    assert [layout({}).zero, layout({}, 1).zero] == [1, 0]  # auto: ZeRO-1 with DP, nothing to shard without
    assert layout({"parallel.zero": "2"}).zero == 2 and layout({"parallel.zero": "2"}).shard_optimizer
    assert layout({"parallel.zero": "1"}).zero == 1 and layout({"parallel.zero": "2"}, 1).zero == 0
    assert layout({"parallel.shard_optimizer": "false"}).zero == 0
    z3 = layout({"parallel.zero": "3"})
    assert z3.zero == 3 and z3.shard_gradients and z3.shard_optimizer and layout({"parallel.zero": "3"}, 1).zero == 0
    # ZeRO-3's layers always reduce during their backward: the layout (and the setup log) says so
    assert layout({"parallel.zero": "3", "parallel.overlap_grad_reduce": "false"}).overlap_grad_reduce
    assert not layout({"parallel.zero": "2", "parallel.overlap_grad_reduce": "false"}).overlap_grad_reduce
    assert not load_recipe("tiny-cpu", {"parallel.zero": "3"}).resolved(4, "cpu").train.compile_layers  # refused
    lora = layout({"parallel.zero": "3", "train.method": "lora"})  # the frozen base sharded too
    assert lora.shard_weights and lora.sharding("lora") == ("optimizer state, gradients and decoder-layer weights "
                                                            "(LoRA: the adapters and the frozen base) sharded over DP "
                                                            "(ZeRO-3)")
    assert layout({"parallel.zero": "2"}).sharding() == "optimizer state and gradients sharded over DP (ZeRO-2)"
    for over, says in (({"parallel.zero": "4"}, "parallel.zero=4: the stages are auto, 1, 2 and 3"),
                       ({"parallel.zero": "3", "train.compile_layers": "true"}, "train.compile_layers=true: not with "
                        "parallel.zero=3"),
                       ({"parallel.zero": "2", "parallel.shard_optimizer": "false"}, "parallel.zero=2: stage 2")):
        with pytest.raises(ConfigError) as e:
            layout(over)
        assert any(says in p for p in e.value.problems), e.value.problems
