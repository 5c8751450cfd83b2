"""What a torchvision image dataset does, as data DALI can rebuild - or the exact reason it cannot.

``translate(dataset, collate_fn)`` reads a torchvision ``ImageFolder`` / ``DatasetFolder`` (or a ``Subset`` of one)
and its transform chain into a ``Recipe``: the files with their labels, the geometric steps in order, a horizontal
flip, and how pixels become the tensor ``training_step`` receives. Nothing here imports torchvision or DALI:
objects are recognised by their class and module, so a refusal can be explained on any machine.

Supported (v1 ``torchvision.transforms`` and v2 ``torchvision.transforms.v2``): ``Compose``, ``RandomResizedCrop``,
``Resize``, ``CenterCrop``, ``RandomHorizontalFlip``, ``ToTensor``, ``PILToTensor`` / ``ToImage``, ``ToDtype`` /
``ConvertImageDtype`` to float32, ``Normalize``. Anything else is refused, naming the transform or property.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeopt._torchvision import flatten, folder_class, is_transform, name, unwrap_subsets

#: File types DALI's image decoder reads (torchvision's default loader reads these through PIL too).
DECODABLE = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".pnm", ".ppm", ".pgm", ".pbm", ".webp",
                       ".jp2"})
#: torchvision interpolation modes DALI has: PIL's bilinear and bicubic filters antialias when they shrink, as
#: DALI's linear and cubic resampling do by default.
INTERPOLATION = {"bilinear": "linear", "nearest": "nn", "bicubic": "cubic"}


class Untranslatable(ValueError):
    """The dataset or transform chain has no DALI equivalent; the message says which part and why."""


@dataclass(frozen=True)
class ResizeShorter:
    """``Resize(int)``: the shorter side to ``size`` (the longer one at most ``max_size``), aspect kept."""

    size: int
    max_size: int | None
    interp: str


@dataclass(frozen=True)
class ResizeTo:
    """``Resize((h, w))``."""

    height: int
    width: int
    interp: str


@dataclass(frozen=True)
class RandomResizedCrop:
    height: int
    width: int
    scale: tuple[float, float]
    ratio: tuple[float, float]
    interp: str


@dataclass(frozen=True)
class CenterCrop:
    height: int
    width: int


Geometry = ResizeShorter | ResizeTo | RandomResizedCrop | CenterCrop


@dataclass(frozen=True)
class Recipe:
    """A torchvision image dataset as DALI will rebuild it. ``samples[i]`` is the dataset's item ``i``."""

    samples: tuple[tuple[str, int], ...]
    geometry: tuple[Geometry, ...]
    flip: float  # probability of a horizontal flip (0: none)
    dtype: str  # "float32" or "uint8"
    scale: float  # multiplies the 0..255 pixel values (1/255 for ToTensor)
    mean: tuple[float, ...] | None  # Normalize, in the units after ``scale``
    std: tuple[float, ...] | None

    @property
    def fixed_size(self) -> bool:
        """Every image comes out the same size (so a batch stacks)."""
        return bool(self.geometry) and not isinstance(self.geometry[-1], ResizeShorter)


def translate(dataset: Any, collate_fn: Any = None) -> Recipe:
    """The DALI recipe for ``dataset`` (batched with ``collate_fn``), or ``Untranslatable`` saying why not."""
    if collate_fn is not None and not _is_default_collate(collate_fn):
        raise Untranslatable(f"the loader's collate_fn ({name(collate_fn)}) is custom; DALI batches with the default "
                             "collation only")
    base, indices = unwrap_subsets(dataset)
    _check_folder_dataset(base)
    samples = base.samples
    chosen = tuple((str(samples[i][0]), int(samples[i][1])) for i in indices) if indices is not None else tuple(
        (str(p), int(c)) for p, c in samples)
    for path, _ in chosen:
        if Path(path).suffix.lower() not in DECODABLE:
            raise Untranslatable(f"{path}: DALI's image decoder does not read {Path(path).suffix or 'extension-less'} "
                                 "files")
    recipe = _chain(base.transform, chosen)
    if not recipe.fixed_size:
        raise Untranslatable("the chain does not end in a fixed size (add a crop or Resize((h, w))): images of "
                             "different sizes cannot be batched")
    return recipe


# -- the dataset ----------------------------------------------------------------------------------------------
def _check_folder_dataset(dataset: Any) -> None:
    folder = folder_class(dataset)
    if folder is None:
        raise Untranslatable(f"the dataset is a {type(dataset).__name__}, not a torchvision ImageFolder / "
                             "DatasetFolder (or a Subset of one)")
    if type(dataset).__getitem__ is not folder.__getitem__:
        raise Untranslatable(f"{type(dataset).__name__} overrides __getitem__; DALI would not do what it does")
    loader = getattr(dataset, "loader", None)
    if not (getattr(loader, "__module__", "").startswith("torchvision.datasets")
            and getattr(loader, "__name__", "") in ("default_loader", "pil_loader")):
        raise Untranslatable(f"the dataset reads images with a custom loader ({name(loader)}); DALI decodes files "
                             "as torchvision's default loader does (RGB) only")
    if getattr(dataset, "target_transform", None) is not None:
        raise Untranslatable(f"the dataset has a target_transform ({name(dataset.target_transform)}); labels are "
                             "passed through unchanged only")
    if dataset.transform is None:
        raise Untranslatable("the dataset has no transform: its samples are PIL images, which DALI does not return")


