"""ModuleWeights: weight sync between a learner's and an actor's networks."""

import pytest
import torch
from torch import nn

from msrl.api import ModuleWeights
from msrl.normalization import RunningMeanStd


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        self.obs_rms = RunningMeanStd((3,))


def test_get_shares_storage_and_load_copies_in_place():
    src, dst = Net(), Net()
    src_w, dst_w = ModuleWeights(src), ModuleWeights(dst)
    assert src_w.get().keys() == src.state_dict().keys()
    before = {k: v.data_ptr() for k, v in dst.state_dict().items()}
    with torch.no_grad():
        src.body[0].weight.add_(1.0)  # an optimiser step, in place
    src.obs_rms.update(torch.randn(5, 3))  # buffers too
    dst_w.load_(src_w.get())
    for k, v in dst.state_dict().items():
        assert torch.equal(v, src.state_dict()[k]), k
        assert v.data_ptr() == before[k], f"{k} was replaced, not copied into"
    assert not any(v.requires_grad for v in src_w.get().values())
    got = src_w.get()
    got.clear()  # a new dict each time: the caller's edits do not reach the module's list
    assert src_w.get().keys() == src.state_dict().keys()


def test_load_names_missing_unexpected_and_misshapen_weights():
    src, dst = Net(), ModuleWeights(Net())
    weights = ModuleWeights(src).get()
    del weights["body.0.bias"]
    weights["extra"] = torch.zeros(1)
    with pytest.raises(KeyError, match=r"missing keys \['body.0.bias'\], unexpected keys \['extra'\]"):
        dst.load_(weights)
    weights = ModuleWeights(src).get()
    weights["body.2.weight"] = torch.zeros(3, 4)
    weights["body.0.weight"] = torch.ones(4, 3)
    kept = {k: v.clone() for k, v in dst.get().items()}
    with pytest.raises(ValueError, match=r"'body.2.weight' has shape \(3, 4\), the module's has \(2, 4\); nothing"):
        dst.load_(weights)
    assert all(torch.equal(v, kept[k]) for k, v in dst.get().items())  # no half-written weights
