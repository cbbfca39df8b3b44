"""BLAKE2b digests of bytes and tensors: what a saved store's header and its weights fingerprint are made of."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch


def digest(data) -> str:
    """Hex BLAKE2b-128 of bytes-like `data`."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def raw_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of `tensor` (copied to host memory if needed) as a uint8 array, row-major."""
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


def tensor_digests(tensors: Mapping[str, torch.Tensor], labelled: bool = False) -> dict[str, str]:
    """{name: BLAKE2b-128 of the tensor's bytes} in name order; `labelled` hashes name, dtype and shape first.
    Tensors are hashed on several threads: hashlib and the device-to-host copies release the GIL."""

    def one(name: str) -> str:
        tensor = tensors[name]
        label = f"{name}|{tensor.dtype}|{list(tensor.shape)}" if labelled else ""
        hasher = hashlib.blake2b(label.encode(), digest_size=16)
        if tensor.device.type != "meta":
            hasher.update(raw_bytes(tensor))
        return hasher.hexdigest()

    names = sorted(tensors)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return dict(zip(names, pool.map(one, names), strict=True))
