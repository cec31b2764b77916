"""Checkpoint writers for the quantized formats, written from each format's published layout and
independent of the engine's readers: each quantizes one float weight [out, in] and returns the
tensors as the format stores them, plus the weight they stand for (the test's ground truth).
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble k of a packed int32 holds column 8c + AWQ_ORDER[k]
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
FP8_MAX = 448.0


def _pack_rows(values: np.ndarray) -> np.ndarray:
    """[8n, m] in [0, 15] -> [n, m] int32, row 8i + j in bits 4j of row i."""
    v = values.astype(np.uint32)
    out = np.zeros((v.shape[0] // 8, v.shape[1]), np.uint32)
    for j in range(8):
        out |= v[j::8] << np.uint32(4 * j)
    return out.view(np.int32)


def _pack_cols(values: np.ndarray, order=range(8)) -> np.ndarray:
    """[m, 8n] in [0, 15] -> [m, n] int32, nibble k of column c holding column 8c + order[k]."""
    v = values.astype(np.uint32)
    out = np.zeros((v.shape[0], v.shape[1] // 8), np.uint32)
    for k, col in enumerate(order):
        out |= v[:, col::8] << np.uint32(4 * k)
    return out.view(np.int32)


def _int4_groups(w: np.ndarray, cols: np.ndarray, sym: bool, min_zero: int):
    """(scale fp16 [out], zero [out], q [out, len(cols)]) for one group of input columns."""
    wg = w[:, cols]
    if sym:
        scale = (np.abs(wg).max(1) / 7).astype(np.float16)
        zero = np.full(w.shape[0], 8)
    else:
        lo, hi = wg.min(1), wg.max(1)
        scale = ((hi - lo) / 15).astype(np.float16)
        zero = np.clip(np.round(-lo / scale.astype(np.float32)), min_zero, 15).astype(np.int64)
    s = scale.astype(np.float32)[:, None]
    q = np.clip(np.round(wg / s) + zero[:, None], 0, 15).astype(np.int64)
    return scale, zero, q


def gptq(w: np.ndarray, group: int, sym: bool, desc_act: bool) -> tuple[dict, np.ndarray]:
    """Classic GPTQ (zero points stored minus one). A zero point of 0 would be stored as -1, which
    the classic format cannot hold, so asymmetric zero points start at 1, as real ones mostly do.
    With `desc_act` the groups follow a random activation order, one per input size: it comes
    from the layer's input, which the projections fused into one layer share."""
    out, k = w.shape
    g_idx = np.arange(k) // group
    if desc_act:
        g_idx[np.random.default_rng(k).permutation(k)] = np.arange(k) // group
    groups = k // group
    scales = np.zeros((groups, out), np.float16)
    zeros = np.zeros((groups, out), np.int64)
    q = np.zeros((out, k), np.int64)
    for gi in range(groups):
        cols = np.nonzero(g_idx == gi)[0]
        scales[gi], zeros[gi], q[:, cols] = _int4_groups(w, cols, sym, 1)
    deq = scales.astype(np.float32)[g_idx].T * (q - zeros[g_idx].T)
    tensors = {"qweight": _pack_rows(q.T), "qzeros": _pack_cols((zeros - 1) & 15),
               "scales": scales, "g_idx": g_idx.astype(np.int32)}
    return tensors, deq


def awq(w: np.ndarray, group: int) -> tuple[dict, np.ndarray]:
    out, k = w.shape
    groups = k // group
    scales = np.zeros((groups, out), np.float16)
    zeros = np.zeros((groups, out), np.int64)
    q = np.zeros((out, k), np.int64)
    for gi in range(groups):
        cols = np.arange(gi * group, (gi + 1) * group)
        scales[gi], zeros[gi], q[:, cols] = _int4_groups(w, cols, False, 0)
    g_idx = np.arange(k) // group
    deq = scales.astype(np.float32)[g_idx].T * (q - zeros[g_idx].T)
    tensors = {"qweight": _pack_cols(q.T, AWQ_ORDER), "qzeros": _pack_cols(zeros, AWQ_ORDER),
               "scales": scales}
    return tensors, deq


def fp8(w: np.ndarray, per_channel: bool, scale_shape: tuple, static: bool):
    t = torch.from_numpy(w)
    amax = t.abs().amax(dim=1, keepdim=True) if per_channel else t.abs().max()
    scale = (amax / FP8_MAX).float()
    q = (t / scale).to(torch.float8_e4m3fn)
    tensors = {"weight": q, "weight_scale": scale.reshape(scale_shape)}
    if static:
        tensors["input_scale"] = torch.tensor(0.02 + 0.01 * float(t.abs().max()))
    return tensors, (q.float() * scale).numpy()


def _e2m1_codes(x: np.ndarray) -> np.ndarray:
    return np.abs(x[..., None] - E2M1).argmin(-1).astype(np.uint8)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def mxfp4(w: np.ndarray) -> tuple[dict, np.ndarray]:
    out, k = w.shape
    blocks = w.reshape(out, k // 32, 32)
    exp = np.ceil(np.log2(np.abs(blocks).max(-1) / 6)).astype(np.int64)  # no block exceeds 6
    scale = np.exp2(exp).astype(np.float32)[..., None]
    codes = _e2m1_codes(blocks / scale)
    deq = (E2M1[codes] * scale).reshape(out, k)
    return {"weight_packed": _pack_nibbles(codes.reshape(out, k)),
            "weight_scale": (exp + 127).astype(np.uint8)}, deq


def nvfp4(w: np.ndarray) -> tuple[dict, np.ndarray]:
    out, k = w.shape
    global_scale = np.float32(FP8_MAX * 6 / np.abs(w).max())
    blocks = w.reshape(out, k // 16, 16)
    amax = np.abs(blocks).max(-1)
    block_scale = torch.from_numpy(amax / 6 * global_scale).to(torch.float8_e4m3fn)
    eff = (block_scale.float().numpy() / global_scale)[..., None]
    codes = _e2m1_codes(blocks / eff)
    deq = (E2M1[codes] * eff).reshape(out, k)
    return {"weight_packed": _pack_nibbles(codes.reshape(out, k)), "weight_scale": block_scale,
            "weight_global_scale": torch.tensor([global_scale])}, deq


def write_checkpoints(src: str, quant_dir: str, dense_dir: str, quantize,
                      quantization_config: dict) -> None:
    """From the float model at `src`: `quant_dir` with every linear weight as `quantize(w)` gives
    it (and the config's quantization_config), `dense_dir` with those weights dequantized."""
    for d in (quant_dir, dense_dir):
        shutil.copytree(src, d)
    name = "model.safetensors"
    tensors = load_file(os.path.join(src, name))
    quant, dense = {}, {}
    for key, t in tensors.items():
        if key.endswith(".weight") and any(f".{p}." in key for p in LINEAR_NAMES):
            parts, deq = quantize(t.float().numpy())
            base = key[:-len("weight")]
            quant.update({base + n: torch.as_tensor(v) for n, v in parts.items()})
            dense[key] = torch.as_tensor(np.asarray(deq, np.float32))
        else:
            quant[key] = dense[key] = t
    save_file(quant, os.path.join(quant_dir, name), metadata={"format": "pt"})
    save_file(dense, os.path.join(dense_dir, name), metadata={"format": "pt"})
    with open(os.path.join(quant_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(quant_dir, "config.json"), "w") as f:
        json.dump(config, f)
