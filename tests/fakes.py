"""Stand-ins for the GPU on a CPU-only machine: a tensor that claims to live on cuda:0, and a driver that
records what it is asked to do instead of doing it."""

from __future__ import annotations

import ctypes

import torch


class FakeCudaTensor:
    """A CPU tensor's metadata presented as a CUDA tensor's, at a chosen device address."""

    is_cuda = True

    def __init__(self, shape, dtype=torch.bfloat16, stride=None, address=0x7F0000000000):
        self._t = torch.empty_strided(shape, stride or _contiguous(shape), dtype=dtype)
        self.dtype, self.shape, self._address = dtype, self._t.shape, address
        self.device = torch.device("cuda", 0)

    def dim(self):
        return self._t.dim()

    def stride(self, m=None):
        return self._t.stride() if m is None else self._t.stride(m)

    def data_ptr(self):
        return self._address


def _contiguous(shape):
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


class FakeDriver:
    """Replaces flash_msa_rt.driver's GPU-touching calls; records launches and TMA encodes."""

    def __init__(self, param_sizes):
        self.sizes = list(param_sizes)
        self.launches, self.encodes, self.loaded = [], [], []

    def install(self, monkeypatch):
        from flash_msa_rt import driver, loader

        monkeypatch.setattr(driver, "load_library", lambda image: self.loaded.append(image) or "lib")
        monkeypatch.setattr(driver, "get_function", lambda lib, entry: f"func:{entry}")
        monkeypatch.setattr(driver, "param_sizes", lambda func, n: self.sizes[:n])
        monkeypatch.setattr(driver, "param_count_exceeds", lambda func, n: len(self.sizes) > n)
        monkeypatch.setattr(driver, "set_dynamic_smem", lambda func, n: None)
        monkeypatch.setattr(driver, "allow_non_portable_cluster", lambda func: None)
        monkeypatch.setattr(driver, "launch_config", lambda grid, block, smem, cluster: type(
            "Cfg", (), {"grid": grid, "block": block, "smem": smem, "hStream": None})())
        monkeypatch.setattr(driver, "launch", self._launch)
        monkeypatch.setattr(driver, "encode_tiled", self._encode)
        monkeypatch.setattr(loader, "_bound_device", _null_context)
        monkeypatch.setattr(loader, "current_stream", lambda index: 1234)
        monkeypatch.setattr(loader, "device_arch", lambda index: "sm90a")

    def _launch(self, cfg, func, address):
        n = len(self.sizes)
        pointers = (ctypes.c_void_p * n).from_address(address)
        blobs = [ctypes.string_at(pointers[i], self.sizes[i]) for i in range(n)]
        self.launches.append({"grid": cfg.grid, "block": cfg.block, "smem": cfg.smem, "stream": cfg.hStream,
                              "func": func, "params": blobs})

    def _encode(self, dst, dtype_code, address, dims, strides, box, swizzle, l2, oob, span):
        self.encodes.append(dict(dtype=dtype_code, address=address, dims=dims, strides=strides, box=box,
                                 swizzle=swizzle, l2=l2, oob=oob, span=span))
        ctypes.memset(dst, 0xAB, 128)


class _null_context:
    def __init__(self, *a):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
