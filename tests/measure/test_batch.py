from dataclasses import dataclass

import torch

from pipeopt.measure.batch import batch_size


@dataclass
class Pair:
    meta: str
    x: torch.Tensor


def test_leading_dimension_of_the_first_tensor():
    assert batch_size(torch.zeros(7, 3)) == 7
    assert batch_size((torch.zeros(5, 2), torch.zeros(5))) == 5
    assert batch_size({"ids": ["a", "b"], "x": torch.zeros(4, 2)}) == 4
    assert batch_size(Pair("m", torch.zeros(3))) == 3
    assert batch_size([["s", "t"], [torch.zeros(2, 9)]]) == 2


def test_no_tensor_means_unknown():
    assert batch_size(["a", "b"]) is None
    assert batch_size("text") is None
    assert batch_size(None) is None
