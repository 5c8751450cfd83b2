"""The sample cache on torchvision ImageFolders (v1 and v2 transforms): only the deterministic prefix is cached, as
uint8 images (a chain with nothing random in it: whole), and a fit with random augmentation trains to the same
weights, bit for bit, with the cache as without it.
Runs where torchvision is installed (``make test``'s .venv-vision); elsewhere skipped with the reason."""

from __future__ import annotations

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Subset, default_collate

from pipeopt import _dataloader
from pipeopt._torchvision import flatten as flat
from pipeopt.apply import sample_store
from pipeopt.apply.sample_cache import CachedDataset, FolderSplit, dali_reads, plan, refusal
from tests.dali.images import Classifier, smooth_folder, torchvision
from tests.helpers import controlled_rates, controlled_wait, quiet_pipeopt, quiet_trainer_kwargs, synchronous_backfill

T = torchvision.transforms
V2 = pytest.importorskip("torchvision.transforms.v2")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return smooth_folder(tmp_path_factory.mktemp("smooth"), per_class=12)


def _names(steps):
    return [type(t).__name__ for t in steps]


@pytest.mark.parametrize("chain, cached, rest", [
    (lambda: T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.ToTensor()]),
     [], ["RandomResizedCrop", "RandomHorizontalFlip", "ToTensor"]),
    (lambda: T.Compose([T.Resize(40), T.CenterCrop(32), T.RandomHorizontalFlip(), T.ToTensor(),
                        T.Normalize((0.5,) * 3, (0.2,) * 3)]),
     ["Resize", "CenterCrop"], ["RandomHorizontalFlip", "ToTensor", "Normalize"]),
    (lambda: V2.Compose([V2.ToImage(), V2.Resize(40), V2.CenterCrop(32), V2.RandomVerticalFlip(),
                         V2.ToDtype(torch.float32, scale=True)]),
     ["ToImage", "Resize", "CenterCrop"], ["RandomVerticalFlip", "ToDtype"]),
    (lambda: V2.Compose([V2.Resize(40), V2.RandomResizedCrop(32), V2.Resize(16), V2.ToImage()]),
     ["Resize"], ["RandomResizedCrop", "Resize", "ToImage"]),
])
def test_the_cut_is_the_deterministic_prefix_before_the_pixels_become_floats(images, chain, cached, rest):
    split = plan(torchvision.datasets.ImageFolder(images, transform=chain()))
    assert isinstance(split, FolderSplit)
    assert _names(split.cached) == cached and _names(split.rest) == rest
    assert refusal(split)[0] is None
    stored = split.make(0)
    assert not (isinstance(stored, torch.Tensor) and stored.is_floating_point())  # uint8 pixels are stored


@pytest.mark.parametrize("chain", [
    lambda: T.Compose([T.Resize(40), T.CenterCrop(32), T.ToTensor(), T.Normalize((0.5,) * 3, (0.2,) * 3)]),
    lambda: V2.Compose([V2.ToImage(), V2.Resize(40), V2.CenterCrop(32), V2.ToDtype(torch.float32, scale=True)]),
])
def test_a_chain_with_nothing_random_is_cached_whole(images, tmp_path, chain):
    """A validation chain: the store holds the images as the model sees them - nothing is left to do per sample."""
    labels = Relabel()
    dataset = torchvision.datasets.ImageFolder(images, transform=chain(), target_transform=labels)
    split = plan(dataset)
    assert isinstance(split, FolderSplit) and split.rest == [] and len(split.cached) == len(flat(dataset.transform))
    assert "as the model sees it" in split.describe()
    from pipeopt.apply.sample_cache import CachedDataset

    store = sample_store.SampleStore(tmp_path / "s", len(split), 1 << 24)
    cached = CachedDataset(split, store, read=True)
    for i in range(len(dataset)):
        cached[i]  # fill
    for i in range(len(dataset)):
        image, label = cached[i]
        assert image.dtype == torch.float32 and torch.equal(image, dataset[i][0]) and label == dataset[i][1]
    # a batch at a time (torchvision's v2 Image tensors, a subclass, item by item): torch's own batch, bit for bit
    # each batch's labels made by the target_transform once an item, as without the store
    reader = CachedDataset(split, store, read=True, rows=True)
    for positions in (list(range(len(dataset)))[::-1], [3, 0, 7, 3]):
        calls = labels.calls
        batch = _dataloader.collate_rows(reader.__getitems__(positions))
        assert labels.calls == calls + len(positions)
        expected = default_collate([dataset[i] for i in positions])
        assert all(type(a) is type(b) and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(batch, expected))


