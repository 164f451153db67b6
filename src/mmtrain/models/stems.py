"""Stems: one per modality, each turning a batch tensor into a token sequence [B, T, width].

A stem owns everything modality-specific before the shared transformer blocks: patching,
position embeddings and the optional class token. Token counts equal the spec's
(`TowerSpec.tokens()`), so the planner and the module agree. Inputs follow the batch contract:
image [B, C, H, W], video [B, T, C, H, W], audio [B, samples] waveform, timeseries
[B, channels, length], text [B, context_length] int64 ids with 0 = padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmtrain.spec import AudioStem as AudioStemSpec
from mmtrain.spec import ImageStem as ImageStemSpec
from mmtrain.spec import TextStem as TextStemSpec
from mmtrain.spec import TimeSeriesStem as TimeSeriesStemSpec
from mmtrain.spec import TowerSpec
from mmtrain.spec import VideoStem as VideoStemSpec

# Floor of the mel power before the log: about -60 dB below a full-scale sine, so digital
# silence (zero padding) maps to a finite value instead of -inf.
LOG_MEL_FLOOR = 1e-6


def _check_shape(x: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    """Raise a ValueError naming the expected layout when `x` (minus the batch dim) does not fit."""
    if tuple(x.shape[1:]) != expected:
        layout = ", ".join(["B", *map(str, expected)])
        raise ValueError(f"{what} input must be [{layout}], got {list(x.shape)}")


class _TokenStem(nn.Module):
    """Shared tail of the patch stems: optional class token in front, then learned positions."""

    def _init_cls(self, width: int, cls: bool) -> None:
        self.cls_token = nn.Parameter(torch.zeros(width)) if cls else None

    def _prepend_cls(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.cls_token is None:
            return tokens
        cls = self.cls_token.to(tokens.dtype).expand(tokens.shape[0], 1, -1)
        return torch.cat([cls, tokens], dim=1)

    def key_mask(self, x: torch.Tensor) -> torch.Tensor | None:
        """Patch stems have no padding: every token may be attended to."""
        return None


class ImagePatchStem(_TokenStem):
    """Square images -> non-overlapping patches by a strided conv (a ragged border is dropped)."""

    def __init__(self, stem: ImageStemSpec, width: int, cls: bool):
        super().__init__()
        self.spec = stem
        p = stem.patch_size
        self.patch_embed = nn.Conv2d(stem.channels, width, p, stride=p, bias=stem.patch_bias)
        self._init_cls(width, cls)
        self.pos_embed = nn.Parameter(torch.zeros(stem.patches() + int(cls), width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        _check_shape(x, (s.channels, s.image_size, s.image_size), "image")
        x = x.to(self.patch_embed.weight.dtype)
        tokens = self.patch_embed(x).flatten(2).transpose(1, 2)  # [B, grid * grid, width]
        return self._prepend_cls(tokens) + self.pos_embed.to(tokens.dtype)


class VideoStem(_TokenStem):
    """Clips [B, T, C, H, W] -> tubelets (a strided Conv3d) with factorised positions:
    position (t, i) gets pos_temporal[t] + pos_spatial[i]. The class token has no position."""

    def __init__(self, stem: VideoStemSpec, width: int, cls: bool):
        super().__init__()
        self.spec = stem
        kernel = (stem.tubelet, stem.patch_size, stem.patch_size)
        self.patch_embed = nn.Conv3d(
            stem.channels, width, kernel, stride=kernel, bias=stem.patch_bias
        )
        self._init_cls(width, cls)
        self.pos_spatial = nn.Parameter(torch.zeros(stem.grid() ** 2, width))
        self.pos_temporal = nn.Parameter(torch.zeros(stem.time_steps(), width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        _check_shape(x, (s.frames, s.channels, s.image_size, s.image_size), "video")
        x = x.transpose(1, 2).to(self.patch_embed.weight.dtype)  # Conv3d wants [B, C, T, H, W]
        # [B, T' * grid^2, width], time-major: all patches of tubelet 0, then of tubelet 1, ...
        tokens = self.patch_embed(x).flatten(2).transpose(1, 2)
        pos = self.pos_temporal[:, None, :] + self.pos_spatial[None, :, :]  # [T', grid^2, width]
        tokens = tokens + pos.flatten(0, 1).to(tokens.dtype)
        return self._prepend_cls(tokens)


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int) -> torch.Tensor:
    """Triangular filters on the HTK mel scale from 0 Hz to Nyquist, [n_fft // 2 + 1, n_mels].

    Unnormalised triangles (peak 1), the common default of speech and audio-CLIP front ends.
    """

    def hz_to_mel(f: torch.Tensor) -> torch.Tensor:
        return 2595.0 * torch.log10(1.0 + f / 700.0)

    def mel_to_hz(m: torch.Tensor) -> torch.Tensor:
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)

    nyquist = torch.tensor(sample_rate / 2, dtype=torch.float64)
    freqs = torch.linspace(0.0, float(nyquist), n_fft // 2 + 1, dtype=torch.float64)
    edges = mel_to_hz(
        torch.linspace(0.0, float(hz_to_mel(nyquist)), n_mels + 2, dtype=torch.float64)
    )
    lower, centre, upper = edges[:-2], edges[1:-1], edges[2:]
    rising = (freqs[:, None] - lower) / (centre - lower)
    falling = (upper - freqs[:, None]) / (upper - centre)
    return torch.clamp(torch.minimum(rising, falling), min=0.0).float()


class AudioStem(_TokenStem):
    """Mono waveform -> log-mel spectrogram (torch.stft, Hann window, power, mel filterbank, log)
    -> patch x patch (mel x time) patches by a strided conv; the ragged time tail is dropped.

    Waveforms shorter than `AudioStem.samples()` are zero-padded at the end, longer ones cropped,
    so the token count is always the spec's. The window and filterbank are derived buffers
    (not saved in checkpoints); `reset_buffers()` recomputes them, e.g. after a meta-device build.
    """

    def __init__(self, stem: AudioStemSpec, width: int, cls: bool):
        super().__init__()
        self.spec = stem
        self.register_buffer("window", torch.empty(stem.n_fft), persistent=False)
        self.register_buffer(
            "mel_fb", torch.empty(stem.n_fft // 2 + 1, stem.n_mels), persistent=False
        )
        self.patch_embed = nn.Conv2d(1, width, stem.patch, stride=stem.patch, bias=stem.patch_bias)
        self._init_cls(width, cls)
        self.pos_embed = nn.Parameter(torch.zeros(stem.patches() + int(cls), width))
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        s, device = self.spec, self.patch_embed.weight.device
        if device.type == "meta":
            return
        self.window = torch.hann_window(s.n_fft, periodic=True, device=device)
        self.mel_fb = mel_filterbank(s.sample_rate, s.n_fft, s.n_mels).to(device)

    def log_mel(self, wave: torch.Tensor) -> torch.Tensor:
        """[B, samples] waveform -> [B, n_mels, frames] log-mel power, computed in float32."""
        s = self.spec
        if wave.dim() != 2:
            raise ValueError(
                f"audio input must be a mono waveform [B, samples], got {list(wave.shape)}"
            )
        wave = wave.float()
        target = s.samples()
        if wave.shape[1] < target:
            wave = F.pad(wave, (0, target - wave.shape[1]))
        wave = wave[:, :target]
        spec = torch.stft(
            wave,
            n_fft=s.n_fft,
            hop_length=s.hop,
            win_length=s.n_fft,
            window=self.window.float(),
            center=True,
            pad_mode="reflect",
            return_complex=True,
        )
        power = spec.real.square() + spec.imag.square()  # [B, n_fft // 2 + 1, frames]
        mel = torch.einsum("bft,fm->bmt", power, self.mel_fb.float())
        return torch.log(mel.clamp(min=LOG_MEL_FLOOR))

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        mel = self.log_mel(wave).unsqueeze(1).to(self.patch_embed.weight.dtype)
        # [B, mel_grid * time_grid, width]; a strided conv drops the ragged time tail
        tokens = self.patch_embed(mel).flatten(2).transpose(1, 2)
        return self._prepend_cls(tokens) + self.pos_embed.to(tokens.dtype)


class TimeSeriesStem(_TokenStem):
    """Sensor windows [B, channels, length] -> patches of `patch` steps mixing all channels,
    each flattened channel-major (channel, step) and mapped to the width by one Linear."""

    def __init__(self, stem: TimeSeriesStemSpec, width: int, cls: bool):
        super().__init__()
        self.spec = stem
        self.patch_embed = nn.Linear(stem.channels * stem.patch, width, bias=stem.patch_bias)
        self._init_cls(width, cls)
        self.pos_embed = nn.Parameter(torch.zeros(stem.patches() + int(cls), width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        _check_shape(x, (s.channels, s.length), "timeseries")
        b = x.shape[0]
        x = x.to(self.patch_embed.weight.dtype)
        patches = x.reshape(b, s.channels, s.patches(), s.patch).permute(0, 2, 1, 3)
        tokens = self.patch_embed(patches.reshape(b, s.patches(), s.channels * s.patch))
        return self._prepend_cls(tokens) + self.pos_embed.to(tokens.dtype)


class TextStem(nn.Module):
    """Token ids [B, T] (T <= context_length, 0 = padding after the end) -> embeddings + positions."""

    def __init__(self, stem: TextStemSpec, width: int):
        super().__init__()
        self.spec = stem
        self.token_embed = nn.Embedding(stem.vocab_size, width)
        self.pos_embed = nn.Parameter(torch.zeros(stem.context_length, width))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.shape[1] > self.spec.context_length:
            raise ValueError(
                f"text input must be token ids [B, T] with T <= {self.spec.context_length}, "
                f"got {list(ids.shape)}"
            )
        if ids.is_floating_point():
            raise ValueError(f"text input must be integer token ids, got {ids.dtype}")
        x = self.token_embed(ids)
        return x + self.pos_embed[: ids.shape[1]].to(x.dtype)

    def key_mask(self, ids: torch.Tensor) -> torch.Tensor:
        """True for non-padding tokens. A row of padding only (no text at all) keeps every
        position, so attention over it stays defined instead of producing NaN."""
        keep = ids != 0
        return keep | ~keep.any(dim=1, keepdim=True)


def build_stem(tower: TowerSpec) -> nn.Module:
    """The stem module for `tower.modality`, sized by the tower's stem spec and width."""
    cls = tower.has_cls_token()
    stems = {
        "image": ImagePatchStem,
        "video": VideoStem,
        "audio": AudioStem,
        "timeseries": TimeSeriesStem,
    }
    if tower.modality == "text":
        return TextStem(tower.stem, tower.width)
    return stems[tower.modality](tower.stem, tower.width, cls)


__all__ = [
    "AudioStem",
    "ImagePatchStem",
    "TextStem",
    "TimeSeriesStem",
    "VideoStem",
    "build_stem",
    "mel_filterbank",
]
