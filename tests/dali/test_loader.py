"""DALI batches against torchvision's, on DALI's CPU backend: values, structure, and every image once per epoch."""

import gc
import itertools

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from tests.dali.images import CLASSES, PER_CLASS, indices_of, smooth_folder, solid_folder, torchvision

pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed (`pip install 'pipeopt[dali]'`; `make test` "
                    "runs these tests in .venv-vision)")

from pipeopt.apply.handover import LoaderFailure  # noqa: E402
from pipeopt.apply.sample_cache import CachedDataset, dali_reads, plan  # noqa: E402
from pipeopt.apply.sample_store import SampleStore  # noqa: E402
from pipeopt.dali import DaliLoader, loader_from, translate  # noqa: E402

T = torchvision.transforms
v2 = torchvision.transforms.v2
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
N = len(CLASSES) * PER_CLASS

#: How close DALI's pixels come to torchvision's for Resize(int) + CenterCrop, in [0, 1] pixel units (docs/dali.md
#: explains the sources: the long side of Resize(int), which torchvision truncates to whole pixels while DALI keeps
#: the exact scale; the crop anchor when the margin is odd; JPEG decoding itself matches on the CPU).
MEAN_TOLERANCE = 0.01
P99_TOLERANCE = 0.06


@pytest.fixture(scope="module")
def smooth(tmp_path_factory):
    return smooth_folder(tmp_path_factory.mktemp("smooth"))


@pytest.fixture(scope="module")
def solid(tmp_path_factory):
    return solid_folder(tmp_path_factory.mktemp("solid"))


def pixel_differences(loader):
    """|torchvision - DALI| per pixel over one epoch, in [0, 1] units, after checking structure and labels."""
    diffs = []
    dali = loader_from(loader, device="cpu")
    assert len(dali) == len(loader)
    for (theirs, their_labels), (ours, our_labels) in zip(loader, dali, strict=True):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype == torch.float32
        assert our_labels.dtype == torch.int64 and torch.equal(our_labels, their_labels)
        diffs.append((ours - theirs).abs() * torch.tensor(STD).view(1, 3, 1, 1))  # undo Normalize's division
    return torch.cat(diffs).flatten()


@pytest.mark.parametrize("api", ["v1", "v2"])
def test_a_deterministic_chain_matches_torchvision_within_the_documented_tolerance(smooth, api):
    chain = (T.Compose([T.Resize(64), T.CenterCrop(56), T.ToTensor(), T.Normalize(MEAN, STD)]) if api == "v1" else
             v2.Compose([v2.ToImage(), v2.Resize(64), v2.CenterCrop(56), v2.ToDtype(torch.float32, scale=True),
                         v2.Normalize(MEAN, STD)]))
    d = pixel_differences(DataLoader(torchvision.datasets.ImageFolder(smooth, transform=chain), batch_size=5))
    assert d.mean() < MEAN_TOLERANCE
    assert d.quantile(0.99) < P99_TOLERANCE


def test_decoding_and_a_fixed_resize_match_to_a_level(smooth):
    """Without the two rounding sources, DALI's CPU decoder and resampling are torchvision's within 2 levels of 255
    (PIL's and DALI's filters round their fixed-point arithmetic differently), and mostly equal."""
    loader = DataLoader(torchvision.datasets.ImageFolder(smooth, transform=T.Compose([T.Resize((48, 64)),
                                                                                      T.ToTensor()])), batch_size=8)
    for (theirs, _), (ours, _) in zip(loader, loader_from(loader, device="cpu"), strict=True):
        d = (ours - theirs).abs()
        assert d.max() <= 2.5 / 255 and d.mean() <= 0.5 / 255


def test_random_chains_give_the_right_shapes_dtypes_ranges_and_labels(solid):
    chain = T.Compose([T.RandomResizedCrop((24, 32)), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])
    dataset = torchvision.datasets.ImageFolder(solid, transform=chain)
    lo = (0 - torch.tensor(MEAN)) / torch.tensor(STD)
    hi = (1 - torch.tensor(MEAN)) / torch.tensor(STD)
    for images, labels in loader_from(DataLoader(dataset, batch_size=7, shuffle=True), device="cpu"):
        assert images.shape[1:] == (3, 24, 32) and images.dtype == torch.float32
        per_channel = images.transpose(0, 1).flatten(1)
        assert (per_channel.min(1).values >= lo - 1e-5).all() and (per_channel.max(1).values <= hi + 1e-5).all()
        assert labels.dtype == torch.int64
        # solid colours: the crop keeps the colour, which names the image and so its class
        raw = images * torch.tensor(STD).view(1, 3, 1, 1) + torch.tensor(MEAN).view(1, 3, 1, 1)
        assert labels.tolist() == [dataset.samples[i][1] for i in indices_of(raw)]
    uint8 = loader_from(torchvision.datasets.ImageFolder(solid, transform=v2.Compose([
        v2.ToImage(), v2.RandomResizedCrop(16), v2.RandomHorizontalFlip()])), batch_size=4)
    images, _ = next(iter(uint8))
    assert images.dtype == torch.uint8 and images.shape == (4, 3, 16, 16)


