"""A stand-in for the few PyTorch calls a module from ``mpitrain convert --to torch``
makes, on NumPy, so that the module runs where PyTorch is not installed (CI).

Its tensors carry a device, as PyTorch's do: arithmetic between tensors of two
devices fails, ``numpy()`` of a tensor off the CPU fails, and ``Module.to``
moves registered buffers and the layers' parameters but no plain attribute,
so a module that works on the CPU but not once moved to a GPU fails here
too.  "cuda" is only a name: the data stay in host memory.

Example::

    from mpitrain.testing import standin_torch
    with standin_torch.installed() as torch:
        x = torch.from_numpy(np.ones((2, 3), np.float32)).to("cuda")
        torch.relu(x).cpu().numpy()
"""

from __future__ import annotations

import contextlib
import sys
import types

import numpy as np


class Tensor(np.ndarray):
    """A NumPy array with a ``device``; operations keep it and refuse to mix two."""

    def __array_finalize__(self, obj):
        self._device = getattr(obj, "_device", "cpu")

    @property
    def device(self) -> str:        # (NumPy 2's own ``device`` is read-only: "cpu")
        return self._device

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        devices = {x.device for x in inputs if isinstance(x, Tensor)}
        if len(devices) > 1:
            raise RuntimeError("Expected all tensors to be on the same device, but found "
                               f"at least two devices, {' and '.join(sorted(devices))}!")
        plain = [x.view(np.ndarray) if isinstance(x, Tensor) else x for x in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(x.view(np.ndarray) if isinstance(x, Tensor) else x
                                  for x in kwargs["out"])
        result = getattr(ufunc, method)(*plain, **kwargs)
        return _on(result, devices.pop() if devices else "cpu")

    def __setitem__(self, index, value):
        if isinstance(value, Tensor) and value.device != self.device:
            raise RuntimeError("Expected all tensors to be on the same device")
        super().__setitem__(_plain(index), _plain(value))

    def __getitem__(self, index):
        return _on(super().__getitem__(_plain(index)), self.device)

    # -- the Tensor methods a converted module calls ------------------------------------
    def to(self, *args, device=None, dtype=None):
        for arg in args:
            if isinstance(arg, str):
                device = arg
            else:
                dtype = arg
        out = self.view(np.ndarray)
        if dtype is not None:
            out = out.astype(dtype)
        return _on(out.copy() if out is self.view(np.ndarray) else out,
                   _device_name(device) if device is not None else self.device)

    def cpu(self):
        return self.to("cpu")

    def numpy(self):
        if self.device != "cpu":
            raise TypeError(f"can't convert {self.device}:0 device type tensor to numpy. "
                            "Use Tensor.cpu() to copy the tensor to host memory first.")
        return self.view(np.ndarray)

    def copy_(self, other):
        self[...] = other
        return self

    def abs(self):
        return np.abs(self)

    def pow(self, p):
        return np.power(self, p)

    def clamp(self, low, high):
        return np.minimum(np.maximum(self, low), high)

    def clamp_min(self, low):
        return np.maximum(self, low)

    def amax(self, dim, keepdim=False):
        return _on(self.view(np.ndarray).max(axis=dim, keepdims=keepdim), self.device)

    def sum(self, dim=None, keepdim=False):
        return _on(self.view(np.ndarray).sum(axis=dim, keepdims=keepdim), self.device)


def _device_name(device) -> str:
    return str(device).split(":")[0]


def _on(array, device: str):
    """``array`` as a stand-in tensor on ``device`` (scalars too, as 0-d tensors)."""
    out = np.asarray(array).view(Tensor)
    out._device = device
    return out


def _plain(obj):
    if isinstance(obj, Tensor):
        return obj.view(np.ndarray)
    if isinstance(obj, tuple):
        return tuple(_plain(o) for o in obj)
    return obj


# -- torch.* ----------------------------------------------------------------------------
def from_numpy(array):
    return np.asarray(array).view(Tensor)


def zeros(*shape, dtype=np.float32, device="cpu"):
    return _on(np.zeros(shape, dtype=dtype), _device_name(device))


def arange(*args, device="cpu"):
    return _on(np.arange(*args), _device_name(device))


def relu(x):
    return np.maximum(x, 0)


def sigmoid(x):
    return _on((1.0 / (1.0 + np.exp(-x.view(np.ndarray)))).astype(x.dtype), x.device)


def log(x):
    return np.log(x)


def log_softmax(x, dim):
    plain = x.view(np.ndarray)
    shifted = plain - plain.max(axis=dim, keepdims=True)
    return _on(shifted - np.log(np.exp(shifted).sum(axis=dim, keepdims=True)), x.device)


@contextlib.contextmanager
def no_grad():
    yield


class Module:
    """Buffers and child modules as PyTorch keeps them: ``to`` moves those alone."""

    def __init__(self):
        self._buffers = []

    def register_buffer(self, name, tensor):
        self._buffers.append(name)
        setattr(self, name, tensor)

    def _children(self):
        return [v for v in vars(self).values() if isinstance(v, (Module, ModuleList))]

    def to(self, device):
        for name in self._buffers:
            setattr(self, name, getattr(self, name).to(device))
        for child in self._children():
            child.to(device)
        return self

    def eval(self):
        return self

    def __call__(self, *args):
        return self.forward(*args)


class ModuleList(list):
    def to(self, device):
        for module in self:
            module.to(device)
        return self


class Linear(Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.register_buffer("weight", zeros(out_features, in_features))
        self.register_buffer("bias", zeros(out_features))

    def forward(self, x):
        return np.matmul(x, self.weight.T) + self.bias


def _build_module():
    torch = types.ModuleType("torch")
    torch.Tensor, torch.float32, torch.float64 = Tensor, np.float32, np.float64
    for function in (from_numpy, zeros, arange, relu, sigmoid, log, log_softmax, no_grad):
        setattr(torch, function.__name__, function)
    torch.nn = types.ModuleType("torch.nn")
    torch.nn.Module, torch.nn.ModuleList, torch.nn.Linear = Module, ModuleList, Linear
    return torch


module = _build_module()


@contextlib.contextmanager
def installed():
    """``import torch`` gives the stand-in within the block."""
    saved = {name: sys.modules.get(name) for name in ("torch", "torch.nn")}
    sys.modules["torch"], sys.modules["torch.nn"] = module, module.nn
    try:
        yield module
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