# -- the transform chain --------------------------------------------------------------------------------------
def _chain(transform: Any, samples: tuple[tuple[str, int], ...]) -> Recipe:
    """Walk the chain with the pixels' current form: "pil" (HWC uint8), "uint8" (CHW tensor) or "float"."""
    form = "pil"
    geometry: list[Geometry] = []
    flip = 0.0
    scale, mean, std = 1.0, None, None
    for t in flatten(transform):
        kind = type(t).__name__ if is_transform(t) else None
        if kind is None:
            raise Untranslatable(f"the transform {name(t)} is not a torchvision transform DALI can replace")
        if mean is not None and kind != "Normalize":
            raise Untranslatable(f"{kind} after Normalize is not supported")
        if kind in ("Resize", "RandomResizedCrop", "CenterCrop"):
            if flip:
                raise Untranslatable(f"{kind} after RandomHorizontalFlip is not supported (put the flip last)")
            geometry.append(_geometry(kind, t))
        elif kind == "RandomHorizontalFlip":
            if flip:
                raise Untranslatable("two RandomHorizontalFlip transforms are not supported")
            flip = float(t.p)
        elif kind in ("ToTensor", "PILToTensor", "ToImage"):
            if form != "pil":
                raise Untranslatable(f"{kind} on a tensor is not supported")
            form, scale = ("float", 1.0 / 255.0) if kind == "ToTensor" else ("uint8", 1.0)
        elif kind in ("ToDtype", "ConvertImageDtype"):
            form, scale = _to_float(kind, t, form, scale)
        elif kind == "Normalize":
            if form != "float":
                raise Untranslatable("Normalize before the image is a float tensor (ToTensor or ToDtype(float32)) is "
                                     "not supported")
            if mean is not None:
                raise Untranslatable("two Normalize transforms are not supported")
            mean, std = tuple(float(m) for m in t.mean), tuple(float(s) for s in t.std)
        else:
            raise Untranslatable(f"the transform {kind} has no DALI translation in pipeopt (supported: Compose, "
                                 "RandomResizedCrop, Resize, CenterCrop, RandomHorizontalFlip, ToTensor, PILToTensor, "
                                 "ToImage, ToDtype, ConvertImageDtype, Normalize)")
    if form == "pil":
        raise Untranslatable("the chain ends with a PIL image (no ToTensor / ToImage); DALI returns tensors only")
    if mean is not None and std is not None and (len(mean) not in (1, 3) or len(std) not in (1, 3)):
        raise Untranslatable("Normalize needs 1 or 3 channel values for RGB images")
    return Recipe(samples=samples, geometry=tuple(geometry), flip=flip, dtype="float32" if form == "float" else "uint8",
                  scale=scale, mean=mean, std=std)


def _geometry(kind: str, t: Any) -> Geometry:
    if kind == "CenterCrop":
        h, w = _pair(t.size, kind)
        return CenterCrop(h, w)
    interp = _interp(t, kind)
    if kind == "RandomResizedCrop":
        h, w = _pair(t.size, kind)
        return RandomResizedCrop(h, w, (float(t.scale[0]), float(t.scale[1])),
                                 (float(t.ratio[0]), float(t.ratio[1])), interp)
    size = t.size
    if size is None:
        raise Untranslatable("Resize(size=None) is not supported")
    if isinstance(size, int) or len(size) == 1:
        return ResizeShorter(int(size if isinstance(size, int) else size[0]), t.max_size, interp)
    h, w = _pair(size, kind)
    return ResizeTo(h, w, interp)


def _pair(size: Any, kind: str) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    size = tuple(int(s) for s in size)
    if len(size) == 1:
        return size[0], size[0]
    if len(size) != 2:
        raise Untranslatable(f"{kind}(size={size!r}) is not a size")
    return size[0], size[1]


def _interp(t: Any, kind: str) -> str:
    mode = getattr(t, "interpolation", None)
    mode_name = str(getattr(mode, "value", mode)).lower()
    if mode_name not in INTERPOLATION:
        raise Untranslatable(f"{kind}(interpolation={mode_name}) is not supported (bilinear, nearest or bicubic)")
    return INTERPOLATION[mode_name]


def _to_float(kind: str, t: Any, form: str, scale: float) -> tuple[str, float]:
    dtype = t.dtype
    if isinstance(dtype, dict):
        raise Untranslatable(f"{kind} with a per-type dtype dict is not supported")
    if str(dtype) != "torch.float32":
        raise Untranslatable(f"{kind}({dtype}) is not supported (float32 only)")
    if form == "pil":
        raise Untranslatable(f"{kind} on a PIL image is not supported (put ToImage or PILToTensor first)")
    if form == "float":
        return form, scale
    rescale = kind == "ConvertImageDtype" or bool(getattr(t, "scale", False))
    return "float", scale / 255.0 if rescale else scale


# -- recognising objects by class and module --------------------------------------------------------------------
def _is_default_collate(fn: Any) -> bool:
    return getattr(fn, "__name__", "") == "default_collate" and getattr(fn, "__module__", "").startswith(
        "torch.utils.data")
