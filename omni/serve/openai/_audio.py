"""Speech as the OpenAI API carries it: base64 WAV for a whole reply, base64 PCM16 chunks
for a stream."""

from __future__ import annotations

import base64
import io
import secrets
import time
import wave
from typing import Any

import numpy as np

__all__ = ["AUDIO_TTL_S", "audio_id", "b64", "expires_at", "pcm16", "wav_bytes"]

AUDIO_TTL_S = 3600  # expires_at: the id names no stored clip; the time is OpenAI's shape


def pcm16(samples: Any) -> bytes:
    """Float samples in [-1, 1] as little-endian 16-bit PCM."""
    clipped = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    return (clipped * 32767.0).round().astype("<i2").tobytes()


def wav_bytes(samples: Any, sample_rate: int) -> bytes:
    """A mono 16-bit WAV file of `samples`."""
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(pcm16(samples))
    return out.getvalue()


def b64(data: bytes) -> str:
    """`data` in base64 text."""
    return base64.b64encode(data).decode("ascii")


def audio_id() -> str:
    """A fresh id for a reply's audio."""
    return "audio_" + secrets.token_hex(12)


def expires_at() -> int:
    """When a reply's audio id expires (Unix seconds)."""
    return int(time.time()) + AUDIO_TTL_S
