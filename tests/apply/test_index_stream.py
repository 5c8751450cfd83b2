import torch

from pipeopt.apply.index_stream import IndexStream, ResumingSampler, draw_seed, peek_seed


def test_each_batch_once_and_undelivered_ones_again_first():
    stream = IndexStream([[0, 1], [2, 3], [4, 5], [6, 7]])
    assert next(stream) == [0, 1]
    stream.delivered()
    assert next(stream) == [2, 3] and next(stream) == [4, 5]
    assert stream.in_flight == 2
    assert stream.recover() == 2  # a loader died holding both
    assert list(stream) == [[2, 3], [4, 5], [6, 7]]


def test_resuming_sampler_finishes_the_epoch_then_is_the_users():
    calls = []
    sampler = ResumingSampler([[9], [8]], first=iter([[1], [2]]), before_epoch=lambda: calls.append("draw"))
    started = iter(sampler)  # DataLoader iterators call iter() and throw the result away: nothing may happen
    del started
    assert list(iter(sampler)) == [[1], [2]] and calls == []
    assert list(iter(sampler)) == [[9], [8]] and calls == ["draw"]
    assert len(sampler) == 2


def test_peek_does_not_advance_and_draw_matches_dataloader_draws():
    torch.manual_seed(5)
    g = torch.Generator().manual_seed(11)
    for gen in (None, g):
        peeked = peek_seed(gen)
        assert peeked == peek_seed(gen)
        assert draw_seed(gen) == peeked
        assert draw_seed(gen) != peeked


def test_a_stream_read_ahead_hands_out_the_same_batches_and_knows_what_is_still_to_come():
    batches = [[0, 1], [2, 3], [4, 5], [6, 7]]
    lazy, read = IndexStream(iter(batches)), IndexStream(iter(batches), read_ahead=True)
    assert lazy.ahead() is None  # a source not read ahead: what is to come is not known
    assert read.ahead() == list(range(8))
    assert next(read) == [0, 1]
    read.delivered()
    assert next(read) == [2, 3] and read.ahead() == [2, 3, 4, 5, 6, 7]  # dispatched, not delivered: still ahead
    assert read.recover() == 1 and read.ahead() == [2, 3, 4, 5, 6, 7]
    assert list(read) == [[2, 3], [4, 5], [6, 7]] and list(lazy) == batches
    assert read.ahead() == [2, 3, 4, 5, 6, 7]  # handed out, none delivered yet
    for _ in range(3):
        read.delivered()
    assert read.ahead() == []


def test_a_generator_is_read_ahead_only_once_its_first_index_was_drawn():
    """A sampler's generator draws its seed with its first index: read before that, it would draw it early."""
    drawn = []

    def sampler():
        drawn.append("seed")
        yield from ([0, 1], [2, 3], [4, 5])

    stream = IndexStream(sampler(), read_ahead=True)
    assert stream.ahead() is None and drawn == []  # not yet: nothing drawn, nothing known
    assert next(stream) == [0, 1] and drawn == ["seed"]
    assert stream.ahead() == [0, 1, 2, 3, 4, 5] and list(stream) == [[2, 3], [4, 5]]
