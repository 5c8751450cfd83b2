"""A ``Recipe`` as a DALI pipeline: encoded files in (fed batch by batch), finished CHW image tensors out.

The pipeline has no reader: pipeopt feeds it the bytes of the files its sampler chose, so the order, the sharding
and the epoch are the loader's (see ``pipeopt.dali.loader``). Decoding runs on DALI's CPU backend (``device="cpu"``)
or on the GPU (``"mixed"``: nvJPEG / the hardware decoder), and every later step on the same device.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from pipeopt.dali.recipe import (
    CenterCrop,
    RandomResizedCrop,
    Recipe,
    ResizeShorter,
    ResizeTo,
)

#: The external source the encoded files are fed to.
ENCODED = "encoded"
DEVICES = ("cpu", "mixed")


#: Every pipeline built here that is still alive (in this process).
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
#: In a forked child: the pipelines inherited from the parent, kept alive for good.
_INHERITED: list[Any] = []


def _keep_inherited() -> None:
    """A DataLoader worker forked while a DALI pipeline exists inherits the Python object but none of its threads;
    destroying it there (when the worker's garbage collector frees it) waits forever on those threads' locks, and
    the worker hangs. The child therefore keeps every inherited pipeline alive until it exits."""
    _INHERITED.extend(_LIVE)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_keep_inherited)


def missing() -> str | None:
    """Why DALI cannot be used here (None when it can be imported)."""
    try:
        import nvidia.dali  # noqa: F401
        import nvidia.dali.plugin.pytorch  # noqa: F401
    except ImportError as err:
        return f"NVIDIA DALI is not installed ({err}); install it with `pip install 'pipeopt[dali]'`"
    return None


def build(recipe: Recipe, *, batch_size: int, device: str, device_id: int | None, num_threads: int,
          seed: int, decoded: int | None = None) -> Any:
    """A built DALI pipeline for ``recipe`` taking up to ``batch_size`` files per run. Its caller schedules runs
    ahead itself (one ``schedule_run`` per fed batch), so DALI's own prefetch queue is one deep. ``decoded``: it is
    fed images already decoded (height x width x 3 uint8 RGB, from pipeopt's sample cache) and put through the
    recipe's first ``decoded`` geometric steps, and runs the rest (on the CPU only)."""
    if device not in DEVICES:
        raise ValueError(f"DALI device {device!r} is not one of {DEVICES}")
    if decoded is not None and device != "cpu":
        raise ValueError("a DALI pipeline fed decoded images runs on the CPU (device='cpu')")
    import nvidia.dali as dali
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types

    interp = {"linear": types.INTERP_LINEAR, "nn": types.INTERP_NN, "cubic": types.INTERP_CUBIC}

    @dali.pipeline_def
    def graph() -> Any:
        steps = list(recipe.geometry)
        decoder = {"device": device, "output_type": types.RGB, "adjust_orientation": False}  # as PIL: EXIF ignored
        first = steps[0] if steps else None
        if decoded is not None:
            images = fn.external_source(name=ENCODED, dtype=types.UINT8, ndim=3, layout="HWC")
            steps = steps[decoded:]
        elif isinstance(first, RandomResizedCrop):  # decode only the crop window
            encoded = fn.external_source(name=ENCODED, dtype=types.UINT8, ndim=1)
            images = fn.decoders.image_random_crop(encoded, random_area=list(first.scale),
                                                   random_aspect_ratio=list(first.ratio), num_attempts=10, **decoder)
            images = fn.resize(images, resize_x=first.width, resize_y=first.height, interp_type=interp[first.interp])
            steps = steps[1:]
        else:
            images = fn.decoders.image(fn.external_source(name=ENCODED, dtype=types.UINT8, ndim=1), **decoder)
        for step in steps:
            if isinstance(step, ResizeShorter):
                extra = {"max_size": step.max_size} if step.max_size else {}
                images = fn.resize(images, resize_shorter=step.size, interp_type=interp[step.interp], **extra)
            elif isinstance(step, ResizeTo):
                images = fn.resize(images, resize_x=step.width, resize_y=step.height, interp_type=interp[step.interp])
            elif isinstance(step, RandomResizedCrop):
                images = fn.random_resized_crop(images, size=[step.height, step.width], random_area=list(step.scale),
                                                random_aspect_ratio=list(step.ratio), interp_type=interp[step.interp])
            elif isinstance(step, CenterCrop):  # torchvision pads a too-small image with zeros, as does this
                images = fn.crop(images, crop_h=step.height, crop_w=step.width, crop_pos_x=0.5, crop_pos_y=0.5,
                                 out_of_bounds_policy="pad", fill_values=0)
        # (x * scale - mean) / std  ==  (x - mean / scale) / (std / scale), in DALI's 0..255 pixel units
        mean = [m / recipe.scale for m in recipe.mean] if recipe.mean else [0.0]
        std = [s / recipe.scale for s in recipe.std] if recipe.std else [1.0 / recipe.scale]
        mirror = fn.random.coin_flip(probability=recipe.flip) if recipe.flip else 0
        return fn.crop_mirror_normalize(images, dtype=types.FLOAT if recipe.dtype == "float32" else types.UINT8,
                                        output_layout="CHW", mean=mean, std=std, mirror=mirror)

    pipe = graph(batch_size=batch_size, num_threads=num_threads, device_id=device_id, seed=seed,
                 prefetch_queue_depth=1)
    pipe.build()
    _LIVE.add(pipe)
    return pipe
