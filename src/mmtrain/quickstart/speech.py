"""Spoken captions for `mmtrain quickstart --modalities audio`: eSpeak NG through ctypes.

The `espeakng-loader` wheel (an optional extra) ships `libespeak-ng` and its voice data; this
module loads the library at run time, only to synthesise the demo's audio, and never vendors
or links it: eSpeak NG is GPL-3.0-or-later, mmtrain Apache-2.0.

The library is driven in synchronous mode: `espeak_Synth` returns once the whole text is spoken,
having handed the 16-bit mono samples, chunk by chunk, to a callback that collects them.
`Speaker` wraps that session; `to_flac` turns its samples into the FLAC bytes of a shard.

eSpeak NG varies its voice slightly from one utterance to the next (the pitch flutter of its
wave generator keeps state): the same caption spoken twice in one session differs a little.
A fresh process speaking the same captions in the same order produces the same bytes
(two quickstart runs built identical audio shards).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import io
import math
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SPEECH_PACKAGE = "espeakng_loader"

# espeak_AUDIO_OUTPUT: the callback receives the samples and espeak_Synth blocks until done.
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_POS_CHARACTER = 1  # espeak_POSITION_TYPE
_CHARS_UTF8 = 1  # espeak_Synth flags: the text is UTF-8
_RATE, _PITCH = 1, 3  # espeak_PARAMETER: words per minute, base pitch 0-100
_EE_OK = 0

# eSpeak NG keeps one synthesiser per process (C globals); one Speaker may use it at a time.
_SESSION = threading.Lock()

_Callback = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)


class SpeechError(RuntimeError):
    """eSpeak NG could not be loaded or could not speak a text."""


def _library_paths() -> tuple[Path, Path]:
    """(libespeak-ng, espeak-ng-data) inside the installed `espeakng-loader` package."""
    if importlib.util.find_spec(SPEECH_PACKAGE) is None:
        raise SpeechError(f"the {SPEECH_PACKAGE} package is not installed")
    import espeakng_loader  # tiny: two path helpers, imports nothing heavy

    return Path(espeakng_loader.get_library_path()), Path(espeakng_loader.get_data_path())


@dataclass(frozen=True)
class Voice:
    """How a caption is spoken: eSpeak voice name, words per minute and base pitch (0-100)."""

    name: str = "en"
    rate_wpm: int = 175
    pitch: int = 50


def voice_for(key: str, name: str = "en") -> Voice:
    """A speaking rate (150-200 wpm) and pitch (30-70) drawn from sha256(key): every caption is
    spoken the same way on every machine, and the set varies like several speakers would."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return Voice(name, rate_wpm=150 + digest[0] % 51, pitch=30 + digest[1] % 41)


class Speaker:
    """A synthesis session: `with Speaker() as s: wave = s.speak("a person walking")`.

    `speak` returns float32 mono samples in [-1, 1] at `sample_rate` (eSpeak NG's own rate,
    22,050 Hz for its voices). Only one session per process can be open at a time.
    """

    def __init__(self, library: Path | None = None, data: Path | None = None):
        if library is None or data is None:
            found_library, found_data = _library_paths()
            library, data = library or found_library, data or found_data
        self.library_path, self.data_path = Path(library), Path(data)
        self.sample_rate = 0
        self._lib: ctypes.CDLL | None = None
        self._chunks: list[np.ndarray] = []
        self._callback = _Callback(self._collect)  # kept alive as long as the session

    def __enter__(self) -> Speaker:
        if not _SESSION.acquire(blocking=False):
            raise SpeechError("another Speaker session is open in this process; close it first")
        try:
            self._open()
        except BaseException:
            _SESSION.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> None:
        try:
            lib = ctypes.CDLL(str(self.library_path))
        except OSError as err:
            raise SpeechError(f"cannot load eSpeak NG from {self.library_path}: {err}") from None
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_SetSynthCallback.argtypes = [_Callback]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_Synth.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
            ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
        ]  # fmt: skip
        rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, str(self.data_path).encode(), 0)
        if rate <= 0:
            raise SpeechError(f"eSpeak NG failed to start with the voice data in {self.data_path}")
        lib.espeak_SetSynthCallback(self._callback)
        self._lib, self.sample_rate = lib, rate

    def close(self) -> None:
        if self._lib is not None:
            self._lib.espeak_Terminate()
            self._lib = None
            _SESSION.release()

    def _collect(self, wav: ctypes.Array, count: int, events: int) -> int:
        if wav and count > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(count,)).copy())
        return 0  # 0: go on synthesising

    def speak(self, text: str, voice: Voice = Voice()) -> np.ndarray:
        """The waveform of `text` spoken with `voice`: float32 [S] in [-1, 1]."""
        lib = self._lib
        if lib is None:
            raise SpeechError("Speaker.speak outside its `with` block")
        if lib.espeak_SetVoiceByName(voice.name.encode()) != _EE_OK:
            raise SpeechError(f"eSpeak NG has no voice {voice.name!r} in {self.data_path}")
        lib.espeak_SetParameter(_RATE, voice.rate_wpm, 0)
        lib.espeak_SetParameter(_PITCH, voice.pitch, 0)
        data = text.encode("utf-8") + b"\0"
        self._chunks = []
        status = lib.espeak_Synth(data, len(data), 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
        if status != _EE_OK or not self._chunks:
            raise SpeechError(f"eSpeak NG could not speak {text!r} (status {status})")
        samples = np.concatenate(self._chunks)
        self._chunks = []
        return samples.astype(np.float32) / 32768.0


def resample(wave: np.ndarray, rate: int, target_rate: int) -> np.ndarray:
    """Band-limited resampling through the spectrum: float32 [S] at `rate` -> `target_rate`.

    The clip is zero-padded to a whole number of `rate / gcd` blocks (so the output length is
    exact), transformed, cut (or zero-extended) to the new band, and transformed back. Spoken
    captions start and end in silence, so treating the clip as periodic costs nothing, and
    one FFT per clip is several times faster than setting up a streaming resampler for each.
    """
    if rate == target_rate:
        return wave.astype(np.float32)
    step = rate // math.gcd(rate, target_rate)
    padded = -(-len(wave) // step) * step
    n_out = padded * target_rate // rate
    spectrum = np.fft.rfft(wave.astype(np.float64), n=padded)
    band = n_out // 2 + 1
    if band <= len(spectrum):
        spectrum = spectrum[:band]
    else:
        spectrum = np.concatenate([spectrum, np.zeros(band - len(spectrum), spectrum.dtype)])
    out = np.fft.irfft(spectrum, n=n_out) * (n_out / padded)
    return out[: round(len(wave) * target_rate / rate)].astype(np.float32)


def to_flac(wave: np.ndarray, rate: int, target_rate: int) -> bytes:
    """`wave` (float32 mono at `rate`) resampled to `target_rate` and encoded as 16-bit FLAC."""
    import soundfile

    samples = np.clip(resample(wave, rate, target_rate), -1.0, 1.0)
    out = io.BytesIO()
    soundfile.write(out, samples, target_rate, format="FLAC", subtype="PCM_16")
    return out.getvalue()


__all__ = ["SPEECH_PACKAGE", "Speaker", "SpeechError", "Voice", "resample", "to_flac", "voice_for"]