def epoch_indices(loader):
    return [i for images, _ in loader for i in indices_of(images)]


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_image_once_per_epoch_in_the_samplers_order(solid, drop_last):
    dataset = torchvision.datasets.ImageFolder(solid, transform=T.Compose([T.Resize((8, 8)), T.ToTensor()]))
    torch.manual_seed(3)
    reference = DataLoader(dataset, batch_size=5, shuffle=True, drop_last=drop_last)
    dali = loader_from(reference, device="cpu")
    assert len(dali) == len(reference) == (N // 5 if drop_last else -(-N // 5))
    epochs = [epoch_indices(dali) for _ in range(3)]
    for seen in epochs:
        assert len(seen) == len(set(seen)) == (N // 5 * 5 if drop_last else N)
    assert epochs[0] != epochs[1]  # reshuffled each epoch
    torch.manual_seed(3)
    theirs = [epoch_indices(reference) for _ in range(2)]
    torch.manual_seed(3)
    assert [epoch_indices(dali) for _ in range(2)] == theirs  # the same sampler and RNG draws: the same order


def test_an_epoch_stopped_early_does_not_spoil_the_next(solid):
    """The pitfall of a DALI reader under Lightning: the sanity check or limit_train_batches stops an epoch."""
    dataset = torchvision.datasets.ImageFolder(solid, transform=T.Compose([T.Resize((8, 8)), T.ToTensor()]))
    dali = loader_from(dataset, batch_size=4, shuffle=False)
    first = iter(dali)
    partial = list(itertools.islice(first, 2))
    assert [indices_of(images) for images, _ in partial] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert epoch_indices(dali) == list(range(N))
    assert next(first, None) is None  # the abandoned epoch's iterator stopped when the next one began
    images, _ = next(iter(dali))  # an iterator dropped at once, its prefetched batches never taken
    assert indices_of(images) == [0, 1, 2, 3]
    assert epoch_indices(dali) == list(range(N))


class Collecting(torch.utils.data.Dataset):
    """Runs the garbage collector in the worker, as any allocation-heavy dataset eventually does."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        gc.collect()
        return torch.zeros(1)


def test_workers_forked_after_a_dali_pipeline_do_not_hang(solid):
    """A worker inherits the pipeline object without its threads; freeing it there used to wait forever (seen when
    a DALI trial was reverted to DataLoader workers)."""
    dataset = torchvision.datasets.ImageFolder(solid, transform=T.Compose([T.Resize((8, 8)), T.ToTensor()]))
    gc.disable()  # keep the used pipeline as collectable garbage until the worker's collector finds it
    try:
        cycle = {"dali": loader_from(dataset, batch_size=4)}
        cycle["self"] = cycle  # garbage only the collector frees, as a user's or Lightning's object graph can be
        next(iter(cycle["dali"]))
        del cycle
        batches = list(DataLoader(Collecting(), batch_size=2, num_workers=1, timeout=20))
    finally:
        gc.enable()
    assert len(batches) == 2


def test_shards_are_disjoint_and_cover_the_epoch(solid):
    dataset = torchvision.datasets.ImageFolder(solid, transform=T.Compose([T.Resize((8, 8)), T.ToTensor()]))
    shards = [loader_from(dataset, batch_size=3, shuffle=True, seed=7, num_shards=3, shard_id=k) for k in range(3)]
    for epoch in range(2):
        for shard in shards:
            shard.sampler.set_epoch(epoch)  # as Lightning does every epoch
        seen = [epoch_indices(shard) for shard in shards]
        assert sorted(i for part in seen for i in part) == list(range(N))
        assert all(len(part) == N // 3 and len(shard) == -(-N // 3 // 3) for part, shard in zip(seen, shards))


def test_fed_from_the_sample_cache_every_image_once_in_the_samplers_order_with_its_label(solid, tmp_path):
    """DALI fed the images pipeopt's sample cache holds, decoded and resized already: the batches the sampler asks
    for, in its order, with their labels; a miss is made and stored on the way, and the next epoch reads the store."""
    dataset = torchvision.datasets.ImageFolder(solid, transform=T.Compose([
        T.Resize((20, 20)), T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToTensor()]))
    split = plan(dataset)
    store = SampleStore(tmp_path / "store", len(split), 1 << 24)
    cached = CachedDataset(split, store, read=True)
    batches = list(BatchSampler(RandomSampler(range(N), generator=torch.Generator().manual_seed(3)), 5, False))
    dali = DaliLoader(translate(dataset), batches, images=cached.image, decoded=dali_reads(split))
    for _ in range(2):
        got = list(dali)
        assert [indices_of(images) for images, _ in got] == batches
        assert all(images.shape[1:] == (3, 16, 16) and images.dtype == torch.float32 for images, _ in got)
        assert [labels.tolist() for _, labels in got] == [[dataset.samples[i][1] for i in b] for b in batches]
        assert store.stats().made == N  # each made once, in the first epoch
    with pytest.raises(ValueError, match="decoded images are fed to DALI's CPU backend only"):
        DaliLoader(translate(dataset), batches, device="mixed", images=cached.image)
    del dali, got
    store.remove()


def test_bad_arguments_and_broken_files_are_explained(solid, tmp_path):
    dataset = torchvision.datasets.ImageFolder(solid, transform=T.Compose([T.Resize((8, 8)), T.ToTensor()]))
    with pytest.raises(ValueError, match="these come from the DataLoader"):
        loader_from(DataLoader(dataset, batch_size=4), batch_size=8)
    with pytest.raises(ValueError, match="a dataset needs batch_size"):
        loader_from(dataset)
    with pytest.raises(ValueError, match="0 <= shard_id < num_shards"):
        loader_from(dataset, batch_size=4, num_shards=2, shard_id=2)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees none here. Use device='cpu'"):
            DaliLoader(translate(dataset), [[0]], device="mixed")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    broken = torchvision.datasets.ImageFolder(tmp_path, transform=T.Compose([T.Resize((8, 8)), T.ToTensor()]))
    with pytest.raises(LoaderFailure, match="the DALI pipeline failed"):
        next(iter(loader_from(broken, batch_size=1)))
