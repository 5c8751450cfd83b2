"""Translating torchvision image datasets and transform chains into DALI recipes, or refusing with the reason."""

import pytest
import torch
from torch.utils.data import Subset, TensorDataset

from pipeopt.dali.recipe import CenterCrop, RandomResizedCrop, ResizeShorter, ResizeTo, Untranslatable, translate
from tests.dali.images import smooth_folder, torchvision

T = torchvision.transforms
v2 = torchvision.transforms.v2
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return smooth_folder(tmp_path_factory.mktemp("images"), per_class=2)


def folder(root, transform, **kwargs):
    return torchvision.datasets.ImageFolder(root, transform=transform, **kwargs)


def test_the_usual_train_chain_v1(root):
    chain = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])
    ds = folder(root, chain)
    recipe = translate(ds)
    assert recipe.samples == tuple((path, label) for path, label in ds.samples)
    assert recipe.geometry == (RandomResizedCrop(224, 224, (0.08, 1.0), (3 / 4, 4 / 3), "linear"),)
    assert recipe.flip == 0.5 and recipe.dtype == "float32" and recipe.scale == pytest.approx(1 / 255)
    assert recipe.mean == pytest.approx(tuple(MEAN)) and recipe.std == pytest.approx(tuple(STD))


def test_the_usual_eval_chain_v2(root):
    chain = v2.Compose([v2.ToImage(), v2.Resize(256, interpolation=v2.InterpolationMode.BICUBIC), v2.CenterCrop(224),
                        v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])
    recipe = translate(folder(root, chain))
    assert recipe.geometry == (ResizeShorter(256, None, "cubic"), CenterCrop(224, 224))
    assert recipe.flip == 0 and recipe.dtype == "float32" and recipe.scale == pytest.approx(1 / 255)


def test_uint8_output_and_a_fixed_resize(root):
    recipe = translate(folder(root, T.Compose([T.Resize((32, 48)), T.PILToTensor()])))
    assert recipe.geometry == (ResizeTo(32, 48, "linear"),)
    assert recipe.dtype == "uint8" and recipe.scale == 1.0 and recipe.mean is None
    unscaled = translate(folder(root, v2.Compose([v2.ToImage(), v2.CenterCrop(20), v2.ToDtype(torch.float32)])))
    assert unscaled.dtype == "float32" and unscaled.scale == 1.0  # ToDtype without scale keeps 0..255


def test_subsets_pick_and_order_the_samples(root):
    base = folder(root, T.Compose([T.CenterCrop(16), T.ToTensor()]))
    inner = Subset(base, [5, 0, 3, 1])
    recipe = translate(Subset(inner, [2, 0]))
    assert recipe.samples == (tuple(base.samples[3]), tuple(base.samples[5]))


class Reversed:
    def __call__(self, x):
        return x


class MyFolder(torchvision.datasets.ImageFolder):
    def __getitem__(self, index):
        return super().__getitem__(len(self) - 1 - index)


def custom_loader(path):
    return torchvision.datasets.folder.default_loader(path)


@pytest.mark.parametrize(("make", "reason"), [
    (lambda r: folder(r, T.Compose([T.RandomResizedCrop(32), T.ColorJitter(0.4), T.ToTensor()])),
     "the transform ColorJitter has no DALI translation"),
    (lambda r: folder(r, T.Compose([T.CenterCrop(32), Reversed(), T.ToTensor()])),
     "the transform Reversed is not a torchvision transform"),
    (lambda r: folder(r, T.Compose([T.CenterCrop(32), T.ToTensor()]), target_transform=lambda y: y + 1),
     "the dataset has a target_transform"),
    (lambda r: folder(r, T.Compose([T.CenterCrop(32), T.ToTensor()]), loader=custom_loader),
     "custom loader (custom_loader)"),
    (lambda r: MyFolder(r, transform=T.Compose([T.CenterCrop(32), T.ToTensor()])), "MyFolder overrides __getitem__"),
    (lambda r: TensorDataset(torch.zeros(4, 3)), "the dataset is a TensorDataset, not a torchvision ImageFolder"),
    (lambda r: folder(r, T.Compose([T.Resize(32), T.ToTensor()])), "does not end in a fixed size"),
    (lambda r: folder(r, T.Compose([T.CenterCrop(32)])), "ends with a PIL image"),
    (lambda r: folder(r, None), "no transform"),
    (lambda r: folder(r, v2.Compose([v2.ToImage(), v2.CenterCrop(8), v2.Normalize(MEAN, STD)])),
     "Normalize before the image is a float tensor"),
    (lambda r: folder(r, T.Compose([T.CenterCrop(8), T.ToTensor(), T.Normalize(MEAN, STD), T.RandomHorizontalFlip()])),
     "RandomHorizontalFlip after Normalize"),
    (lambda r: folder(r, T.Compose([T.Resize((8, 8), interpolation=T.InterpolationMode.LANCZOS), T.ToTensor()])),
     "interpolation=lanczos"),
])
def test_what_cannot_be_rebuilt_is_refused_with_the_reason(root, make, reason):
    with pytest.raises(Untranslatable) as info:
        translate(make(root))
    assert reason in str(info.value)


def test_a_custom_collate_and_an_undecodable_file_are_refused(root, tmp_path):
    ds = folder(root, T.Compose([T.CenterCrop(8), T.ToTensor()]))
    with pytest.raises(Untranslatable, match="collate_fn"):
        translate(ds, collate_fn=lambda batch: batch)
    (tmp_path / "a").mkdir()
    torchvision.transforms.functional.to_pil_image(torch.zeros(3, 4, 4)).save(tmp_path / "a" / "x.gif")
    with pytest.raises(Untranslatable, match=r"x\.gif: DALI's image decoder does not read \.gif"):
        translate(torchvision.datasets.DatasetFolder(tmp_path, torchvision.datasets.folder.default_loader, (".gif",),
                                                     transform=T.Compose([T.CenterCrop(8), T.ToTensor()])))