def test_a_whole_batch_takes_its_labels_from_the_folder_as_torch_collates_them(images, tmp_path):
    """A cached validation chain of a Subset, no target_transform: a batch read a batch at a time (or, with a
    negative index, item by item) is torch's own batch of the subset's items, bit for bit, labels included, and so
    are its items; an index out of range fails as the subset's own indexing does."""
    chain = T.Compose([T.Resize(40), T.CenterCrop(32), T.ToTensor(), T.Normalize((0.5,) * 3, (0.2,) * 3)])
    subset = Subset(torchvision.datasets.ImageFolder(images, transform=chain), [17, 3, 30, 8, 25, 0, 12])
    split = plan(subset)
    assert isinstance(split, FolderSplit) and split.whole
    store = sample_store.SampleStore(tmp_path / "s", len(split), 1 << 24)
    for i in range(len(subset)):
        CachedDataset(split, store, read=True)[i]  # fill
    reader = CachedDataset(split, store, read=True, rows=True)
    for positions in ([6, 0, 2], [1, -1, 4, 1], [5, 3, 6, 2]):  # the first read finds the layout, the others keep to it
        items = reader.__getitems__(positions)
        assert isinstance(items, _dataloader.Collated) or min(positions) < 0  # rows of one tensor, not one by one
        batch, expected = _dataloader.collate_rows(items), default_collate([subset[i] for i in positions])
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(batch, expected))
        assert [(torch.equal(x, subset[i][0]), y) for (x, y), i in zip(items, positions)] == [
            (True, subset[i][1]) for i in positions]
    with pytest.raises(IndexError):
        reader.__getitems__([0, len(subset)])
    assert not reader.broken


class Relabel:
    """A target_transform that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, target: int) -> int:
        self.calls += 1
        return 100 + target


def test_items_rebuilt_from_the_store_equal_the_datasets_under_the_same_seed(images, tmp_path):
    dataset = torchvision.datasets.ImageFolder(images, transform=T.Compose([
        T.Resize(48), T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize((0.5,) * 3,
                                                                                                   (0.2,) * 3)]))
    subset = Subset(dataset, list(range(5, 30)))
    split = plan(subset)
    store = sample_store.SampleStore(tmp_path / "s", len(split), 1 << 24)
    from pipeopt.apply.sample_cache import CachedDataset

    cached = CachedDataset(split, store, read=True)
    for i in range(len(subset)):
        cached[i]  # fill
    for i in range(len(subset)):
        torch.manual_seed(i)
        want = subset[i]
        torch.manual_seed(i)
        got = cached[i]
        assert torch.equal(want[0], got[0]) and want[1] == got[1]
    assert store.stats().stored == len(subset)


def test_a_pil_image_is_stored_as_its_pixels_and_comes_back_equal_in_every_mode(images):
    from PIL import Image

    image = torchvision.datasets.folder.default_loader(str(next(images.rglob("*.jpg"))))
    assert type(image) is Image.Image and image.info  # the JPEG's info, as the user's loader gives it
    for mode in ("RGB", "L", "RGBA", "P", "1", "CMYK"):
        original = image.convert(mode)
        record = sample_store.encode(original)
        back = sample_store.decode(bytearray(record))
        assert (back.mode, back.size, back.info) == (original.mode, original.size, original.info)
        assert back.tobytes() == original.tobytes() and back.getpalette() == original.getpalette()
        array = sample_store.image_array(record)  # DALI's feed: RGB pixels over the record's bytes
        if mode == "RGB":
            assert array.shape == (image.height, image.width, 3) and (array == np.asarray(original)).all()
            assert not array.flags.writeable  # a view of the record: the store is never written through it
        else:
            assert array is None
    assert sample_store.image_array(sample_store.encode(torch.zeros(3, 4, 5, dtype=torch.uint8))) is None
    assert sample_store.image_array(sample_store.encode((image, 1))) is None


@pytest.mark.parametrize("chain, steps", [
    (lambda: T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.ToTensor()]), 0),
    (lambda: T.Compose([T.Resize(40), T.CenterCrop(36), T.RandomResizedCrop(32), T.ToTensor()]), 2),
    (lambda: V2.Compose([V2.Resize(40), V2.RandomResizedCrop(32), V2.ToImage()]), 1),
    (lambda: V2.Compose([V2.ToImage(), V2.Resize(40), V2.RandomResizedCrop(32)]), None),  # tensors stored
    (lambda: T.Compose([T.Resize(40), T.CenterCrop(32), T.ToTensor()]), None),  # whole: floats stored
])
def test_dali_is_fed_the_store_only_where_it_holds_pil_images_a_random_step_still_to_come(images, chain, steps):
    assert dali_reads(plan(torchvision.datasets.ImageFolder(images, transform=chain()))) == steps


def test_the_image_dali_is_fed_is_read_from_the_store_or_made_and_stored(images, tmp_path):
    dataset = torchvision.datasets.ImageFolder(images, transform=T.Compose([
        T.Resize(40), T.RandomResizedCrop(32), T.ToTensor()]))
    split = plan(dataset)
    store = sample_store.SampleStore(tmp_path / "s", len(split), 1 << 24)
    cached = CachedDataset(split, store, read=True)
    made = np.asarray(split.make(3))
    first = cached.image(3)  # a miss: made, stored
    assert store.has(3) and store.stats().made == 1 and (first == made).all()
    again = cached.image(3)  # a hit: the stored pixels, not made again
    assert store.stats().made == 1 and (again == made).all() and not again.flags.writeable
    del again
    odd = CachedDataset(FolderSplit(_NotImages(), None, [], split.rest), store, read=True)
    with pytest.raises(TypeError, match="not a PIL image"):
        odd.image(0)
    store.remove()  # nothing of the views is alive: the maps close


class _NotImages:
    """A folder whose loader gives arrays (a custom ``loader=``)."""

    samples = [("x", 0)]
    target_transform = None

    def __len__(self):
        return 1

    def loader(self, path):
        return np.zeros((4, 4, 3), dtype=np.uint8)


def fit(callbacks, root, *, workers, epochs=5):
    pl.seed_everything(11, verbose=False)
    model = Classifier()
    dataset = torchvision.datasets.ImageFolder(root, transform=T.Compose([
        T.RandomResizedCrop(16, scale=(0.3, 1.0)), T.RandomHorizontalFlip(), T.ToTensor(),
        T.Normalize((0.5,) * 3, (0.25,) * 3)]))
    trainer = pl.Trainer(max_epochs=epochs, callbacks=callbacks, **quiet_trainer_kwargs())
    trainer.fit(model, DataLoader(dataset, batch_size=4, shuffle=True, num_workers=workers,
                                  persistent_workers=workers > 0))
    return model


def _same_weights(a, b):
    for name, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[name]), name


def _cached_faster(monkeypatch):
    """Reading from the store measures 3x, and every window waits half its step for data: an input-bound run
    however busy the machine is (two workers decoding these small images can leave a busy machine's loop almost
    never waiting, and a compute-bound run's cache is not tried)."""
    controlled_rates(monkeypatch, lambda settings: 300.0 if getattr(settings, "cache", False) else 100.0)
    controlled_wait(monkeypatch, 0.5)


def test_random_augmentation_in_the_main_process_trains_bit_identically_to_a_run_without_pipeopt(
        images, monkeypatch, tmp_path):
    plain = fit([], images, workers=0)
    _cached_faster(monkeypatch)
    callback = quiet_pipeopt(tune=("cache",), report_dir=tmp_path, cache=False)
    tuned = fit([callback], images, workers=0)
    assert [c.knob for c in callback.report.changes] == ["cache"]
    assert callback.report.sample_cache.epochs[-1]["hit_rate"] == 1.0
    _same_weights(plain, tuned)


def test_random_augmentation_in_workers_draws_the_same_numbers_with_the_store_read_or_not(images, monkeypatch,
                                                                                          tmp_path):
    _cached_faster(monkeypatch)
    synchronous_backfill(monkeypatch)  # both fits try the cache at the same step, however long its backfill takes
    callback = quiet_pipeopt(tune=("cache",), report_dir=tmp_path / "read", cache=False)
    read = fit([callback], images, workers=2)
    assert callback.report.sample_cache.epochs[-1]["hit_rate"] == 1.0
    # the same fit, the same decisions and switches, but every lookup misses: each image is decoded again
    monkeypatch.setattr(sample_store.SampleStore, "get", lambda self, position: None)
    unread = quiet_pipeopt(tune=("cache",), report_dir=tmp_path / "unread", cache=False)
    made = fit([unread], images, workers=2)
    knobs = [(c.knob, c.after) for c in callback.report.changes]
    assert [(c.knob, c.after) for c in unread.report.changes] == knobs and knobs[0] == ("cache", True), (
        unread.report.notes)
    _same_weights(read, made)


@pytest.mark.parametrize("random_suffix", [False, True], ids=["whole-items", "random-suffix"])
def test_the_worker_search_ends_early_only_for_a_store_of_whole_items(images, monkeypatch, tmp_path, random_suffix):
    """A store holding whole items leaves the workers nothing to do; one with a random transform after it does not,
    so the worker search (DALI included) goes on."""
    controlled_rates(monkeypatch, lambda s: 100.0 * (1 + min(getattr(s, "num_workers", 0), 2))
                     * (3 if getattr(s, "cache", False) else 1))
    controlled_wait(monkeypatch, 0.5)  # input-bound however busy the machine is (not a compute-bound verdict)
    flip = [T.RandomHorizontalFlip()] if random_suffix else []
    dataset = torchvision.datasets.ImageFolder(images, transform=T.Compose([T.Resize(20), T.CenterCrop(16), *flip,
                                                                            T.ToTensor()]))
    callback = quiet_pipeopt(tune=("loader", "cache"), report_dir=tmp_path, cache=False)
    pl.seed_everything(1, verbose=False)
    trainer = pl.Trainer(max_epochs=6, callbacks=[callback], **quiet_trainer_kwargs())
    trainer.fit(Classifier(), DataLoader(dataset, batch_size=2, shuffle=True))
    notes = callback.report.notes
    assert any("sample cache's store holds an epoch" in n for n in notes) is not random_suffix, notes
